"""A host tier the caller forces (`offload="optimizer"` or names, `Option.forced_host`): the ILP prices it as
`evaluate` does while it chooses sharding, ZeRO and recompute (ZeRO-Offload's layout under bf16 included), so a
budget only that layout meets is feasible."""
from __future__ import annotations

import random
from dataclasses import replace

import pulp
import pytest
import torch

from autopar.api import profiled
from autopar.errors import InfeasibleError
from autopar.report.explain import explain, make_context
from autopar.report.terminal import host_tier_words
from autopar.report.units import fmt_bytes, fmt_seconds
from autopar.solver import solve
from autopar.solver.assemble import build_for
from autopar.solver.evaluate import evaluate
from autopar.solver.ilp import Restrictions, _affine, _Model, run
from autopar.solver.mesh import make_mesh
from autopar.solver.offload import HOST_ADAMW_PARAMS_PER_S, TierCost, offloaded_profile, with_offload
from autopar.solver.problem import Problem
from tests.codegen.mixed import BF16, trace_mixed
from tests.solver.test_offload_cost import Wide
from tests.solver.test_ilp import GIB, brute_force, random_problem


def _with_forced_tier(p: Problem, rng: random.Random) -> Problem:
    """`p` with some stepped options' state forced onto the host tier: no optimizer state or step saving on the
    device, a random price, and on a coin's toss ZeRO-Offload's layout (a third of the parameter's bytes its copy)."""
    nodes = []
    for node in p.nodes:
        opts = []
        for o in node.options:
            if not o.optimizer_bytes or rng.random() < 0.3:
                opts.append(o)
                continue
            tier = TierCost(o.optimizer_bytes, o.param_bytes, o.grad_bytes, o.optimizer_bytes, rng.uniform(0, 2),
                            rng.uniform(0, 2), 0.0)
            if rng.random() < 0.6:
                master = 2 / 3 * o.param_bytes
                tier = replace(tier, host_params_bytes=master, lean_bytes_saved=master + o.grad_bytes,
                               lean_transfer_s=rng.uniform(0, 1), copy_grad_bytes=o.param_bytes / 3,
                               summed_grad_bytes=o.grad_bytes)
            zero = o.zero and replace(o.zero, update_saving_s=0.0)
            opts.append(replace(o, optimizer_bytes=0.0, zero=zero, forced_host=tier))
        nodes.append(replace(node, options=tuple(opts)))
    return replace(p, nodes=tuple(nodes))


def test_a_forced_tier_is_priced_by_the_ilp_as_evaluate_prices_it():
    """On random problems the ILP's optimum is brute force's (every option, recompute and ZeRO priced by
    `evaluate`), and at that plan its objective and memory row are `evaluate`'s step and bytes."""
    rng = random.Random(5)
    solved = lean = both = 0
    for _ in range(10):
        p = _with_forced_tier(random_problem(rng), rng)
        ref = brute_force(p)
        model = _Model(p, Restrictions(), "time")
        model.add_memory_limit()
        out = run(model, "highs", 10.0)
        if ref is None:
            assert out.status == "infeasible"
            continue
        a = model.assignment()
        memory, time = evaluate(p, a)
        assert time.total_s == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
        assert _affine(model.memory_terms).value() / model.per_byte == pytest.approx(memory.total_bytes, rel=1e-6)
        tie_ms = 1e-3 * memory.total_bytes / GIB  # the ILP's tie-break: 1 us per GiB
        assert pulp.value(model.prob.objective) == pytest.approx(time.total_s * 1e3 + tie_ms, rel=1e-6)
        forced = [(v, p.nodes[v].options[c].forced_host) for v, c in enumerate(a.choice)]
        solved += 1
        lean += any(t is not None and t.lean and not a.zero[v] for v, t in forced)
        both += any(t is not None and a.zero[v] for v, t in forced)
    assert solved >= 5 and lean >= 2 and both >= 2  # ZeRO-Offload's layout and the float32 one under ZeRO exercised


def _least_bytes(traced, prof, mesh) -> float:
    """The least device memory any plan needs (the infeasible report of a 1-byte budget)."""
    with pytest.raises(InfeasibleError) as err:
        solve(traced, prof, mesh, memory_budget_bytes=1, time_limit_s=5)
    return err.value.min_memory_bytes


@pytest.fixture(scope="module")
def bf16_wide():
    """`Wide` traced and profiled under bf16 (float32 masters, AdamW)."""
    torch.manual_seed(0)
    model, sample = Wide(), torch.randn(4, 512)
    traced = trace_mixed(model, sample)
    return traced, profiled(traced, "adamw", model, BF16)


def test_under_bf16_a_budget_only_zero_offloads_layout_meets_fits_with_the_forced_tier(bf16_wide):
    """One device, every parameter forced onto the host tier under bf16, and a budget below what the device needs
    with the float32 masters and gradients kept there (the profile without the parameters' optimizer state, as a
    tier priced only after the solve sees it): the ILP alone finds a plan within it, which keeps only the bf16
    copies of the parameters on the device, its memory row `evaluate`'s bytes."""
    traced, prof = bf16_wide
    mesh = make_mesh(1, hardware="l4", precision="bf16")
    forced = offloaded_profile(prof, frozenset(prof.params))
    float32_layout = replace(prof, params={f: replace(p, optimizer_bytes=0, update_launches=0) for f, p in prof.params.items()})
    least = _least_bytes(traced, forced, mesh)
    budget = (least + _least_bytes(traced, float32_layout, mesh)) / 2
    assert least < budget
    problem = build_for(traced, forced.evaluate(), mesh, budget).problem
    ilp = _Model(problem, Restrictions(), "time")
    ilp.add_memory_limit()
    assert run(ilp, "highs", 10.0).found
    memory, _ = evaluate(problem, ilp.assignment())
    assert _affine(ilp.memory_terms).value() / ilp.per_byte == pytest.approx(memory.total_bytes, rel=1e-6)
    assert memory.total_bytes <= budget and memory.optimizer_bytes == 0
    assert memory.params_bytes == sum(p.copy_bytes for p in prof.params.values())  # the bf16 copies alone
    assert memory.host_params_bytes == sum(p.param_bytes - p.copy_bytes for p in prof.params.values())


def test_explain_says_what_the_host_tier_holds_under_bf16_and_its_price(bf16_wide):
    """`autopar explain` on a host-tier parameter under bf16: its float32 master, gradient and AdamW state on the host,
    its bf16 copy alone on the device, and the tier's copies and host step, against a hand count."""
    traced, prof = bf16_wide
    mesh = make_mesh(1, hardware="l4", precision="bf16")
    names = frozenset(prof.params)
    plan = with_offload(solve(traced, offloaded_profile(prof, names), mesh, time_limit_s=5), names)
    result = explain(plan, "fc1.weight", make_context(plan, traced, prof.evaluate()))
    n = 512 * 1024
    held = result["nodes"][0]["host_tier"]
    assert held["lean"] and held["device_bytes"] == 2 * n  # the bf16 copy
    assert (held["host_params_bytes"], held["host_grads_bytes"], held["host_optimizer_bytes"]) == (4 * n, 4 * n, 8 * n + 4)
    assert held["transfer_s"] == pytest.approx(2 * 2 * n / 25e9)  # the copy's bf16 bytes each way over PCIe 4
    assert held["host_step_s"] == pytest.approx(n / HOST_ADAMW_PARAMS_PER_S)
    words = host_tier_words(held)
    assert f"float32 master ({fmt_bytes(4 * n)})" in words and f"optimizer state ({fmt_bytes(8 * n + 4)})" in words
    assert f"only its bf16 copy ({fmt_bytes(2 * n)}) is on the device" in words
    assert f"adds {fmt_seconds(held['step_s'])} to the step" in words and held["step_s"] == pytest.approx(
        4 * n / 25e9 + n / HOST_ADAMW_PARAMS_PER_S)
