"""Numeric proof: every strategy the solver may choose computes the right values.

For every op node of the tiny zoo models' graphs and every strategy
`enumerate_strategies` emits on meshes (2,) and (2, 2): shard the node's real
inputs (taken from a single-device run of the whole graph) per the strategy's
input specs, run the raw ATen op on every simulated rank with local shapes
(`localize.local_call`), reassemble the outputs per the output specs and
compare with the single-device output. Replicas must agree.

Random ops (native_dropout, bernoulli, rand*) cannot be compared by value:
their outputs are only checked for shape (the zoo is built with dropout=0, so
none appear in these graphs today).

    pytest tests/solver/test_strategies_numeric.py -s   # prints the counts
"""
from __future__ import annotations

import operator
from pathlib import Path

import pytest
import torch
from torch import fx
from torch.utils import _pytree as pytree

from tests.zoo import load_zoo
from autopar.solver.mesh import Mesh, MeshAxis
from autopar.solver.spec import Spec, Strategy
from autopar.solver.strategies import _cache_key, enumerate_strategies, node_strategies
from autopar.solver.strategies.simulate import run_strategy
from autopar.tracer import tensor_args, trace

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RANDOM_OPS = {torch.ops.aten.native_dropout.default, torch.ops.aten.bernoulli.p, torch.ops.aten.rand.default,
              torch.ops.aten.randn.default, torch.ops.aten.randint.low}
MESHES = ((2,), (2, 2))


def load_example(name: str):
    return load_zoo(name)


def mesh_of(shape: tuple[int, ...]) -> Mesh:
    axes = tuple(MeshAxis(f"ax{i}", n, 1e-5, 1e10) for i, n in enumerate(shape))
    return Mesh(axes, flops_per_s=1e12, mem_bandwidth_bytes_per_s=1e11, memory_bytes=1e10)


def graph_values(name: str):
    """Trace the tiny model and run its graph on real tensors: every node's single-device value."""
    torch.manual_seed(0)
    model, sample = load_example(name).build(batch_size=4, seq_len=8, size="tiny", device="cpu", dropout=0.0, seed=0)
    traced = trace(model, sample)
    named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    user = [x for x in pytree.tree_leaves(sample) if isinstance(x, torch.Tensor)]
    feeds = {}
    for n in traced.graph.nodes:
        if n.op != "placeholder":
            continue
        fqn = traced.param_fqns.get(n.name) or traced.buffer_fqns.get(n.name)
        feeds[n.name] = named[fqn].detach() if fqn else user[traced.input_names.index(n.name)]

    values: dict[fx.Node, object] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    with torch.no_grad():
        Recorder(traced.gm).run(*[feeds[n.name] for n in traced.graph.nodes if n.op == "placeholder"])
    return traced, values


def check_node(node: fx.Node, strategy: Strategy, values: dict, mesh_shape: tuple[int, ...]) -> None:
    inputs = [values[a] for a in tensor_args(node)]
    expected = values[node]
    expected = tuple(expected) if isinstance(expected, (tuple, list)) else (expected,)
    got = run_strategy(node, strategy, inputs, mesh_shape)
    for i, (g, e) in enumerate(zip(got, expected)):
        if not isinstance(e, torch.Tensor):
            continue
        if node.target in RANDOM_OPS:
            assert g.shape == e.shape
            continue
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=lambda m: f"{node.format_node()} under {strategy}, output {i}: {m}")


def verify_model(name: str) -> tuple[int, set[str]]:
    traced, values = graph_values(name)
    verified, seen, ops = 0, set(), set()
    for mesh_shape in MESHES:
        strategies = enumerate_strategies(traced, mesh_of(mesh_shape))
        for node in traced.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            key = _cache_key(node, mesh_shape)
            if key in seen:  # repeated layers: same op, shapes and args -> same strategies, already proven
                continue
            seen.add(key)
            for strategy in strategies[node.name]:
                check_node(node, strategy, values, mesh_shape)
                verified += 1
            ops.add(str(node.target))
    return verified, ops


@pytest.mark.parametrize("name", ["gpt2", "llama", "mlp", "bert", "vit", "resnet", "hf_llama"])
def test_every_strategy_of_every_node_is_numerically_right(name):
    if not (EXAMPLES / f"{name}.py").exists():
        pytest.fail(f"examples/{name}.py is missing")
    verified, ops = verify_model(name)
    print(f"\n{name}: verified {verified} (op, strategy) pairs over {len(ops)} ops on meshes {MESHES}")
    assert verified > 100


def _mm_node():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    a.meta["val"], b.meta["val"] = torch.empty(8, 6), torch.empty(6, 4)
    mm = g.call_function(torch.ops.aten.mm.default, (a, b))
    mm.meta["val"] = torch.empty(8, 4)
    return mm, {a: torch.randn(8, 6), b: torch.randn(6, 4), mm: None}


def test_checker_catches_a_wrong_strategy():
    node, values = _mm_node()
    a, b = node.args
    values[node] = values[a] @ values[b]
    right = Strategy((Spec.parse("S(1)"), Spec.parse("S(0)")), (Spec.parse("P"),))
    check_node(node, right, values, (2,))
    wrong = Strategy((Spec.parse("S(1)"), Spec.parse("S(0)")), (Spec.parse("R"),))  # forgets the partial sum
    with pytest.raises(AssertionError):
        check_node(node, wrong, values, (2,))
    wrong_in = Strategy((Spec.parse("P"), Spec.parse("R")), (Spec.parse("S(0)"),))  # Partial input is not a shard
    with pytest.raises((AssertionError, RuntimeError)):
        check_node(node, wrong_in, values, (2,))


@pytest.mark.parametrize("op, extra", [
    (torch.ops.aten.mean.default, ()),                   # MSE loss: mean over every dim
    (torch.ops.aten.mean.dim, ([1], False)),             # a middle dim dropped: dim 2 becomes dim 1
    (torch.ops.aten.mean.dim, ([0, 2], True)),
    (torch.ops.aten.mean.dim, ([-1], True)),             # RMSNorm's mean of squares
])
def test_mean_over_sharded_dims_is_a_partial_sum_of_local_terms(op, extra):
    """mean over a sharded dim -> Partial: each rank's local mean / #shards (= local sum / GLOBAL count)."""
    from autopar.solver.strategies import node_strategies

    g = fx.Graph()
    x = g.placeholder("x")
    full = torch.randn(4, 8, 12, dtype=torch.float64)
    x.meta["val"] = torch.empty(4, 8, 12, dtype=torch.float64, device="meta")
    node = g.call_function(op, (x, *extra))
    expected = op(full, *extra)
    node.meta["val"] = torch.empty(expected.shape, dtype=torch.float64, device="meta")
    values = {x: full, node: expected}
    verified = 0
    for mesh_shape in MESHES:
        strategies = node_strategies(node, mesh_shape)
        for strategy in strategies:
            check_node(node, strategy, values, mesh_shape)
            verified += 1
        reduced = {d % 3 for d in extra[0]} if extra else {0, 1, 2}
        partial_from_shard = [s for s in strategies if any(
            str(p).startswith("S(") and int(str(p)[2]) in reduced and str(q) == "P"
            for p, q in zip(s.input_specs[0].placements, s.output_specs[0].placements))]
        assert partial_from_shard, f"{op} on {mesh_shape}: no Shard(reduced dim) -> Partial strategy"
    # per axis: R, P and one Shard per input dim -> 5 rules on (2,), 25 on (2, 2) (all even here)
    assert verified == 5 + 25


def test_view_keeps_the_candidates_dtensor_does_not_reject():
    """DTensor's view rule raises for an input spec it cannot unflatten evenly (dim 1 = 25 x 2 split over 2
    ranks); only that candidate may drop out, not every strategy of the op (GPT-2-XL's 25 heads on 8 devices)."""
    from autopar.solver.strategies import node_strategies

    g = fx.Graph()
    x = g.placeholder("x")
    full = torch.randn(4, 50)
    x.meta["val"] = torch.empty(4, 50, device="meta")
    node = g.call_function(torch.ops.aten.view.default, (x, [4, 25, 2]))
    node.meta["val"] = torch.empty(4, 25, 2, device="meta")
    values = {x: full, node: full.view(4, 25, 2)}
    strategies = node_strategies(node, (2,))
    assert Strategy((Spec.parse("S(0)"),), (Spec.parse("S(0)"),)) in strategies
    assert not any(s.input_specs[0] == Spec.parse("S(1)") for s in strategies)  # the rejected candidate
    for strategy in strategies:
        check_node(node, strategy, values, (2,))


def test_vocabulary_parallel_embedding_forward_and_weight_gradient():
    """Table S(0) + indices R -> Partial: each rank looks up its rows only (masked, rank-dependent lowering)."""
    from autopar.solver.strategies import node_strategies
    from autopar.solver.strategies.localize import local_call
    from autopar.solver.strategies.simulate import coordinates, shard

    g = fx.Graph()
    w, idx = g.placeholder("w"), g.placeholder("idx")
    weight, indices = torch.randn(16, 6, dtype=torch.float64), torch.randint(0, 16, (4, 5))
    w.meta["val"], idx.meta["val"] = weight.to("meta"), indices.to("meta")
    node = g.call_function(torch.ops.aten.embedding.default, (w, idx))
    node.meta["val"] = torch.empty(4, 5, 6, dtype=torch.float64, device="meta")
    values = {w: weight, idx: indices, node: torch.nn.functional.embedding(indices, weight)}
    for mesh_shape in MESHES:
        strategies = node_strategies(node, mesh_shape)
        vocab = Strategy((Spec.parse("S(0)" + "R" * (len(mesh_shape) - 1)), Spec.replicate(len(mesh_shape))),
                         (Spec.parse("P" + "R" * (len(mesh_shape) - 1)),))
        assert vocab in strategies
        for strategy in strategies:
            check_node(node, strategy, values, mesh_shape)
    # backward: d(sum(out * G))/dW from the per-rank terms, reassembled, equals the single-device gradient
    strategy, mesh_shape = Strategy((Spec.parse("S(0)"), Spec.parse("R")), (Spec.parse("P"),)), (2,)
    grad_out = torch.randn(4, 5, 6, dtype=torch.float64)
    shards = shard(weight, strategy.input_specs[0], mesh_shape)
    grads = []
    for coord in coordinates(mesh_shape):
        local_w = shards[coord].clone().requires_grad_(True)
        target, args, _ = local_call(node, strategy, mesh_shape, coord)
        (target(local_w, indices, *args[2:]) * grad_out).sum().backward()
        grads.append(local_w.grad)
    full_w = weight.clone().requires_grad_(True)
    (torch.nn.functional.embedding(indices, full_w) * grad_out).sum().backward()
    torch.testing.assert_close(torch.cat(grads), full_w.grad)


def _one_op(op, tensors: list[torch.Tensor], *rest) -> tuple[fx.Node, dict]:
    """A graph of the single call `op(*tensors, *rest)` on placeholders, and every node's real value."""
    g = fx.Graph()
    values: dict = {}
    for i, t in enumerate(tensors):
        p = g.placeholder(f"in{i}")
        p.meta["val"] = values[p] = t
    node = g.call_function(op, (*values, *rest))
    node.meta["val"] = values[node] = op(*tensors, *rest)
    return node, values


def _check_every_strategy(node: fx.Node, values: dict, offered: set[str]) -> None:
    """Every strategy of `node` is numerically right, and on every mesh some output spec starts with each of `offered`."""
    for mesh_shape in MESHES:
        strategies = node_strategies(node, mesh_shape)
        for label in offered:
            assert any(str(s.output_specs[0]).startswith(label) for s in strategies), (label, strategies)
        for strategy in strategies:
            check_node(node, strategy, values, mesh_shape)


def test_a_channel_dropout_mask_splits_by_batch_or_channel():
    """`bernoulli(x, p)` (`nn.Dropout2d`'s mask, one per sample and channel) splits as its input: without a rule
    of its own it ran replicated, its input gathered. (Random ops are checked by shape; p=1 draws all ones, so the
    simulated replicas agree.)"""
    node, values = _one_op(torch.ops.aten.bernoulli.p, [torch.empty(4, 8, 1, 1)], 1.0)
    _check_every_strategy(node, values, {"S(0)", "S(1)"})


@pytest.mark.parametrize("op, args", [
    (torch.ops.aten.upsample_nearest2d.vec, (None, [2.0, 2.0])),
    (torch.ops.aten.upsample_bilinear2d.vec, (None, False, [2.0, 3.0])),
    (torch.ops.aten.upsample_nearest2d.default, ([8, 6],)),
])
def test_every_strategy_of_a_resampling_op_is_numerically_right(op, args):
    """F.interpolate's ops (a U-Net's upsampling): split by batch or channels, Partial through."""
    node, values = _one_op(op, [torch.randn(4, 4, 4, 3)], *args)
    _check_every_strategy(node, values, {"S(0)", "S(1)", "P"})


def test_every_strategy_of_group_norm_is_numerically_right():
    """`native_group_norm(x, w, b, N, C, HxW, group, eps)` spells the batch size out: split, it must be local."""
    node, values = _one_op(torch.ops.aten.native_group_norm.default,
                           [torch.randn(4, 8, 5, 5), torch.randn(8), torch.randn(8)], 4, 8, 25, 2, 1e-5)
    _check_every_strategy(node, values, {"S(0)"})


def test_every_strategy_of_transformers_moe_matmul_is_numerically_right():
    """`transformers::grouped_mm_fallback` (Mixtral's experts): split inside each expert's matmul."""
    import transformers.integrations.moe  # noqa: F401  (registers the op)

    node, values = _one_op(torch.ops.transformers.grouped_mm_fallback.default,
                           [torch.randn(10, 8), torch.randn(4, 8, 6), torch.tensor([3, 5, 9, 10])])
    _check_every_strategy(node, values, {"R", "S(1)", "P"})
