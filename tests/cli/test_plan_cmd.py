"""`autopar plan` end to end on tiny zoo models (real trace, profile and ILP), and `autopar profile`."""
from __future__ import annotations

import json

import pytest
import torch

from autopar.cli import main
from autopar.model_file import load_model_file
from autopar.runtime.launch import run_ranks
from autopar.solver.plan_io import load_plan
from tests.cli.plans import EXAMPLES
from tests.codegen.harness import reference, train

GPT2 = str(EXAMPLES / "gpt2.py")
MLP = str(EXAMPLES / "mlp.py")
TINY = ["--size", "tiny", "--batch-size", "2", "--seq-len", "16"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    d = tmp_path_factory.mktemp("planned")
    argv = ["plan", GPT2, *TINY, "--gpus", "2", "--hardware", "cpu", "--save", str(d / "plan.json"), "--html", str(d / "plan.html"), "--json"]
    code = main(argv)
    return d, code


def test_plan_saves_a_plan_and_prints_json(planned, capsys):
    d, code = planned
    assert code == 0
    plan = load_plan(d / "plan.json")
    assert plan.source.model_file == GPT2 and (plan.source.batch_size, plan.source.seq_len, plan.source.size) == (2, 16, "tiny")
    assert [b.name for b in plan.baselines] == ["data_parallel", "zero3", "megatron"]
    assert plan.mesh.hardware == "cpu" and plan.mesh.num_devices == 2
    code, out, _ = run(capsys, "show", str(d / "plan.json"), "--json")
    s = json.loads(out)
    assert s["time"]["total_s"] == pytest.approx(plan.time.total_s)
    assert s["memory"]["total_bytes"] == pytest.approx(plan.memory.total_bytes)
    # the pure-DP baseline is a restriction of the ILP's search space: the plan can only be as fast or faster
    dp = next(b for b in s["baselines"] if b["name"] == "data_parallel")
    assert dp["plan_speedup"] >= 1 - 1e-9
    assert any(r["module"] == "transformer.h.0..1.mlp.c_fc" and r["count"] == 2 for r in s["layers"])
    html = (d / "plan.html").read_text()
    assert "<svg" in html and "transformer.h.0..1.mlp.c_fc" in html


def test_plan_text_report(capsys):
    code, out, _ = run(capsys, "plan", MLP, "--size", "tiny", "--batch-size", "8", "--gpus", "2", "--mesh", "2", "--hardware", "cpu")
    assert code == 0
    assert "Mesh dp=2  (2 devices, cpu)" in out
    assert "layers.0..2.fc1" in out and "pure data parallel" in out and "ZeRO-3 / FSDP" in out


def test_load_reuses_the_plan(planned, capsys):
    d, _ = planned
    saved = load_plan(d / "plan.json")
    code, out, _ = run(capsys, "plan", GPT2, *TINY, "--gpus", "2", "--hardware", "cpu", "--load", str(d / "plan.json"), "--json")
    assert code == 0
    s = json.loads(out)
    assert s["solver"]["solve_s"] == saved.solver.solve_s  # not re-solved: the file's own numbers
    assert s["time"]["total_s"] == saved.time.total_s


def _train_with_plan(rank, world, model, sample, path):
    from autopar.api import parallelize

    return train(parallelize(model, sample, (world,), plan=path), sample, 2)


@pytest.mark.timeout(120)
def test_a_plan_saved_for_cpu_trains_where_it_was_planned_for(planned):
    """`autopar plan --hardware cpu --save` traces as `parallelize` on CPU ranks does (fake CPU tensors, where
    a `.contiguous()` the kernels satisfy leaves no clone): traced on meta, the file named two clones the
    ranks' graph does not have, and loading it failed."""
    d, _ = planned
    torch.manual_seed(0)
    model, sample = load_model_file(GPT2, 2, 16, device="cpu", size="tiny")
    ref = reference(model, sample, 2)
    for losses in run_ranks(_train_with_plan, 2, model, sample, str(d / "plan.json"), timeout_s=100):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-5, atol=0)


def test_load_mismatched_plan(planned, capsys):
    d, _ = planned
    code, _, err = run(capsys, "plan", GPT2, "--size", "tiny", "--batch-size", "4", "--seq-len", "16", "--gpus", "2",
                       "--hardware", "cpu", "--load", str(d / "plan.json"))
    assert code == 1
    first, fix = err.strip().splitlines()[-2:]  # after the phase timings
    assert "the plan does not match this model and mesh: activation shapes or dtypes differ" in first
    assert fix.strip().startswith("fix:")
    code, _, err = run(capsys, "plan", GPT2, *TINY, "--gpus", "2", "--hardware", "a100", "--load", str(d / "plan.json"))
    assert code == 1 and "hardware is 'cpu' in the plan but 'a100' here" in err


def test_infeasible_budget_names_the_minimum(capsys):
    code, _, err = run(capsys, "plan", MLP, "--size", "tiny", "--batch-size", "8", "--gpus", "2", "--hardware", "cpu", "--memory", "1000")
    assert code == 1
    first, fix = err.strip().splitlines()[-2:]  # after the phase timings
    assert "no plan fits: needs" in first and "per device" in first
    assert fix.strip().startswith("fix: pass --memory")
    assert "add --offload auto (with --host-memory" in fix  # every optimizer state was on the device: the host tier is a way out
    # the budget the fix names fits: passed back as it is, the same command plans
    budget = fix.split("--memory ")[1].split()[0]
    code, _, err = run(capsys, "plan", MLP, "--size", "tiny", "--batch-size", "8", "--gpus", "2", "--hardware", "cpu", "--memory", budget)
    assert code == 0, err


def test_offload_puts_the_optimizer_state_in_the_host_column(capsys):
    mlp = ["plan", MLP, "--size", "tiny", "--batch-size", "8", "--gpus", "1", "--hardware", "cpu"]
    code, out, _ = run(capsys, *mlp, "--json")
    on_device = json.loads(out)["memory"]
    code, out, _ = run(capsys, *mlp, "--offload", "optimizer", "--json")
    assert code == 0
    offloaded = json.loads(out)["memory"]
    assert offloaded["optimizer_bytes"] == 0 and offloaded["host_optimizer_bytes"] == on_device["optimizer_bytes"]
    assert offloaded["host_params_bytes"] == on_device["params_bytes"] == offloaded["params_bytes"]
    code, out, _ = run(capsys, *mlp, "--offload", "optimizer")
    assert "host bytes" in out and "host tier (copies, host optimizer step)" in out
    code, _, err = run(capsys, *mlp, "--offload", "layers.0.fc1.weight,nosuch")
    assert code != 0 and "['nosuch'] are not parameters of the model" in err
    # --offload auto: the solver's own tier, within the device budget the forced plan needs
    need = int(offloaded["total_bytes"]) + 1
    code, out, _ = run(capsys, *mlp, "--offload", "auto", "--host-memory", "1GB", "--memory", str(need), "--json")
    chosen = json.loads(out)["memory"]
    assert code == 0 and chosen["host_bytes"] > 0 and chosen["total_bytes"] <= need
    code, _, err = run(capsys, *mlp, "--host-memory", "1GB")
    assert code != 0 and "add --offload auto" in err
    code, _, err = run(capsys, *mlp, "--offload", "optimizer", "--memory", "1000")  # the host tier tried: not suggested
    assert code == 1 and "fix: pass --memory" in err and "--offload auto" not in err


def test_profile_command(capsys):
    code, out, _ = run(capsys, "profile", MLP, "--size", "tiny", "--batch-size", "8", "--json")
    assert code == 0
    rows = json.loads(out)
    # hand count: 3 blocks of (8, 32) @ (32, 64) and (8, 64) @ (64, 32), 2 FLOPs per multiply-add
    assert sum(r["fwd_flops"] for r in rows) == pytest.approx(3 * 2 * (2 * 8 * 32 * 64), rel=0.01)
    assert sum(r["param_bytes"] for r in rows) == 3 * (32 * 64 + 64 + 64 * 32 + 32) * 4
    code, out, _ = run(capsys, "profile", GPT2, *TINY)
    assert code == 0 and "transformer.h.0" in out and "total" in out


def test_a_plan_saved_at_a_gpus_default_budget_loads_back(tmp_path, capsys):
    """A GPU's default budget is its memory less its fixed overheads (CUDA context, NCCL): `--load` checks the file
    against that same budget, not the whole memory."""
    path = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", MLP, "--size", "tiny", "--batch-size", "8", "--gpus", "2", "--hardware", "h100",
                     "--mesh", "2", "--save", str(path))
    assert code == 0
    saved = load_plan(path)
    assert 0 < saved.fingerprint.budget_bytes < saved.mesh.memory_bytes
    code, out, err = run(capsys, "plan", MLP, "--size", "tiny", "--batch-size", "8", "--gpus", "2", "--hardware", "h100",
                         "--mesh", "2", "--load", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["time"]["total_s"] == saved.time.total_s


def test_precision_bf16_plans_the_mixed_precision_step(tmp_path):
    """`--precision bf16` traces under the policy: the plan holds float32 masters and their bf16 copies (1.5x fp32's
    parameter bytes on a data-parallel mesh), bf16 activations, and its matmuls priced at the bf16 rate; it records the
    precision, so `explain` traces the same graph."""
    plans = {}
    for precision in ("fp32", "bf16"):
        path = tmp_path / f"{precision}.json"
        assert main(["plan", GPT2, *TINY, "--gpus", "2", "--mesh", "2", "--hardware", "h100", "--precision", precision,
                     "--save", str(path), "--json"]) == 0
        plans[precision] = load_plan(path)
    fp32, bf16 = plans["fp32"], plans["bf16"]
    assert (fp32.source.precision, bf16.source.precision) == ("fp32", "bf16")
    assert not any(p.zero for p in fp32.params + bf16.params)
    assert bf16.memory.params_bytes == pytest.approx(1.5 * fp32.memory.params_bytes)
    assert bf16.memory.grads_bytes == pytest.approx(fp32.memory.grads_bytes)
    assert bf16.memory.activations_bytes < fp32.memory.activations_bytes
    assert bf16.time.compute_s < fp32.time.compute_s
