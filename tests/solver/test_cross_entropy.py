"""Cross-entropy over a split vocabulary: the strategies exist, compute the right values, and are priced.

The traced `F.cross_entropy` is `_log_softmax` then `gather` of the labels' log-probabilities.
With the class dim split, log-softmax exchanges each row's max and sum of exponentials
(collectives inside the node, simulated for every rank with torch's LocalTensorMode) and the
gather is a masked lookup whose per-rank terms sum to the result (Partial).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.profiler import profile
from autopar.solver.cost import collective_time_s
from autopar.solver.mesh import Mesh, MeshAxis
from autopar.solver.problem import _Pricer, count_hidden_in_forward
from autopar.solver.search import solve
from autopar.solver.spec import Spec, Strategy
from autopar.solver.strategies import enumerate_strategies
from autopar.solver.strategies.localize import in_node_collectives
from autopar.solver.strategies.simulate import run_strategy
from autopar.tracer import trace

ROWS, CLASSES = 8, 12


class Loss(nn.Module):
    def forward(self, logits, labels):
        return nn.functional.cross_entropy(logits, labels)


def _traced():
    return trace(Loss(), (torch.empty(ROWS, CLASSES, device="meta"), torch.empty(ROWS, dtype=torch.long, device="meta")))


def _node(traced, op):
    return next(n for n in traced.graph.nodes if n.target is op)


def _mesh(shape):
    axes = tuple(MeshAxis(f"a{i}", n, 3e-5 * (i + 1), 1e9 / (i + 1)) for i, n in enumerate(shape))
    return Mesh(axes, flops_per_s=1e11, mem_bandwidth_bytes_per_s=1e10, memory_bytes=1e9, hardware="test")


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_split_class_dim_strategies_compute_the_single_device_values(mesh_shape):
    traced = _traced()
    strategies = enumerate_strategies(traced, _mesh(mesh_shape))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, CLASSES, generator=gen, dtype=torch.float64) * 5
    labels = torch.randint(0, CLASSES, (ROWS,), generator=gen)
    logp = torch.log_softmax(logits, 1)
    softmax, gather = _node(traced, torch.ops.aten._log_softmax.default), _node(traced, torch.ops.aten.gather.default)
    split = [s for s in strategies[softmax.name] if any(p == Spec.parse("S(1)").placements[0] for p in s.input_specs[0].placements)]
    assert Strategy((Spec.parse("S(1)" * len(mesh_shape)),), (Spec.parse("S(1)" * len(mesh_shape)),)) in split
    for s in split:
        torch.testing.assert_close(run_strategy(softmax, s, [logits], mesh_shape)[0], logp)
    masked = [s for s in strategies[gather.name] if any(p == Spec.parse("P").placements[0] for p in s.output_specs[0].placements)]
    assert Strategy((Spec.parse("S(1)" * len(mesh_shape)), Spec.replicate(len(mesh_shape))), (Spec.parse("P" * len(mesh_shape)),)) in masked
    index = labels.unsqueeze(1)
    for s in masked:
        torch.testing.assert_close(run_strategy(gather, s, [logp, index], mesh_shape)[0], logp.gather(1, index))


def test_log_softmax_without_its_collectives_is_caught(monkeypatch):
    """The proof is not vacuous: lowered as the plain per-shard op (no exchange), the split strategy fails it."""
    from autopar.solver.strategies import simulate

    traced = _traced()
    softmax = _node(traced, torch.ops.aten._log_softmax.default)
    split = Strategy((Spec.parse("S(1)"),), (Spec.parse("S(1)"),))
    logits = torch.randn(ROWS, CLASSES, dtype=torch.float64)
    monkeypatch.setattr(simulate, "needs_groups", lambda node, strategy: False)
    monkeypatch.setattr(simulate, "local_call", lambda node, *a, **k: (node.target, tuple(node.args), dict(node.kwargs)))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(run_strategy(softmax, split, [logits], (2,))[0], torch.log_softmax(logits, 1))


def test_in_node_collectives_are_counted_and_priced():
    """Per axis splitting the classes: 3 all-reduces (max, sum of exps; grad sum in backward) of one value per local row."""
    traced = _traced()
    softmax = _node(traced, torch.ops.aten._log_softmax.default)
    mesh = _mesh((2, 2))
    rows_split = Strategy((Spec.parse("S(0)S(1)"),), (Spec.parse("S(0)S(1)"),))  # rows on a0, classes on a1
    found = in_node_collectives(softmax, rows_split, mesh.shape)
    assert [(c.kind, c.nbytes, c.mesh_axis, c.forward) for c in found] == [
        ("all_reduce", ROWS // 2 * 4, 1, True), ("all_reduce", ROWS // 2 * 4, 1, True), ("all_reduce", ROWS // 2 * 4, 1, False)]
    assert in_node_collectives(softmax, Strategy((Spec.parse("S(0)R"),), (Spec.parse("S(0)R"),)), mesh.shape) == ()
    strategies = enumerate_strategies(traced, mesh)
    pricer = _Pricer(traced, profile(traced).evaluate(), mesh, strategies)
    options = strategies[softmax.name]
    rows_only = options.index(Strategy((Spec.parse("S(0)S(0)"),), (Spec.parse("S(0)S(0)"),)))
    both = options.index(rows_split)
    one_s = collective_time_s("all_reduce", ROWS // 2 * 4, mesh.axes[1])
    # same local work (the output is split 4 ways either way); only the exchange differs
    assert pricer.option(softmax.name, both).comm_s - pricer.option(softmax.name, rows_only).comm_s == pytest.approx(3 * one_s)
    assert pricer.option(softmax.name, both).recompute_s - pricer.option(softmax.name, rows_only).recompute_s == pytest.approx(2 * one_s)


def test_communication_volume_counts_the_row_exchanges(monkeypatch):
    """The plan's reported all-reduce bytes include the 3 per-row exchanges (one float32 per row each)."""
    from autopar.solver import comm_volume
    from tests.codegen.plans import cpu_mesh, greedy_plan

    traced = _traced()
    logits = next(n.name for n in traced.graph.nodes if n.op == "placeholder")
    plan = greedy_plan(traced, cpu_mesh((2,)), {logits: "S(1)"})
    softmax = _node(traced, torch.ops.aten._log_softmax.default)
    assert next(d.strategy for d in plan.nodes if d.node == softmax.name).input_specs[0] == Spec.parse("S(1)")
    with_exchange = dict(comm_volume.comm_bytes_by_kind(traced, plan))
    monkeypatch.setattr(comm_volume, "in_node_collectives", lambda *a: ())
    without = dict(comm_volume.comm_bytes_by_kind(traced, plan))
    assert with_exchange["all_reduce"] - without.get("all_reduce", 0.0) == 3 * ROWS * 4


def test_the_mean_s_token_count_is_priced_as_hidden_in_the_forward():
    """Codegen starts the global token count's all-reduce at the start of the forward (`start_count`):
    the solver prices the count's reshard as free, and only for a gradient-free divisor of the loss."""
    traced = _traced()
    prof = profile(traced)
    loss = traced.node(traced.output_names[traced.loss_index])
    assert loss.target is torch.ops.aten.div.Tensor
    assert count_hidden_in_forward(traced) == {(loss.name, 1)}

    class Ratio(nn.Module):  # a divisor computed from an input carries a gradient: priced as usual
        def forward(self, x, y):
            return x.sum() / y.sum()

    ratio = trace(Ratio(), (torch.empty(4, device="meta", requires_grad=True), torch.empty(4, device="meta", requires_grad=True)))
    assert count_hidden_in_forward(ratio) == set()
    # with the count's arc free, the solver on two ranks counts local labels (Partial) rather than gathering them
    plan = solve(traced, prof, _mesh((2,)), memory_budget_bytes=1e9)
    labels_spec = next(d.strategy.output_specs[0] for d in plan.nodes if d.node == traced.input_names[1])
    assert str(labels_spec) == "S(0)", plan
