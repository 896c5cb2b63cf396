"""Plan files written before plans recorded parameter layouts, the memory timeline and the model's class still load,
and their reports say what they cannot tell: a split weight is named by its dim, and the HTML page has no chart."""
from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.errors import PlanFormatError
from autopar.solver.plan_io import load_plan, plan_from_json, plan_to_json
from autopar.solver.spec import Shard

pytestmark = pytest.mark.xdist_group("report")  # one worker: the session's plans (conftest) are made once


def _without_new_fields(text: str) -> str:
    obj = json.loads(text)
    del obj["memory_timeline"], obj["fingerprint"]["model"]
    for p in obj["params"]:
        del p["layout"]
    return json.dumps(obj)


def test_new_fields_round_trip(plans):
    plan = load_plan(plans / "hf_gpt2-tp.json")
    assert plan.memory_timeline and plan.fingerprint.model == "GPT2LMHeadModel"
    assert {p.fqn: p.layout for p in plan.params}["transformer.h.0.mlp.c_fc.weight"] == "in_out"
    assert plan_from_json(plan_to_json(plan)) == plan


def test_an_older_plan_file_loads_and_says_what_it_cannot_tell(plans, tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(_without_new_fields((plans / "hf_gpt2-tp.json").read_text()))
    plan = load_plan(old)
    assert all(p.layout == "" for p in plan.params) and plan.memory_timeline == () and plan.fingerprint.model == ""
    assert main(["show", str(old), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    rows = {r["module"]: r["params"] for r in s["layers"]}
    # HF's c_fc weight is (64, 256): split by its outputs on dim 1; without the layout the report names the dim
    assert rows["transformer.h.0..1.mlp.c_fc"] == "weight: split on dim 1 over tp; bias: replicated"
    # no more "hidden-split" for the position table, whichever axis the solver split it over: that needs the layout too
    wpe = {p.fqn: p for p in plan.params}["transformer.wpe.weight"].use
    axes = {dim: [plan.mesh.axis_names[k] for k, pl in enumerate(wpe.placements) if isinstance(pl, Shard) and pl.dim == dim]
            for dim in range(2)}
    words = "; ".join(f"split on dim {dim} over {'+'.join(names)}" for dim, names in axes.items() if names)
    assert rows["transformer.wpe"] == (words or "replicated")
    assert any("does not record parameter layouts" in n for n in s["unrecorded"])
    assert main(["show", str(old), "--html", str(tmp_path / "old.html")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "does not record parameter layouts" in out and "does not record the memory timeline" in out
    page = (tmp_path / "old.html").read_text()
    assert "<svg" not in page and "records no memory timeline" in page


def test_an_unknown_layout_is_a_format_error(plans):
    obj = json.loads((plans / "gpt2-tp.json").read_text())
    obj["params"][2]["layout"] = "diagonal"
    with pytest.raises(PlanFormatError, match=r"field 'params\[2\]\.layout' should be one of .*'out_in'.*got 'diagonal'"):
        plan_from_json(json.dumps(obj), "plan.json")
