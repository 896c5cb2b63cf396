"""The search over a traced model: valid starts, per-layer decisions, a problem flat in depth, the robust choice.

The references are independent of the search: the textbook plans priced on the same problem, the tied (all
layers alike) optimum, the problem's own size, and one device's training steps.
"""
from __future__ import annotations

import functools
import math
import re

import pytest
import torch

from autopar.errors import InfeasibleError, SearchTimeoutError
from autopar.profiler import profile
from autopar.runtime.launch import run_ranks
from autopar.solver import solve
from autopar.solver.anytime import solve_problem
from autopar.solver.assemble import to_plan
from autopar.solver.mesh import make_mesh
from autopar.solver.needs import budget_that_fits
from autopar.solver.robust import ROBUST_MARGIN
from autopar.solver.search import search_mesh
from autopar.tracer import trace
from tests.codegen.harness import reference, run_plans, trace_model
from tests.zoo import load_zoo


def gpt_model(n_layer: int, device: str, batch: int = 8, seq: int = 64):
    """GPT-2 (examples/gpt2.py) of `n_layer` tiny layers and a batch in which activations weigh."""
    m = load_zoo("gpt2")
    torch.manual_seed(0)
    with torch.device(device):
        model = m.GPT(m.GPTConfig(n_layer=n_layer, n_head=4, n_embd=64, vocab_size=256, block_size=seq)).train()
        ids = torch.randint(0, 256, (batch, seq))
    return model, {"input_ids": ids, "labels": ids.clone()}


@functools.lru_cache(maxsize=None)
def gpt(n_layer: int):
    traced = trace(*gpt_model(n_layer, "meta"))
    return traced, profile(traced)


def layers(plan) -> dict[int, list[tuple[str, str, bool]]]:
    """Per layer of `plan` (transformer.h.<k>), its nodes' (op, strategy, recomputed) in graph order."""
    out: dict[int, list] = {}
    for d in plan.nodes:
        found = re.match(r"transformer\.h\.(\d+)", d.module)
        if found:
            out.setdefault(int(found[1]), []).append((d.op, str(d.strategy), d.recompute))
    return out


def test_a_tiny_time_limit_still_plans_no_slower_than_the_fastest_textbook_plan_that_fits():
    """Out of time at once, the search answers with a valid start: never an error, never slower than the
    fastest textbook plan that fits (priced on the same problem)."""
    traced, prof = gpt(4)
    mesh = make_mesh(4, (2, 2), "cpu")
    budget = 0.6 * solve(traced, prof, mesh, margin=0.0).memory.total_bytes
    plan = solve(traced, prof, mesh, memory_budget_bytes=budget, time_limit_s=1e-3, baselines=True, margin=0.0)
    fitting = [b.time.total_s for b in plan.baselines if b.fits]
    assert fitting, "a textbook plan fits this budget"
    assert plan.memory.total_bytes <= budget
    assert plan.time.total_s <= min(fitting) * (1 + 1e-9)
    assert plan.solver.status == "optimal" or any("stopped at its time limit" in n for n in plan.notes)


def test_a_budget_is_infeasible_only_below_the_least_need_which_then_plans():
    traced, prof = gpt(4)
    mesh = make_mesh(2, (2,), "cpu")
    with pytest.raises(InfeasibleError) as info:
        solve(traced, prof, mesh, memory_budget_bytes=1e5)
    assert not isinstance(info.value, SearchTimeoutError)  # proven, not out of time
    need = info.value.min_memory_bytes
    assert need > 1e5 and "memory_budget_bytes=" in str(info.value)
    assert solve(traced, prof, mesh, memory_budget_bytes=budget_that_fits(need)).memory.total_bytes <= budget_that_fits(need)


def test_a_deep_and_a_shallow_model_decide_every_layer_alike_on_problems_of_one_size():
    """4 and 24 layers of one block: one problem size (the layers tied: the search's work does not grow with
    depth), and every repeated layer of either model decided as the shallow model's first repeated layer."""
    searched = {}
    for n_layer in (4, 24):
        traced, prof = gpt(n_layer)
        mesh = make_mesh(2, (2,), "cpu")
        found = search_mesh(traced, prof, mesh, 16e9)
        searched[n_layer] = (found, layers(to_plan(traced, mesh, found.built, found.solution)))
    (shallow, shallow_layers), (deep, deep_layers) = searched[4], searched[24]
    assert len(deep.tied.problem.nodes) == len(shallow.tied.problem.nodes)
    assert deep.solution.report.num_variables == shallow.solution.report.num_variables
    assert len(deep_layers) == 24 and deep_layers[0] == shallow_layers[0]
    assert all(deep_layers[k] == shallow_layers[1] for k in range(1, 24))
    assert all(shallow_layers[k] == shallow_layers[1] for k in range(1, 4))


@pytest.mark.timeout(240)
def test_a_budget_between_none_and_all_recomputes_some_layers_faster_than_all_alike_and_trains_like_one_device():
    """Where the budget binds, deciding per layer recomputes some layers and not others, faster than the best
    plan with every layer alike; that plan trains like one device on 2 gloo ranks."""
    model, sample = gpt_model(8, "cpu")
    traced = trace_model(model, sample)
    prof = profile(traced)
    mesh = make_mesh(2, (2,), "cpu")
    ample = search_mesh(traced, prof, mesh, 16e9)
    budget = 0.8 * ample.solution.memory.total_bytes
    found = search_mesh(traced, prof, mesh, budget, time_limit_s=60.0)
    plan = to_plan(traced, mesh, found.built, found.solution)
    recomputed = [k for k, nodes in layers(plan).items() if any(r for _, _, r in nodes)]
    assert 0 < len(recomputed) < 8 and plan.memory.total_bytes <= budget
    alike = solve_problem(found.tied.problem, 60.0)  # every repeated layer deciding as one
    assert plan.time.total_s < alike.time.total_s
    ref = reference(model, sample, 3)
    case = ("per-layer recompute", model, sample, traced, plan, ref, 3)
    for rank_results in run_ranks(run_plans, 2, (2,), [case], timeout_s=200):
        assert [label for label, _ in rank_results] == [case[0]]


def test_a_plan_predicted_faster_than_a_textbook_plan_by_less_than_the_margin_gives_way_to_it():
    """On 2 CPU ranks the cost model prices a plan splitting a parameter a little faster than pure data parallel
    (AdamW's step on half of it); inside the measured error, data parallel is chosen and a note says why."""
    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=16, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    prof = profile(traced)
    mesh = make_mesh(2, (2,), "cpu")
    fastest = solve(traced, prof, mesh, margin=0.0, baselines=True)
    dp = {b.name: b for b in fastest.baselines}["data_parallel"]
    assert fastest.time.total_s < dp.time.total_s < fastest.time.total_s * (1 + ROBUST_MARGIN)
    chosen = solve(traced, prof, mesh)
    assert chosen.time.total_s == pytest.approx(dp.time.total_s, rel=1e-9)
    assert all(p.use.is_replicate() and not p.zero for p in chosen.params)
    assert any("pure data parallel" in n and "measured error" in n for n in chosen.notes)
    assert math.isclose(chosen.memory.total_bytes, dp.memory.total_bytes, rel_tol=1e-9)
