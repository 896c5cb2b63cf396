"""Recompute regions: which lowered nodes one checkpoint region takes (no ranks needed)."""
from __future__ import annotations

import torch
from torch import fx, nn

from autopar.codegen.recompute import _runs, checkpointed, outline

aten = torch.ops.aten


def _graph() -> fx.Graph:
    """x -> mm -> permute -> gelu -> sdpa-like mul -> view -> add -> clone (graph order)."""
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    mm = g.call_function(aten.mm.default, (x, w))
    mm.name = "mm"
    perm = g.call_function(aten.permute.default, (mm, [1, 0]))
    perm.name = "permute"
    gelu = g.call_function(aten.gelu.default, (perm,))
    gelu.name = "gelu"
    mul = g.call_function(aten.mul.Tensor, (gelu, gelu))
    mul.name = "mul"
    view = g.call_function(aten.view.default, (mul, [-1]))
    view.name = "view"
    add = g.call_function(aten.add.Tensor, (view, view))
    add.name = "add"
    clone = g.call_function(aten.clone.default, (add,))
    clone.name = "clone"
    g.output(clone)
    return g


def test_runs_bridge_views_between_recomputed_nodes_of_a_layer():
    g = _graph()
    origin = {n.name: n.name for n in g.nodes}
    layer = {name: "h.0" for name in origin}
    runs = _runs(g, {"mm", "gelu", "add"}, origin, layer)
    # permute (a view the plan keeps) joins mm's region: else its output, mm's, would be gelu's region
    # input and checkpoint would save it. mul is real work the plan keeps: it ends the run. The trailing
    # clone follows no recomputed node of the run: left out.
    assert [[n.name for n in run] for run in runs] == [["mm", "permute", "gelu"], ["add"]]
    # a view belonging to another layer is not bridged: regions stay per layer
    runs = _runs(g, {"mm", "gelu"}, origin, {**layer, "permute": "h.1"})
    assert [[n.name for n in run] for run in runs] == [["mm"], ["gelu"]]


def test_runs_step_over_kept_work_that_does_not_read_them():
    """LLaMA's MLP: silu(gate) is recomputed, the up projection is kept, their product recomputed. The up
    projection reads nothing of the run: it stays outside, and silu and the product share one region
    (else silu's output would be the second region's input, saved by checkpoint)."""
    g = fx.Graph()
    x, wg, wu = g.placeholder("x"), g.placeholder("wg"), g.placeholder("wu")
    nodes = {}
    for name, target, args in (("gate", aten.mm.default, (x, wg)), ("silu", aten.silu.default, ("gate",)),
                               ("up", aten.mm.default, (x, wu)), ("prod", aten.mul.Tensor, ("silu", "up")),
                               ("down", aten.mm.default, ("prod", wu))):
        nodes[name] = g.call_function(target, tuple(nodes.get(a, a) for a in args))
        nodes[name].name = name
    g.output(nodes["down"])
    origin = {n.name: n.name for n in g.nodes}
    runs = _runs(g, {"silu", "prod"}, origin, {name: "layers.0" for name in origin})
    assert [[n.name for n in run] for run in runs] == [["silu", "prod"]]
    # outlined, the region is called where its last node was: after the kept up projection it reads
    outline(g, nn.Module(), runs[0], "recompute_0", checkpointed)
    g.lint()
    assert [n.name for n in g.nodes if n.op == "call_function"] == ["gate", "up", "checkpointed", "getitem", "down"]
