"""The `autopar` commands run for real through `main(argv)` (in-process) and as a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from autopar.cli import main
from autopar.report.explain import diff
from autopar.solver.plan import PlanSource
from autopar.solver.plan_io import save_plan
from autopar.solver.spec import Spec, Strategy
from tests.cli.plans import EXAMPLES, hand_plan, traced_zoo, two_axis_mesh

GPT2 = str(EXAMPLES / "gpt2.py")
TINY = ["--size", "tiny", "--batch-size", "2", "--seq-len", "16"]


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """a.json: data parallel; b.json: the MLP's c_fc column-parallel, embeddings ZeRO-sharded, block 1 recomputed."""
    d = tmp_path_factory.mktemp("plans")
    traced = traced_zoo("gpt2")
    src = PlanSource(GPT2, "", 2, 16, "tiny", "adamw")
    a = hand_plan(traced, two_axis_mesh(), source=src)
    b = hand_plan(traced, two_axis_mesh(), column=("c_fc.weight", "c_fc.bias"), zero=("transformer.wte.weight",),
                  recompute_module="transformer.h.1", time_s=(0.08, 0.03, 0.01), source=src)
    b = replace(b, memory=replace(b.memory, params_bytes=0.5e9, activations_bytes=2e9))
    save_plan(a, d / "a.json")
    save_plan(b, d / "b.json")
    return d, a, b


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_show_prints_the_report(capsys, plans):
    d, _, b = plans
    code, out, _ = run(capsys, "show", str(d / "b.json"))
    assert code == 0
    assert "Mesh dp=2 x tp=2  (4 devices, test)" in out
    row = next(line for line in out.splitlines() if "transformer.h.0.mlp.c_fc" in line)  # block 1 is recomputed: not merged
    assert "column-parallel over tp" in row and "sharded over tp" in row
    assert "transformer.h.1.ln_1" in out and "all" in next(line for line in out.splitlines() if "transformer.h.1.ln_1" in line)
    assert "ZeRO-sharded over dp" in next(line for line in out.splitlines() if "transformer.wte" in line)
    assert "476.84 MiB" in out  # params 0.5e9 bytes per device, in GiB units
    assert "120.0 ms" in out  # 80 + 30 + 10 ms
    assert "all-reduce" in out and "381.47 MiB" in out  # 4e8 bytes
    assert "1 of 28 parameters ZeRO-sharded" in out


def test_show_merges_identical_blocks(capsys, plans):
    d, a, _ = plans
    code, out, _ = run(capsys, "show", str(d / "a.json"), "--json")
    assert code == 0
    s = json.loads(out)
    rows = {r["module"]: r for r in s["layers"]}
    assert rows["transformer.h.0..1.mlp.c_fc"]["count"] == 2
    assert rows["transformer.h.0..1.mlp.c_fc"]["params"] == "replicated"
    assert rows["transformer.h.0..1.attn.c_attn"]["output"] == "batch over dp"
    assert s["memory"]["total_bytes"] == pytest.approx(1e9 + 1e9 + 2e9 + 3e9 + 0.5e9)
    assert s["time"]["total_s"] == pytest.approx(0.12)
    assert s["comm_bytes_by_kind"] == {"all_reduce": 4e8, "all_gather": 1e8}


def test_show_html_is_self_contained(capsys, plans, tmp_path):
    d, _, _ = plans
    page = tmp_path / "plan.html"
    code, out, _ = run(capsys, "show", str(d / "b.json"), "--html", str(page))
    assert code == 0 and f"HTML report written to {page}" in out
    html = page.read_text()
    assert "transformer.h.0.mlp.c_fc" in html
    assert "<svg" not in html and "the plan file records no memory timeline" in html  # a hand-made plan has none
    assert "#ecd0f5" in html  # the tensor-parallel colour on the c_fc row
    for external in ("<script", "<link", "src=", "href="):
        assert external not in html


def test_diff_reports_changes_and_effect(capsys, plans):
    d, a, b = plans
    code, out, _ = run(capsys, "diff", str(d / "a.json"), str(d / "b.json"), "--json")
    assert code == 0
    r = json.loads(out)
    assert r["time_delta"]["total_s"] == pytest.approx(b.time.total_s - a.time.total_s)
    assert r["memory_delta"]["params_bytes"] == pytest.approx(-0.5e9)
    assert r["memory_delta"]["activations_bytes"] == pytest.approx(-1e9)
    changed = {x["module"]: x for x in r["layers"]}
    assert changed["transformer.wte"]["b"] == "ZeRO-sharded over dp | batch over dp | recompute no"
    assert changed["transformer.h.0.mlp.c_fc"]["b"].startswith("weight: column-parallel over tp; bias: sharded over tp")
    assert changed["transformer.h.1.mlp.c_fc"]["b"].endswith("recompute all")  # a different change: not merged with block 0
    assert len(changed) == 13  # wte, block 0's c_fc, and the 11 modules of block 1
    same_change = diff(a, replace(b, nodes=tuple(replace(n, recompute=False) for n in b.nodes)))
    assert [x["module"] for x in same_change["layers"]] == ["transformer.wte", "transformer.h.0..1.mlp.c_fc"]
    assert len(r["params"]) == 5  # c_fc weight+bias in 2 blocks, wte
    code, out, _ = run(capsys, "diff", str(d / "a.json"), str(d / "b.json"))
    assert code == 0
    assert "step time 120.0 ms -> 120.0 ms (+0 us" in out
    assert "peak memory 6.98 GiB -> 5.59 GiB (-1.40 GiB" in out


def test_explain_prices_alternatives(capsys, plans, tmp_path):
    d, a, _ = plans
    node = next(n for n in a.nodes if n.module == "transformer.h.0.mlp.c_fc" and n.op.startswith("aten.addmm"))
    rep = Spec.parse("RR")
    chosen = replace(node, strategy=Strategy((rep, rep, rep), (rep,)))  # a real strategy of addmm (hand_plan's is not)
    save_plan(replace(a, nodes=tuple(chosen if n.node == node.node else n for n in a.nodes)), tmp_path / "a.json")
    code, out, _ = run(capsys, "explain", str(tmp_path / "a.json"), node.node, "--json", "--model", GPT2)
    assert code == 0
    r = json.loads(out)
    [entry] = r["nodes"]
    alts = entry["alternatives"]
    assert r["priced"] and len(alts) > 3 and [x["strategy"] for x in alts if x["chosen"]] == ["(RR, RR, RR) -> RR"]
    # hand count: addmm (B*T=32, 64) x (64, 256): 2*32*64*256 FLOPs forward; backward 2x that.
    # The mesh does 100 TFLOP/s, so a strategy that splits over all 4 devices takes a quarter of the replicated time.
    fwd = 2 * 32 * 64 * 256
    rep = next(x for x in alts if x["strategy"] == "(RR, RR, RR) -> RR")
    assert rep["compute_s"] == pytest.approx(max(fwd / 100e12, 32 * 256 * 4 / 2e12) + max(2 * fwd / 100e12, 2 * 32 * 256 * 4 / 2e12))
    code, out, _ = run(capsys, "explain", str(tmp_path / "a.json"), "transformer.h.0.mlp.c_fc", "--model", GPT2)
    assert code == 0 and "chosen" in out and "c_fc" in out and "parameter transformer.h.0.mlp.c_fc.weight (stored out x in, as nn.Linear): replicated" in out


def test_explain_prices_a_parameter_by_its_optimizer_step(capsys, plans):
    """A parameter's alternatives cost what the ILP charges them: AdamW's step on the block each device holds
    (10 launches, 8 writes of the block: hand count against the mesh's numbers)."""
    d, a, _ = plans
    weight = next(p for p in a.params if p.fqn == "transformer.h.0.mlp.c_fc.weight")
    code, out, _ = run(capsys, "explain", str(d / "a.json"), weight.fqn, "--json", "--model", GPT2)
    assert code == 0
    alts = {x["strategy"]: x for x in json.loads(out)["nodes"][0]["alternatives"]}
    mesh, nbytes = a.mesh, 64 * 256 * 4  # c_fc: Conv1D (64 -> 256), fp32
    for label, x in alts.items():
        block = Spec.parse(label.split("-> ")[1]).shard_factor(mesh.shape)
        assert x["compute_s"] == pytest.approx(10 * mesh.op_overhead_s + 8 * nbytes / block / mesh.mem_bandwidth_bytes_per_s)
        assert x["comm_s"] == 0.0
    assert len({x["compute_s"] for x in alts.values()}) > 1  # a sharded block updates faster


def test_explain_never_imports_the_model_file_a_plan_names(capsys, plans, tmp_path):
    """A plan naming a model file that runs code: explain without --model prices nothing and imports nothing,
    and says to pass --model."""
    d, a, _ = plans
    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile.py"
    hostile.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    save_plan(replace(a, source=replace(a.source, model_file=str(hostile))), tmp_path / "a.json")
    code, out, _ = run(capsys, "explain", str(tmp_path / "a.json"), "transformer.h.0.mlp.c_fc")
    assert code == 0 and not marker.exists()
    assert f"alternatives not priced: the plan was made from {hostile}, which explain never imports" in " ".join(out.split())


def test_explain_unknown_target(capsys, plans):
    d, _, _ = plans
    code, _, err = run(capsys, "explain", str(d / "a.json"), "transformer.h.9.mlp")
    assert code == 1
    assert "no node, parameter or module named 'transformer.h.9.mlp'" in err and "fix:" in err


# ---------------------------------------------------------------- errors: one line of cause, one of fix
@pytest.mark.parametrize("argv, code, cause", [
    (["plan", "missing.py", "--gpus", "8"], 2, "model file 'missing.py' does not exist"),
    (["plan", GPT2, "--gpus", "6", "--mesh", "2x4"], 2, "--mesh 2x4 has 8 devices but --gpus is 6"),
    (["plan", GPT2, "--gpus", "8", "--hardware", "tpu9"], 2, "unknown hardware 'tpu9'"),
    (["show", "nope.json"], 2, "plan file 'nope.json' does not exist"),
    (["plan", "--gpus", "8"], 2, "give either MODEL.py or --hf-config, not neither"),
])
def test_usage_errors(capsys, argv, code, cause):
    got, out, err = run(capsys, *argv)
    assert got == code
    lines = err.strip().splitlines()
    assert cause in lines[0] and lines[1].strip().startswith("fix:") and len(lines) == 2
    assert "Traceback" not in err


def test_bad_memory_string_is_a_usage_error(capsys):
    code, _, err = run(capsys, "plan", GPT2, "--gpus", "8", "--memory", "lots")
    assert code == 2 and "cannot read 'lots' as a memory size" in err


def test_no_model_in_file(capsys, tmp_path):
    f = tmp_path / "empty.py"
    f.write_text("x = 1\n")
    code, _, err = run(capsys, "plan", str(f), "--gpus", "2")
    assert code == 1
    assert "defines neither `model` and `sample_input` nor a `build(batch_size, seq_len)` function" in err and "fix:" in err


def test_corrupt_plan(capsys, plans, tmp_path):
    d, _, _ = plans
    obj = json.loads((d / "a.json").read_text())
    del obj["nodes"][3]["strategy"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(obj))
    code, _, err = run(capsys, "show", str(bad))
    assert code == 1 and "bad.json: missing field 'nodes[3].strategy'" in err and "Traceback" not in err


@pytest.mark.long
def test_subprocess_exit_codes(plans):
    d, _, _ = plans
    ok = subprocess.run([sys.executable, "-m", "autopar.cli", "show", str(d / "a.json")], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "Mesh dp=2 x tp=2" in ok.stdout
    usage = subprocess.run([sys.executable, "-m", "autopar.cli", "plan", "--gpus", "0"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "0 must be at least 1" in usage.stderr and "Traceback" not in usage.stderr
