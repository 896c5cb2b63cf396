"""Cost model against hand counts: ring formulas (one link model and per-kind links), op overhead
launches, elementwise backward bytes, bucketed gradient latency, recompute price."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autopar.profiler.types import NodeCost
from autopar.solver.cost import (GRAD_BUCKET_BYTES, bucket_latency_share, collective_time_s, flat_axis, forward_time_s,
                                 launches, recompute_time_s, strategy_cost, sync_latency_s)
from autopar.solver.mesh import AxisGroup, LinkCost, MeshAxis, make_mesh
from autopar.solver.spec import Spec, Strategy

AX = MeshAxis("tp", 4, alpha_s=1e-5, beta_bytes_per_s=1e9)


def test_ring_formulas_by_hand():
    assert collective_time_s("all_reduce", 4e6, AX) == pytest.approx(2 * 0.75 * 4e6 / 1e9 + 6e-5)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert collective_time_s(kind, 4e6, AX) == pytest.approx(0.75 * 4e6 / 1e9 + 3e-5)
    assert collective_time_s("all_reduce", 4e6, MeshAxis("x", 1, 1e-5, 1e9)) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time_s("broadcast", 1.0, AX)


def test_per_kind_links_override_the_axis_numbers():
    # gloo-like: reduce-scatter slower than half an all-reduce, all-to-all with little latency
    ax = replace(AX, per_kind=(LinkCost("reduce_scatter", 2e-3, 1e8), LinkCost("all_to_all", 2e-4, 2e8)))
    assert collective_time_s("reduce_scatter", 1e6, ax) == pytest.approx(0.75 * 1e6 / 1e8 + 3 * 2e-3)
    assert collective_time_s("all_to_all", 1e6, ax) == pytest.approx(0.75 * 1e6 / 2e8 + 3 * 2e-4)
    # kinds not listed fall back to the axis' own alpha/beta
    assert collective_time_s("all_gather", 1e6, ax) == pytest.approx(0.75 * 1e6 / 1e9 + 3e-5)
    # a bucketed gradient pays its bandwidth in full and a share of the latency
    assert collective_time_s("all_reduce", 1e6, ax, latency_share=0.25) == pytest.approx(1.5 * 1e6 / 1e9 + 0.25 * 6e-5)
    with pytest.raises(ValueError, match="per_kind kinds"):
        MeshAxis("x", 2, 1e-5, 1e9, (LinkCost("broadcast", 1e-5, 1e9),))
    with pytest.raises(ValueError, match="per_kind kinds"):
        MeshAxis("x", 2, 1e-5, 1e9, (LinkCost("all_gather", 1e-5, 1e9),) * 2)


def test_bucket_latency_share_and_group_latency():
    # a 1 MB grad in 25 MB buckets pays 1/25 of a bucket's latency; grads of 10, 20 and 30 MB pay 0.4 + 0.8 + 1
    # (the 30 MB one is sent alone), and their group's last bucket once more (sync_latency_s): 3.2 >= the 3 sent
    assert bucket_latency_share(1e6, 25e6) == pytest.approx(1 / 25)
    assert sum(bucket_latency_share(b, 25e6) for b in (10e6, 20e6, 30e6)) == pytest.approx(2.2)
    assert bucket_latency_share(0.0, 25e6) == 0.0
    # a grad larger than a bucket is sent alone (runtime.grad_sync): one latency, not one per 25 MB
    assert bucket_latency_share(300e6, 25e6) == 1.0
    mesh = make_mesh(8, (2, 4), "cpu")
    assert sync_latency_s(mesh, (1,)) == pytest.approx(2 * 3 * mesh.axes[1].alpha_s)
    assert sync_latency_s(replace(mesh, axes=(replace(mesh.axes[0], size=1), mesh.axes[1])), (0,)) == 0.0


def test_scalar_all_reduce_uses_its_own_latency():
    # a loss or a token count (one element, <= 8 bytes) pays scalar_alpha_s per ring step; anything larger
    # pays the all_reduce alpha, and without a measured scalar latency so does the scalar
    ax = replace(AX, scalar_alpha_s=2e-6)
    assert collective_time_s("all_reduce", 4, ax) == pytest.approx(1.5 * 4 / 1e9 + 6 * 2e-6)
    assert collective_time_s("all_reduce", 16, ax) == pytest.approx(1.5 * 16 / 1e9 + 6 * 1e-5)
    assert collective_time_s("all_gather", 4, ax) == pytest.approx(0.75 * 4 / 1e9 + 3 * 1e-5)
    assert collective_time_s("all_reduce", 4, AX) == pytest.approx(1.5 * 4 / 1e9 + 6 * 1e-5)


def test_measured_groups_replace_the_slowest_link_guess():
    mesh = make_mesh(4, (2, 2), "cpu")
    guess = flat_axis(mesh, (0, 1))
    assert (guess.size, guess.alpha_s) == (4, mesh.axes[0].alpha_s)
    # calibrate() measured the 4-rank group: ~4x the 2-rank per-step latency on an oversubscribed CPU host
    measured = MeshAxis("dp+tp", 4, 4 * mesh.axes[0].alpha_s, 1e9, scalar_alpha_s=1e-4)
    m = replace(mesh, groups=(AxisGroup((0, 1), measured),))
    assert flat_axis(m, (1, 0)) is measured and flat_axis(m, (0,)).size == 2
    assert sync_latency_s(m, (0, 1)) == pytest.approx(6 * 4 * mesh.axes[0].alpha_s)
    with pytest.raises(ValueError, match="has size 2, not the product"):
        replace(mesh, groups=(AxisGroup((0, 1), replace(measured, size=2)),))
    with pytest.raises(ValueError, match="two or more distinct ascending axes"):
        replace(mesh, groups=(AxisGroup((1, 0), measured),))


def _node(fwd: float, bwd: float, out_bytes: float, requires_grad: bool = True, op: str = "aten.mm.default") -> NodeCost:
    return NodeCost("n", op, fwd, bwd, (out_bytes,), (True,), 0.0, 0.0, requires_grad=requires_grad)


def test_strategy_cost_splits_flops_and_charges_replicated_input_grads():
    mesh = make_mesh(4, (2, 2), "h100")
    # mm (64x128) @ (128x256): 2*64*128*256 forward flops, twice that backward
    fwd = 2 * 64 * 128 * 256
    node = _node(fwd, 2 * fwd, 64 * 256 * 4)
    rep = Strategy((Spec.parse("RR"), Spec.parse("RR")), (Spec.parse("RR"),))
    col = Strategy((Spec.parse("S(0)R"), Spec.parse("RS(1)")), (Spec.parse("S(0)S(1)"),))
    c_rep, m_rep = strategy_cost(node, rep, [(64, 256)], mesh, in_bytes=[64 * 128 * 4, 128 * 256 * 4])
    c_col, m_col = strategy_cost(node, col, [(64, 256)], mesh, in_bytes=[64 * 128 * 4, 128 * 256 * 4])
    rate = mesh.flops_per_s
    bw = mesh.mem_bandwidth_bytes_per_s
    assert c_rep == pytest.approx(max(fwd / rate, 65536 / bw) + max(2 * fwd / rate, 2 * 65536 / bw))
    assert c_col == pytest.approx(max(fwd / 4 / rate, 16384 / bw) + max(2 * fwd / 4 / rate, 2 * 16384 / bw))
    assert m_rep == 0.0
    # x is R on axis 1 (tp) where the op is split: its grad is Partial there -> all-reduce of local x (S(0) on dp)
    # w is R on axis 0 (dp): all-reduce of the local w shard (S(1) on tp) over dp
    x_ar = collective_time_s("all_reduce", 64 * 128 * 4 / 2, mesh.axes[1])
    w_ar = collective_time_s("all_reduce", 128 * 256 * 4 / 2, mesh.axes[0])
    assert m_col == pytest.approx(x_ar + w_ar)
    # w a parameter whose grad rides in a bucket: its LOCAL bytes' part of a 25 MiB bucket's latency 2(n-1) alpha
    _, m_bucket = strategy_cost(node, col, [(64, 256)], mesh, in_bytes=[64 * 128 * 4, 128 * 256 * 4],
                                bucketed=[False, True])
    alpha = mesh.axes[0].alpha_s
    share = 128 * 256 * 4 / 2 / GRAD_BUCKET_BYTES
    assert m_bucket == pytest.approx(x_ar + w_ar - (1 - share) * 2 * alpha)
    # a parameter replicated on both split axes: ONE all-reduce over the flat group of 4 ranks (the grad sync's),
    # not one per axis: 2*3/4 * bytes / beta + share * 2*3 alpha, with the slowest link: dp's alpha, tp's beta
    slow = replace(mesh, axes=(replace(mesh.axes[0], alpha_s=3e-5), replace(mesh.axes[1], beta_bytes_per_s=1e8)))
    split = Strategy((Spec.parse("S(0)S(0)"), Spec.parse("RR")), (Spec.parse("S(0)S(0)"),))
    _, m_flat = strategy_cost(node, split, [(64, 256)], slow, in_bytes=[64 * 128 * 4, 128 * 256 * 4],
                              bucketed=[False, True])
    share = 128 * 256 * 4 / GRAD_BUCKET_BYTES
    assert m_flat == pytest.approx(1.5 * 128 * 256 * 4 / 1e8 + share * 6 * 3e-5)


def test_op_overhead_and_elementwise_backward_bytes():
    mesh = replace(make_mesh(2, (2,), "cpu"), op_overhead_s=2e-5)
    bw = mesh.mem_bandwidth_bytes_per_s
    rep = Strategy((Spec.parse("R"),), (Spec.parse("R"),))
    split = Strategy((Spec.parse("S(0)"),), (Spec.parse("S(0)"),))
    # gelu on 1 MB: no flops; forward writes 1 MB, backward reads the grad and writes the input grad (2 MB)
    gelu = _node(0.0, 0.0, 1e6, op="aten.gelu.default")
    assert launches(gelu) == (1, 1)
    c, m = strategy_cost(gelu, rep, [(1000,)], mesh)
    assert (c, m) == (pytest.approx(1e6 / bw + 2e6 / bw + 2 * 2e-5), 0.0)
    # split over 2 ranks: bytes halve, the launches do not (each rank still launches every op)
    c, _ = strategy_cost(gelu, split, [(1000,)], mesh)
    assert c == pytest.approx(0.5e6 / bw + 1e6 / bw + 2 * 2e-5)
    # no gradient (integer ops, masks): forward only
    mask = _node(0.0, 0.0, 1e6, requires_grad=False, op="aten.ne.Scalar")
    assert launches(mask) == (1, 0)
    assert strategy_cost(mask, rep, [(1000,)], mesh)[0] == pytest.approx(1e6 / bw + 2e-5)
    # getitem is Python: nothing launched, nothing moved
    item = _node(0.0, 0.0, 0.0, op="<built-in function getitem>")
    assert launches(item) == (0, 0) and strategy_cost(item, rep, [(1000,)], mesh)[0] == 0.0
    # recompute pays the forward again: roofline + one launch, plus checkpointing's own cost per op
    assert forward_time_s(gelu, split, mesh) == pytest.approx(0.5e6 / bw + 2e-5)
    assert recompute_time_s(gelu, split, replace(mesh, recompute_op_overhead_s=3e-5)) == pytest.approx(0.5e6 / bw + 5e-5)
    assert recompute_time_s(item, rep, replace(mesh, recompute_op_overhead_s=3e-5)) == 0.0


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).square().mean()


def test_problem_prices_fed_inputs_and_bucketed_param_grads_by_hand():
    """build_problem on x @ w: the fed input pays the all-gather to Replicate (forward only), the weight's
    gradient all-reduce under the batch-split mm pays a full bucket's latency (it is all the params)."""
    from autopar.profiler import profile
    from autopar.solver.problem import build_problem
    from autopar.solver.strategies import enumerate_strategies
    from autopar.tracer import trace

    with torch.device("meta"):
        model, x = _Linear(), torch.randn(64, 32)
    traced = trace(model, (x,))
    mesh = replace(make_mesh(4, (4,), "cpu"), op_overhead_s=1e-5)
    strategies = enumerate_strategies(traced, mesh)
    built = build_problem(traced, profile(traced).evaluate(), mesh, strategies, None, grouped=False)
    nodes = {n.name: n for n in built.problem.nodes}
    ax = mesh.axes[0]
    x_name = traced.input_names[0]
    by_spec = {o.label: o for o in nodes[x_name].options}
    assert by_spec["() -> S(0)"].comm_s == 0.0  # fed as is
    assert by_spec["() -> R"].comm_s == pytest.approx(collective_time_s("all_gather", 64 * 32 * 4, ax))
    mm = next(n for n in nodes if n.startswith("mm"))
    opts = {o.label: o for o in nodes[mm].options}
    batch_split = opts["(S(0), R) -> S(0)"]
    # backward: one all-reduce of w's gradient (32 x 16 fp32) paying its part of a 25 MB bucket's latency;
    # the bucket itself (w is every param: one bucket over dp) is charged once per group the plan uses
    share = 32 * 16 * 4 / GRAD_BUCKET_BYTES
    assert batch_split.comm_s == pytest.approx(collective_time_s("all_reduce", 32 * 16 * 4, ax, latency_share=share))
    assert batch_split.sync_groups == {(0,)} and opts["(R, R) -> R"].sync_groups == frozenset()
    assert built.problem.sync_latency_s == (((0,), pytest.approx(2 * 3 * ax.alpha_s)),)
    # compute: mm 2*64*32*16 forward and as much backward (only w needs a gradient: one mm), split 4 ways,
    # plus one forward and one backward launch
    flops = 2 * 64 * 32 * 16 / 4
    out = 64 * 16 * 4 / 4
    expect = max(flops / mesh.flops_per_s, out / mesh.mem_bandwidth_bytes_per_s) \
        + max(flops / mesh.flops_per_s, 2 * out / mesh.mem_bandwidth_bytes_per_s) + 2e-5
    assert batch_split.compute_s == pytest.approx(expect)


class _PositionEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Embedding(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.pos(torch.arange(16, device=x.device))).square().mean()  # (B, 16, 8) + (16, 8)


def test_gradient_through_an_embedding_of_arange_rides_the_bucket():
    """`embedding(weight, arange)` has one gradient-carrying input: codegen lifts the all-reduce of the
    position table's partial gradient under a batch-split add into the bucketed sync, so the add pays
    its bucket share (512 B of 25 MB) and names the dp group, not an in-graph all-reduce of 2(n-1) alphas."""
    from autopar.profiler import profile
    from autopar.solver.problem import build_problem
    from autopar.solver.strategies import enumerate_strategies
    from autopar.tracer import trace

    with torch.device("meta"):
        model, x = _PositionEmbedding(), torch.randn(8, 16, 8)
    traced = trace(model, (x,))
    mesh = make_mesh(4, (4,), "cpu")
    built = build_problem(traced, profile(traced).evaluate(), mesh, enumerate_strategies(traced, mesh), None, grouped=False)
    add = next(n for n in built.problem.nodes if n.name.startswith("add"))
    split = next(o for o in add.options if o.label == "(S(0), R) -> S(0)")
    table = 16 * 8 * 4
    assert split.comm_s == pytest.approx(collective_time_s("all_reduce", table, mesh.axes[0], table / GRAD_BUCKET_BYTES))
    assert split.sync_groups == {(0,)}


class _Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.head(x), y)


def test_a_recomputed_log_softmax_holds_the_logits_it_reads_from_another_layer():
    """The logits come from `head` (one region), log-softmax runs at the top level (another): recomputed, its
    checkpoint region saves the logits (64 x 32 fp32, 8 KB, kept by no backward) as its input, as many bytes
    as its own saved output frees, by hand; the two are never recomputed together (region_inputs)."""
    from autopar.profiler import profile
    from autopar.solver.problem import build_problem
    from autopar.solver.strategies import enumerate_strategies
    from autopar.tracer import trace

    with torch.device("meta"):
        model, x, y = _Classifier(), torch.randn(64, 16), torch.randint(0, 32, (64,))
    traced = trace(model, (x, y))
    mesh = make_mesh(1, (1,), "cpu")
    built = build_problem(traced, profile(traced).evaluate(), mesh, enumerate_strategies(traced, mesh), None, grouped=False)
    names = [n.name for n in built.problem.nodes]
    log_softmax = built.problem.nodes[names.index("_log_softmax")].options[0]
    assert log_softmax.held_input_bytes == 64 * 32 * 4 == log_softmax.saved_bytes
    head = next(n for n in names if n.startswith(("addmm", "linear")))
    assert built.problem.nodes[names.index(head)].options[0].held_input_bytes == 0.0  # reads the user's input
    assert (names.index(head), names.index("_log_softmax")) in built.problem.region_inputs


def test_a_consumer_that_saves_a_gathered_input_keeps_the_gathered_copy():
    """x @ w with x fed Shard(0) on 4 ranks and mm replicated: x is all-gathered for mm, and mm's backward
    saves x (for w's gradient), so the whole x is saved where x's option counted a quarter: 3/4 of 64 x 32
    fp32 more, by hand; nothing more when mm reads x as it comes."""
    from autopar.profiler import profile
    from autopar.solver.problem import build_problem
    from autopar.solver.strategies import enumerate_strategies
    from autopar.tracer import trace

    with torch.device("meta"):
        model, x = _Linear(), torch.randn(64, 32)
    traced = trace(model, (x,))
    mesh = make_mesh(4, (4,), "cpu")
    built = build_problem(traced, profile(traced).evaluate(), mesh, enumerate_strategies(traced, mesh), None, grouped=False)
    names = [n.name for n in built.problem.nodes]
    x_v, mm_v = names.index(traced.input_names[0]), next(i for i, n in enumerate(names) if n.startswith("mm"))
    edge = next(e for e in built.problem.edges if (e.src, e.dst) == (x_v, mm_v))
    x_opt = {o.label: i for i, o in enumerate(built.problem.nodes[x_v].options)}
    mm_opt = {o.label: i for i, o in enumerate(built.problem.nodes[mm_v].options)}
    assert edge.saved(x_opt["() -> S(0)"], mm_opt["(R, R) -> R"]) == pytest.approx(64 * 32 * 4 * 3 / 4)
    assert edge.saved(x_opt["() -> S(0)"], mm_opt["(S(0), R) -> S(0)"]) == 0.0


class _ViewLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.reshape(64, 32) @ self.w).square().mean()


def test_a_view_passes_on_that_its_reader_saves_the_gathered_copy():
    """x (8, 8, 32) fed Shard(0), viewed, then read by a replicated mm that saves it: codegen gathers x
    before the view, so the saved tensor is the gathered x, 3/4 of 64 x 32 fp32 more, by hand."""
    from autopar.profiler import profile
    from autopar.solver.problem import build_problem
    from autopar.solver.strategies import enumerate_strategies
    from autopar.tracer import trace

    with torch.device("meta"):
        model, x = _ViewLinear(), torch.randn(8, 8, 32)
    traced = trace(model, (x,))
    mesh = make_mesh(4, (4,), "cpu")
    built = build_problem(traced, profile(traced).evaluate(), mesh, enumerate_strategies(traced, mesh), None, grouped=False)
    names = [n.name for n in built.problem.nodes]
    x_v = names.index(traced.input_names[0])
    edge = next(e for e in built.problem.edges if e.src == x_v)
    x_opt = {o.label: i for i, o in enumerate(built.problem.nodes[x_v].options)}
    view_opt = {o.label: i for i, o in enumerate(built.problem.nodes[edge.dst].options)}
    assert edge.saved(x_opt["() -> S(0)"], view_opt["(R) -> R"]) == pytest.approx(64 * 32 * 4 * 3 / 4)
