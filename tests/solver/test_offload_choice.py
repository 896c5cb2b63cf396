"""The solver's own tier choice (`Restrictions.offload="free"`, `solver.offload`): the host tier only where the
device budget binds (never when the fastest plan fits, always when no device plan fits), priced as `tier_cost`
counts it, within the host budget; on random problems the ILP's tier is brute force's, and `autopar explain`
prices the other tier as the forced tier's pricing does."""
from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from autopar.errors import InfeasibleError
from autopar.report.explain import explain, make_context
from autopar.solver import fixed_plan, solve
from autopar.solver.mesh import make_mesh
from autopar.solver.anytime import solve_problem
from autopar.solver.ilp import Restrictions
from autopar.solver.evaluate import evaluate
from autopar.solver.offload import TierCost, offloaded_profile, storage_shard, tier_cost, with_offload
from autopar.solver.problem import Problem
from tests.solver.test_ilp import GIB, every_assignment, random_problem
from tests.solver.test_offload_cost import case  # noqa: F401 -- a fixture: test_offload_cost's model, traced and profiled

HOST = 1e12  # a host budget that never binds


def _least_bytes(traced, prof, mesh, host_budget_bytes=None) -> float:
    """The least device memory any plan needs (the infeasible report of a 1-byte budget)."""
    with pytest.raises(InfeasibleError) as err:
        solve(traced, prof, mesh, memory_budget_bytes=1, time_limit_s=5, host_budget_bytes=host_budget_bytes)
    return err.value.min_memory_bytes


@pytest.mark.parametrize("gpus", [1, 2])
def test_host_tier_exactly_when_the_device_budget_forces_it(case, gpus):
    traced, prof = case
    mesh = make_mesh(gpus, hardware="l4")
    roomy = solve(traced, prof, mesh, time_limit_s=5, host_budget_bytes=HOST)
    assert roomy.offloaded() == ()  # everything fits: the host tier only adds time
    device_least = _least_bytes(traced, prof, mesh)
    host_least = _least_bytes(traced, prof, mesh, HOST)
    assert host_least < device_least  # the host tier frees device memory no device plan can
    # where a device plan fits but little else does, a tier is chosen only when it is faster than that plan
    edge = device_least * 1.001
    device_only = solve(traced, prof, mesh, memory_budget_bytes=edge, time_limit_s=5)
    either = solve(traced, prof, mesh, memory_budget_bytes=edge, time_limit_s=5, host_budget_bytes=HOST)
    assert either.time.total_s <= device_only.time.total_s * (1 + 1e-6)
    assert either.offloaded() == () or either.time.total_s < device_only.time.total_s
    budget = (host_least + device_least) / 2
    tight = solve(traced, prof, mesh, memory_budget_bytes=budget, time_limit_s=5, host_budget_bytes=HOST)
    assert tight.offloaded() and tight.memory.total_bytes <= budget
    costs = [tier_cost(prof.params[p.fqn], storage_shard(p.storage, mesh), mesh) for p in tight.params if p.tier == "host"]
    assert tight.time.offload_s == pytest.approx(sum(c.step_s for c in costs))
    assert tight.memory.host_bytes == pytest.approx(sum(c.host_bytes for c in costs))
    stepped_on_device = [p for p in tight.params if p.tier == "device" and prof.params[p.fqn].optimizer_bytes]
    assert tight.memory.optimizer_bytes == pytest.approx(
        sum(prof.params[p.fqn].optimizer_bytes / storage_shard(p.storage, mesh) for p in stepped_on_device))


def test_host_budget_bounds_the_tier(case):
    traced, prof = case
    mesh = make_mesh(1, hardware="l4")
    device_least = _least_bytes(traced, prof, mesh)
    budget = (_least_bytes(traced, prof, mesh, HOST) + device_least) / 2
    need = solve(traced, prof, mesh, memory_budget_bytes=budget, time_limit_s=5, host_budget_bytes=HOST).memory.host_bytes
    with pytest.raises(InfeasibleError):  # the host cannot hold what the device must give up
        solve(traced, prof, mesh, memory_budget_bytes=budget, time_limit_s=5, host_budget_bytes=need / 2)
    assert _least_bytes(traced, prof, mesh, host_budget_bytes=0.0) == pytest.approx(device_least)


def test_explain_prices_the_other_tier_as_the_forced_tier_does(case):
    """`autopar explain` on a parameter: the plan with that parameter on the other tier, priced as `fixed_plan`
    prices the plan solved for the remaining host-tier parameters (`offloaded_profile`, `with_offload`)."""
    traced, prof = case
    mesh = make_mesh(1, hardware="l4")
    budget = (_least_bytes(traced, prof, mesh, HOST) + _least_bytes(traced, prof, mesh)) / 2
    plan = solve(traced, prof, mesh, memory_budget_bytes=budget, time_limit_s=5, host_budget_bytes=HOST)
    host = set(plan.offloaded())
    fqn = sorted(host)[0]
    result = explain(plan, fqn, make_context(plan, traced, prof.evaluate()))
    other = result["nodes"][0]["other_tier"]
    assert result["nodes"][0]["tier"] == "host" and other["tier"] == "device"
    rest = host - {fqn}
    choices = {d.node: d.strategy for d in plan.nodes if d.op != "output"}
    recompute = frozenset(d.node for d in plan.nodes if d.recompute)
    alone = with_offload(fixed_plan(traced, offloaded_profile(prof, rest), mesh, choices, recompute), rest)
    assert other["step_s"] == pytest.approx(alone.time.total_s, rel=1e-9)
    assert other["peak_bytes"] == pytest.approx(alone.memory.total_bytes, rel=1e-9)
    assert other["host_bytes"] == pytest.approx(alone.memory.host_bytes, rel=1e-9)
    assert other["fits"] == (other["peak_bytes"] <= budget)


def _with_host_tier(p: Problem, rng: random.Random, lean_rng: random.Random) -> Problem:
    """`p` with a host tier on every option the optimizer steps (random copies, host step and host bytes; a device
    step within the option's compute, ZeRO saving part of it; on a coin's toss ZeRO-Offload's layout, a third of the
    parameter's bytes its bf16 copy) and a host budget that binds for some plans."""
    nodes = []
    for node in p.nodes:
        opts = []
        for o in node.options:
            if not o.optimizer_bytes:
                opts.append(o)
                continue
            update_s = rng.uniform(0, 1) * o.compute_s
            zero = o.zero and replace(o.zero, update_saving_s=update_s * (1 - 1 / o.zero.factor))
            tier = TierCost(o.optimizer_bytes, o.param_bytes, o.grad_bytes, o.optimizer_bytes, rng.uniform(0, 2),
                            rng.uniform(0, 2), update_s)
            if lean_rng.random() < 0.5:  # (its own draws: the problems are those `rng` makes without it)
                master = 2 / 3 * o.param_bytes
                tier = replace(tier, host_params_bytes=master, lean_bytes_saved=master + o.grad_bytes,
                               lean_transfer_s=lean_rng.uniform(0, 1), copy_grad_bytes=o.param_bytes / 3,
                               summed_grad_bytes=o.grad_bytes)
            opts.append(replace(o, update_s=update_s, zero=zero, host=tier))
        nodes.append(replace(node, options=tuple(opts)))
    return replace(p, nodes=tuple(nodes), host_budget_bytes=rng.uniform(1, 6) * GIB)


def _every_tier(p: Problem):
    for a in every_assignment(p):
        hosted = [p.nodes[v].options[c].host is not None for v, c in enumerate(a.choice)]
        for offload in itertools.product(*([False, True] if ok else [False] for ok in hosted)):
            yield replace(a, offload=offload if any(offload) else ())


def test_random_problems_with_the_host_tier_match_brute_force():
    """The ILP's tier (h, and h AND z under ZeRO) against every combination of option, recompute, ZeRO and tier,
    each priced by `evaluate`, within the device and host budgets."""
    rng, lean_rng = random.Random(3), random.Random(4)
    chosen = both = lean = 0
    for _ in range(12):
        p = _with_host_tier(random_problem(rng), rng, lean_rng)
        fitting = [(t.total_s, a) for a in _every_tier(p) for m, t in [evaluate(p, a)]
                   if m.total_bytes <= p.budget_bytes * (1 + 1e-9) and m.host_bytes <= p.host_budget_bytes * (1 + 1e-9)]
        if not fitting:
            with pytest.raises(InfeasibleError):
                solve_problem(p, restrictions=Restrictions(offload="free"))
            continue
        sol = solve_problem(p, restrictions=Restrictions(offload="free"))
        assert sol.time.total_s == pytest.approx(min(fitting, key=lambda f: f[0])[0], rel=1e-6, abs=1e-9)
        assert sol.memory.total_bytes <= p.budget_bytes * (1 + 1e-6)
        assert sol.memory.host_bytes <= p.host_budget_bytes * (1 + 1e-6)
        a = sol.assignment
        chosen += any(a.offload)
        both += any(a.offloaded(v) and a.zero[v] for v in range(len(a.choice)))
        lean += any(a.offloaded(v) and not a.zero[v] and p.nodes[v].options[c].host.lean for v, c in enumerate(a.choice))
    assert chosen >= 3 and both >= 2 and lean >= 2  # the tier was the answer in several problems, with ZeRO storage in some
