"""`autopar explain` says why each option that looks cheaper at a node lost: priced as the whole plan with only that
decision changed, it is slower (the solver's plan is optimal: no single change makes it faster) or it does not fit."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autopar.api import capture_copy, capture_device_for
from autopar.cli import main
from autopar.model_file import load_model_file
from autopar.profiler import profile
from autopar.report.explain import explain, make_context
from autopar.solver.plan import PlanSource
from autopar.solver.plan_io import load_plan, save_plan
from autopar.solver import fixed_plan
from autopar.tracer import trace
from tests.cli.plans import EXAMPLES

pytestmark = pytest.mark.xdist_group("report")  # one worker: the session's plans (conftest) are made once

GPT2 = str(EXAMPLES / "gpt2.py")


def _cheaper_here(result: dict) -> list[dict]:
    return [a for n in result["nodes"] for a in n["alternatives"] if a["step_s"] is not None and not a["chosen"]]


@pytest.mark.long
def test_explain_prints_a_legend_and_why_each_cheaper_option_lost(plans, tmp_path, capsys):
    plan = replace(load_plan(plans / "gpt2-dp.json"), source=PlanSource(GPT2, "", 4, 16, "tiny", "adamw"))
    save_plan(plan, tmp_path / "plan.json")
    assert main(["explain", str(tmp_path / "plan.json"), "transformer.h.0.mlp.c_fc", "--model", GPT2, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cheaper = _cheaper_here(result)
    assert cheaper  # options that cost less at their node than the chosen one: each says why it lost
    for a in cheaper:  # the plan is the ILP's optimum under an ample budget: no single change makes it faster
        assert a["fits"] and a["step_s"] >= plan.time.total_s * (1 - 1e-4), a
        assert a["why"].startswith(("step +", "as fast")), a
    assert main(["explain", str(tmp_path / "plan.json"), "transformer.h.0.mlp.c_fc", "--model", GPT2]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as words: rich wraps long lines
    assert "S(d) = split along tensor dim d over that axis, R = replicated" in out and "P = partial sums" in out
    assert "why not chosen" in out and "what it costs elsewhere" in out


@pytest.mark.long
def test_an_option_that_does_not_fit_says_so_and_is_priced_as_fixed_plan_prices_it(plans):
    """With the budget at the plan's own peak, options that need more memory do not fit; each option's step and
    peak are those `fixed_plan` gives the plan with that one strategy changed."""
    model, sample = load_model_file(GPT2, 4, 16, size="tiny")
    traced = trace(*capture_copy(model, sample, capture_device_for("cpu")))
    prof = profile(traced)
    plan = load_plan(plans / "gpt2-dp.json")
    tight = replace(plan, memory=replace(plan.memory, budget_bytes=plan.memory.total_bytes))
    ctx = make_context(tight, traced, prof.evaluate())
    result = explain(tight, "transformer.h.0.mlp.c_fc", ctx)  # its parameters and its ops
    priced = [(n["node"], a) for n in result["nodes"] for a in n["alternatives"] if a["step_s"] is not None and not a["chosen"]]
    assert any(not a["fits"] for _, a in priced) and any(a["fits"] for _, a in priced)
    for _, a in priced:
        assert a["fits"] == (a["peak_bytes"] <= tight.memory.budget_bytes * (1 + 1e-9))
        assert a["why"].startswith("does not fit") != a["fits"]
    for node, other in (priced[0], next(p for p in priced if not p[1]["fits"])):
        choices = {d.node: d.strategy for d in plan.nodes if d.op != "output"}
        changed = next(s for s in ctx.strategies[node] if str(s) == other["strategy"])
        alone = fixed_plan(traced, prof, plan.mesh, {**choices, node: changed}, memory_budget_bytes=plan.memory.budget_bytes)
        assert other["step_s"] == pytest.approx(alone.time.total_s, rel=1e-9)
        assert other["peak_bytes"] == pytest.approx(alone.memory.total_bytes, rel=1e-9)
