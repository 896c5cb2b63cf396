"""End-to-end solving on traced zoo models: known answers, edge-case meshes, baselines, infeasibility."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.zoo import load_zoo
from autopar.errors import InfeasibleError
from autopar.profiler import profile
from autopar.solver import baseline_plans, fixed_plan, solve, solve_for_devices, solve_keeping_params
from autopar.solver.needs import budget_that_fits
from autopar.solver.assemble import to_plan
from autopar.solver.robust import ROBUST_MARGIN
from autopar.solver.search import search_mesh
from autopar.solver.mesh import Mesh, MeshAxis, make_mesh
from autopar.solver.spec import Shard, Spec
from autopar.tracer import trace

ROOT = Path(__file__).resolve().parents[2]


def _zoo(name: str):
    return load_zoo(name.split("_")[1])


_CACHE: dict = {}


def mlp(n_layers: int, dim: int, hidden: int, batch: int, optimizer: str = "adamw"):
    key = ("mlp", n_layers, dim, hidden, batch, optimizer)
    if key not in _CACHE:
        m = _zoo("zoo_mlp")
        with torch.device("meta"):
            model = m.MLP(m.MLPConfig(n_layers, dim, hidden)).train()
            x, y = torch.randn(batch, dim), torch.randn(batch, dim)
        traced = trace(model, (x, y))
        _CACHE[key] = (traced, profile(traced, optimizer=optimizer))
    return _CACHE[key]


def slow_mesh(n: int, beta: float):
    mesh = make_mesh(n, (n,), "h100")
    return dataclasses.replace(mesh, axes=(MeshAxis("dp", n, 1e-5, beta),))


def test_ample_memory_and_slow_links_give_pure_data_parallel():
    # activation-heavy: DP's grad all-reduce << TP's activation traffic. SGD: AdamW's step is worth sharding
    # here (`test_adamw_step_is_worth_sharding_where_weights_dominate`)
    traced, prof = mlp(2, 1024, 4096, 32768, "sgd")
    plan = solve(traced, prof, slow_mesh(4, 50e9))
    assert all(p.use.is_replicate() and not p.zero for p in plan.params)
    assert plan.recomputed() == ()
    # No cheaper plan in the data-parallel family exists (same model, restricted ILP). Known gap: `mean`
    # (the MSE loss) has only a replicate strategy today, so the batch split is priced with a gather at the end.
    dp = {b.name: b for b in baseline_plans(traced, prof, plan.mesh)}["data_parallel"]
    assert dp.time.total_s == pytest.approx(plan.time.total_s)


def test_tighter_budgets_trade_time_for_memory_then_fail_with_the_minimum():
    traced, prof = mlp(2, 1024, 4096, 32768)
    mesh = slow_mesh(4, 50e9)
    dp = solve(traced, prof, mesh)
    tight = solve(traced, prof, mesh, memory_budget_bytes=0.7 * dp.memory.total_bytes)
    assert tight.memory.total_bytes <= 0.7 * dp.memory.total_bytes
    assert tight.time.total_s >= dp.time.total_s
    assert [d.strategy for d in tight.nodes] != [d.strategy for d in dp.nodes] or tight.recomputed() or any(p.zero for p in tight.params)
    with pytest.raises(InfeasibleError) as info:
        solve(traced, prof, mesh, memory_budget_bytes=1e6)
    minimum = info.value.min_memory_bytes
    assert minimum > 1e6 and "per device" in str(info.value) and "budget" in str(info.value)
    # the reported minimum is achievable: a budget 1% above it plans
    assert solve(traced, prof, mesh, memory_budget_bytes=minimum * 1.01).memory.total_bytes <= minimum * 1.01


def test_a_baseline_over_the_budget_is_priced_as_its_leanest_form():
    """Data parallel at a budget below its least need: reported as not fitting, with the least memory any data
    parallel plan needs (recompute allowed), which fits at that budget."""
    traced, prof = mlp(2, 1024, 4096, 32768)
    mesh = slow_mesh(4, 50e9)
    ample = {b.name: b for b in baseline_plans(traced, prof, mesh)}
    budget = 0.5 * ample["data_parallel"].memory.total_bytes
    tight = {b.name: b for b in baseline_plans(traced, prof, mesh, memory_budget_bytes=budget)}
    dp = tight["data_parallel"]
    assert not dp.fits and budget < dp.memory.total_bytes < ample["data_parallel"].memory.total_bytes
    again = {b.name: b for b in baseline_plans(traced, prof, mesh, memory_budget_bytes=budget_that_fits(dp.memory.total_bytes))}
    assert again["data_parallel"].fits
    assert again["data_parallel"].memory.total_bytes == pytest.approx(dp.memory.total_bytes, rel=1e-6)


def test_baselines_priced_with_the_plan_are_those_priced_alone():
    """`solve(..., baselines=True)` and `solve_for_devices(..., baselines=True)` (the CLI) price the textbook plans
    on the problem the plan was solved on, not on a second one built alike: the same numbers as `baseline_plans`."""
    traced, prof = mlp(2, 1024, 4096, 32768)
    mesh = slow_mesh(4, 50e9)
    budget = 0.75 * {b.name: b for b in baseline_plans(traced, prof, mesh)}["data_parallel"].memory.total_bytes
    alone = baseline_plans(traced, prof, mesh, memory_budget_bytes=budget)
    assert not all(b.fits for b in alone)  # a baseline priced as its leanest form, over the budget
    with_plan = solve(traced, prof, mesh, memory_budget_bytes=budget, baselines=True).baselines
    assert [(b.name, b.fits) for b in with_plan] == [(b.name, b.fits) for b in alone]
    for a, b in zip(with_plan, alone):
        assert a.time.total_s == pytest.approx(b.time.total_s, rel=1e-6)
        assert a.memory.total_bytes == pytest.approx(b.memory.total_bytes, rel=1e-6)
    assert not solve(traced, prof, mesh, memory_budget_bytes=budget).baselines
    best, _ = solve_for_devices(traced, prof, 4, hardware="h100", baselines=True)
    assert [b.time.total_s for b in best.baselines] == pytest.approx(
        [b.time.total_s for b in baseline_plans(traced, prof, best.mesh)], rel=1e-6)


def two_level_mesh() -> Mesh:
    """4 H100s as 2 nodes of 2: axis 0 InfiniBand, axis 1 NVLink; one matmul rate, bf16's, for every dtype (as a
    calibrated mesh has): at float32's rate the matmuls outweigh any link, and splitting weights over both axes pays."""
    return dataclasses.replace(make_mesh(4, (2, 2), "h100-ib"), rates=None)


def test_two_level_mesh_puts_tensor_parallelism_on_the_fast_axis():
    traced, prof = mlp(2, 4096, 16384, 256, "sgd")  # weight-heavy (AdamW's step: the next test)
    mesh = two_level_mesh()
    assert mesh.axes[1].beta_bytes_per_s > mesh.axes[0].beta_bytes_per_s
    plan = solve(traced, prof, mesh)
    sharded = [p for p in plan.params if not p.use.is_replicate()]
    assert sharded, "weight-heavy model on a fast axis should go tensor parallel"
    assert all(not isinstance(p.use.placements[0], Shard) for p in plan.params)
    assert any(isinstance(p.use.placements[1], Shard) for p in sharded)


def test_adamw_step_is_worth_sharding_where_weights_dominate():
    """AdamW's step writes 8 times a parameter's bytes (`OptimizerCost`): on 1 GiB of weights and 256 tokens
    it costs more than the matmuls, and each rank updating only its block of every weight pays for a
    gather over the slow axis too. SGD's step (one write) does not; priced under AdamW, that plan is slower."""
    from autopar.solver.cost import optimizer_step_s

    traced, prof = mlp(2, 4096, 16384, 256)
    _, sgd = mlp(2, 4096, 16384, 256, "sgd")
    mesh = two_level_mesh()
    plan = solve(traced, prof, mesh)
    megatron = solve(traced, sgd, mesh)
    assert any(isinstance(p.use.placements[0], Shard) for p in plan.params)  # blocks over the slow axis too
    assert all(not isinstance(p.use.placements[0], Shard) for p in megatron.params)
    repriced = fixed_plan(traced, prof, mesh, {d.node: d.strategy for d in megatron.nodes if d.op != "output"})
    assert plan.time.total_s < repriced.time.total_s
    # the step's price is the parameters' part of compute: for one weight, 10 launches and 8 writes of its block
    w = prof.evaluate().params["layers.0.fc1.weight"]
    block = next(p.use for p in plan.params if p.fqn == w.fqn).shard_factor(mesh.shape)
    assert optimizer_step_s(w, block, mesh) == pytest.approx(10 * mesh.op_overhead_s + 8 * w.param_bytes / block / mesh.mem_bandwidth_bytes_per_s)
    # and the plan says how much of its compute is the step: each parameter's, on the block it stores
    costs = prof.evaluate().params
    stored = {p.fqn: p.storage.shard_factor(mesh.shape) for p in plan.params}
    assert plan.time.update_s == pytest.approx(sum(optimizer_step_s(costs[f], stored[f], mesh) for f in stored), rel=1e-9)
    assert 0 < plan.time.update_s < plan.time.compute_s


@pytest.mark.parametrize("shape", [(1,), (6,), (3, 2)])
def test_edge_case_meshes_plan(shape):
    traced, prof = mlp(1, 32, 64, 4)  # batch 4 < 6 devices: dims smaller than the mesh axis
    n = 1
    for s in shape:
        n *= s
    plan = solve(traced, prof, make_mesh(n, shape))
    assert plan.mesh.shape == shape and len(plan.params) == 4
    if n == 1:
        assert plan.time.comm_s < 1e-9 and not any(p.zero for p in plan.params)  # one device: nothing to send


def test_solve_for_devices_tries_every_shape_and_keeps_the_fastest():
    traced, prof = mlp(2, 256, 1024, 512)
    plan, results = solve_for_devices(traced, prof, 12, margin=0.0)
    assert [r.shape for r in results] == [(12,), (2, 6), (3, 4), (4, 3), (6, 2)]
    fastest_s = min(r.step_s for r in results if r.step_s is not None)
    assert plan.time.total_s == pytest.approx(fastest_s)
    # by default, the simplest plan within the cost model's measured error (`solver.robust`): one as fast or
    # within the margin, on a mesh of as many axes or fewer
    robust, _ = solve_for_devices(traced, prof, 12)
    assert fastest_s <= robust.time.total_s <= fastest_s * (1 + ROBUST_MARGIN)
    assert sum(n > 1 for n in robust.mesh.shape) <= sum(n > 1 for n in plan.mesh.shape)


def test_fixed_plan_reprices_the_solver_plan_identically_and_baselines_are_not_faster():
    traced, prof = mlp(2, 1024, 4096, 2048)
    mesh = make_mesh(4, (2, 2))
    plan = solve(traced, prof, mesh)
    again = fixed_plan(traced, prof, mesh, {d.node: d.strategy for d in plan.nodes if d.op != "output"},
                       recompute=frozenset(plan.recomputed()), zero_params=frozenset(p.fqn for p in plan.params if p.zero))
    # merging followers and tying layers must not change the price of a plan
    assert again.time.total_s == pytest.approx(plan.time.total_s, rel=1e-9)
    assert again.memory.total_bytes == pytest.approx(plan.memory.total_bytes, rel=1e-9)
    results = {b.name: b for b in baseline_plans(traced, prof, mesh)}
    assert set(results) == {"data_parallel", "zero3", "megatron"}
    for b in results.values():
        assert b.time.total_s >= plan.time.total_s * (1 - 1e-6)


def test_zero_saves_the_gradient_all_reduce_only_where_a_consumer_pays_it():
    """ZeRO storage replaces a parameter's bucketed gradient all-reduce by a reduce-scatter, plus a gather in
    forward and again in backward. The all-reduce is saved only where a consumer pays it: one split over the
    ZeRO axes (data parallel). A consumer computing replicated pays none, and ZeRO there only costs: it once
    came out as a saving (negative step times on a weight-heavy MLP with replicated compute)."""
    from autopar.solver.cost import bucketed_all_reduce_s, collective_time_s, optimizer_step_s
    from autopar.solver.anytime import solve_problem
    from autopar.solver.ilp import Restrictions
    from autopar.solver.problem import build_problem
    from autopar.solver.strategies import enumerate_strategies

    traced, prof = mlp(1, 256, 1024, 64)
    mesh = make_mesh(4, (4,), "h100")
    strategies = enumerate_strategies(traced, mesh)
    built = build_problem(traced, prof.evaluate(), mesh, strategies, None)
    axis = mesh.axes[0]
    params = [p.param_bytes for p in prof.evaluate().params.values()]
    gathers = sum(2 * collective_time_s("all_gather", b, axis) + collective_time_s("reduce_scatter", b, axis) for b in params)
    # ... and what each rank's optimizer step saves updating a quarter of each parameter
    updates = sum(optimizer_step_s(p, 1, mesh) - optimizer_step_s(p, 4, mesh) for p in prof.evaluate().params.values())
    assert 0 < updates < gathers
    all_reduces = sum(bucketed_all_reduce_s(b, mesh, (0,)) for b in params)

    def leader(v: int) -> str:
        return built.grouping.clusters[built.grouping.classes[v][0]].leader

    def step(allowed: dict, zero: str) -> float:
        return solve_problem(built.problem, restrictions=Restrictions(allowed, zero=zero)).time.total_s

    # every op on the whole batch, every rank alike: nothing to all-reduce, so nothing for ZeRO to save
    replicated = {v: frozenset(i for i in range(len(n.options))
                               if all(s.is_replicate() for s in strategies[leader(v)][built.member_strategy(leader(v), i)].input_specs
                                      + strategies[leader(v)][built.member_strategy(leader(v), i)].output_specs))
                  for v, n in enumerate(built.problem.nodes)}
    assert step(replicated, "always") - step(replicated, "never") == pytest.approx(gathers - updates, rel=1e-6)
    # data parallel: the consumers pay each gradient's bucketed all-reduce; ZeRO's reduce-scatter takes it over (FSDP)
    plan = baseline_plans(traced, prof, mesh)
    dp, z3 = (next(b for b in plan if b.name == name) for name in ("data_parallel", "zero3"))
    assert z3.time.comm_s - dp.time.comm_s == pytest.approx(gathers - all_reduces, rel=1e-6)


def test_a_gradient_is_priced_bucketed_only_on_axes_codegen_can_lift_it_to_the_parameter():
    """GPT-2's position embedding `embedding(wpe, arange)` added to the batch-split hidden state: its gradient
    is partial on every axis the add splits the batch over. Where the embedding is not split, codegen lifts that
    all-reduce above it into the parameter's bucketed sync; where the embedding splits the table (vocabulary-
    parallel over positions on tp), it cannot, and emits an all-reduce in backward (`grad_all_reduce`), besides
    the forward one of the partial output. The edge pays for it."""
    from autopar.solver.cost import bucketed_all_reduce_s, collective_time_s
    from autopar.solver.problem import build_problem
    from autopar.solver.reshard import reshard_cost
    from autopar.solver.strategies import enumerate_strategies

    model, sample = load_zoo("gpt2").build(batch_size=8, seq_len=32, size="tiny", device="meta")
    traced = trace(model, sample)
    mesh = make_mesh(4, (2, 2), "h100")
    strategies = enumerate_strategies(traced, mesh)
    built = build_problem(traced, profile(traced).evaluate(), mesh, strategies, None, grouped=False)
    g = built.grouping
    pos, add = (g.class_of[g.cluster_of[n]] for n in ("embedding_1", "add"))
    edge = next(e for e in built.problem.edges if (e.src, e.dst) == (pos, add))

    def option(node: str, label: str) -> int:
        return next(i for i, s in enumerate(strategies[node]) if str(s) == label)

    batch_split = option("add", "(S(0)S(0), RR) -> S(0)S(0)")
    grad_bytes = 32 * 64 * 4  # the (seq, hidden) gradient of the position embedding's output, whole on each rank
    # replicated embedding: the gradient goes to wpe's bucketed sync over both axes, priced by the add itself
    assert edge.cost(option("embedding_1", "(RR, RR) -> RR"), batch_split) == 0.0
    # table split on tp: forward all-reduce of the partial output, backward all-reduce on tp in the graph; the
    # bucketed sync keeps the dp axis only
    split = option("embedding_1", "(RS(0), RR) -> RP")
    rp, rr = strategies["embedding_1"][split].output_specs[0], strategies["add"][batch_split].input_specs[1]
    expected = (reshard_cost(rp, rr, (32, 64), 4, mesh) + collective_time_s("all_reduce", grad_bytes, mesh.axes[1])
                + bucketed_all_reduce_s(grad_bytes, mesh, (0,)) - bucketed_all_reduce_s(grad_bytes, mesh, (0, 1)))
    assert edge.cost(split, batch_split) == pytest.approx(expected, rel=1e-9)
    assert expected > reshard_cost(rp, rr, (32, 64), 4, mesh) + 0.5 * collective_time_s("all_reduce", grad_bytes, mesh.axes[1])


def test_frozen_parameters_cost_no_gradient_memory_or_sync():
    """A data-parallel plan of an MLP whose first layer is frozen: no gradient or optimizer bytes for it (AdamW:
    2 fp32 states, a 4-byte step), and one gradient all-reduce fewer to price than with every layer training."""
    m = _zoo("zoo_mlp")
    with torch.device("meta"):
        model = m.MLP(m.MLPConfig(2, 256, 1024)).train()
        x, y = torch.randn(64, 256), torch.randn(64, 256)
    mesh = slow_mesh(4, 50e9)
    plans = {}
    for frozen in (False, True):
        model.requires_grad_(True)
        if frozen:
            model.get_submodule("layers.0").requires_grad_(False)
        traced = trace(model, (x, y))
        prof = profile(traced)
        plans[frozen] = {b.name: b for b in baseline_plans(traced, prof, mesh)}["data_parallel"]
    frozen_bytes = sum(p.numel() * 4 for p in model.get_submodule("layers.0").parameters())
    n_frozen = len(list(model.get_submodule("layers.0").parameters()))
    full, part = plans[False].memory, plans[True].memory
    assert full.params_bytes == part.params_bytes
    assert full.grads_bytes - part.grads_bytes == frozen_bytes
    assert full.optimizer_bytes - part.optimizer_bytes == 2 * frozen_bytes + 4 * n_frozen
    assert plans[True].time.comm_s < plans[False].time.comm_s


def test_solve_keeping_params_holds_every_parameter_where_it_is_stored():
    """Another graph of a model whose parameters a plan already stores: the plan kept for it stores each one
    the same way, as that plan uses it (ZeRO included) or, where its storage is no option's ZeRO storage
    (sharded on another dim), used as stored."""
    traced, prof = mlp(2, 1024, 4096, 32768)
    mesh = slow_mesh(4, 50e9)
    dp = solve(traced, prof, mesh)
    # a plan that stores parameters ZeRO-sharded: the ZeRO-3 textbook plan at a budget it fits
    found = search_mesh(traced, prof, mesh, 0.7 * dp.memory.total_bytes)
    tight = to_plan(traced, mesh, found.tied, found.textbooks["zero3"])
    assert any(p.zero for p in tight.params)
    first = tight.params[0]
    odd = dataclasses.replace(first, storage=Spec.parse("S(1)" if first.storage != Spec.parse("S(1)") else "S(0)"))
    for pins in (tight.params, (odd, *tight.params[1:])):
        kept = solve_keeping_params(traced, prof, mesh, pins)
        assert {p.fqn: p.storage for p in kept.params} == {p.fqn: p.storage for p in pins}
        assert kept.recomputed() == ()
    assert {p.fqn: p.use for p in kept.params}[odd.fqn] == odd.storage  # used as stored


def test_a_spent_time_limit_searches_no_further_shape_and_answers_with_the_first_shapes_plan():
    traced, prof = mlp(2, 256, 1024, 512)
    plan, results = solve_for_devices(traced, prof, 4, time_limit_s=0.0, margin=0.0)
    assert [r.shape for r in results] == [(4,), (2, 2)]
    first, second = results
    assert first.searched and first.step_s is not None
    # no time left after (4,): (2, 2) would only build its problem and price its textbook plans past the limit
    assert not second.searched and second.step_s is None and "not searched" in second.error
    assert plan.mesh.shape == (4,) and plan.time.total_s == pytest.approx(first.step_s, rel=1e-9)
