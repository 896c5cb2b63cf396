"""Embedding bags of equal length, rewritten as the embedding lookup and reduction they are.

`nn.EmbeddingBag` (recommendation models' sparse features, bag-of-words text
models) fed a 2-D (bags, length) index tensor exports as one fused op,
`_embedding_bag(weight, indices.view(-1), arange(0, numel, length), ...)`. No
sharding rule can split it: its bags are cut by offsets into a flat index
list, so the solver ran it replicated, the whole batch gathered, and warned.
With every bag the same length, it computes exactly

    sum:  embedding(weight, idx).sum(1)         (each entry times its per-sample weight, if given)
    mean: embedding(weight, idx).mean(1)
    max:  embedding(weight, idx).amax(1)

where entries equal to `padding_idx` count as absent (multiplied by 0, left out
of a mean's count; a bag of padding only is zeros, as in eager). Those ops
split like any embedding and reduction: by bags (data parallel) or, for a big
table, by rows (each rank looks up the rows it holds and the bags' sums are
partial sums: torchrec's row-wise sharding, chosen by the ILP). Gradients are
the same: a padded entry's row gets none, and a max's gradient goes to the
entry holding it (ties between entries of one row land on that row either way).

Left as they are: bags cut by explicit offsets (1-D input), `scale_grad_by_freq`,
`include_last_offset`, and `max` with a padding index. (A table asking for sparse
gradients gets dense ones first, `tracer/sparse_grads.py`, and is split as any.)
The cost: the (bags, length, dim) lookup is materialised before its reduction,
which the fused op avoids; the profiler and the ILP see and price it.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from autopar.tracer.nodes import call_like

log = logging.getLogger(__name__)
aten = torch.ops.aten

_SUM, _MEAN, _MAX = 0, 1, 2


def split_equal_bags(gm: fx.GraphModule) -> int:
    """Rewrite every `_embedding_bag` of `gm` over equal-length bags (see the module docstring); returns how many."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten._embedding_bag.default:
            bag = _equal_bags(node)
            if bag is not None:
                _rewrite(gm.graph, node, *bag)
                rewritten += 1
    if rewritten:
        gm.recompile()
        log.info("tracer: %d embedding bags of equal length split into lookup and reduction", rewritten)
    return rewritten


def _equal_bags(node: fx.Node) -> tuple[fx.Node, fx.Node, int, fx.Node | None, int | None] | None:
    """(weight, 2-D indices, mode, 2-D per-sample weights, padding index) when `node` reduces equal-length
    bags of a 2-D index tensor and only its first output is read; None otherwise."""
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    if normalized is None:
        return None
    a = normalized.kwargs  # every argument by name, defaults included
    if a["scale_grad_by_freq"] or a["sparse"] or a["include_last_offset"]:
        return None
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return None  # offset2bag, bag sizes or max indices are read: only the fused op makes them
    indices = _flattened_2d(a["indices"])
    if indices is None:
        return None
    length = indices.meta["val"].shape[1]
    offsets = a["offsets"]
    if not (isinstance(offsets, fx.Node) and offsets.target is aten.arange.start_step
            and offsets.args[0] == 0 and len(offsets.args) > 2 and offsets.args[2] == length):
        return None  # offsets of bags of other lengths
    weights = a["per_sample_weights"]
    if weights is not None:
        weights = _flattened_2d(weights)
        if weights is None or weights.meta["val"].shape[1] != length:
            return None
    padding = a["padding_idx"] if a["padding_idx"] is not None and a["padding_idx"] >= 0 else None
    if a["mode"] not in (_SUM, _MEAN, _MAX) or (a["mode"] == _MAX and padding is not None):
        return None
    return a["weight"], indices, a["mode"], weights, padding


def _flattened_2d(node: Any) -> fx.Node | None:
    """x when `node` is `x.view(-1)` of a 2-D tensor x with a concrete second dimension."""
    if not (isinstance(node, fx.Node) and node.target in (aten.view.default, aten.reshape.default)):
        return None
    source = node.args[0]
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    if list(node.args[1]) != [-1] or not isinstance(val, torch.Tensor) or val.dim() != 2:
        return None
    return source if isinstance(val.shape[1], int) else None


def _rewrite(graph: fx.Graph, node: fx.Node, weight: fx.Node, indices: fx.Node, mode: int,
             weights: fx.Node | None, padding: int | None) -> None:
    def call(target, *args):
        return call_like(graph, node, target, *args)

    with graph.inserting_before(node):
        rows = call(aten.embedding.default, weight, indices)  # (bags, length, dim)
        if weights is not None:
            rows = call(aten.mul.Tensor, rows, call(aten.unsqueeze.default, weights, -1))
        if padding is not None:
            kept = call(aten.ne.Scalar, indices, padding)
            rows = call(aten.mul.Tensor, rows, call(aten.unsqueeze.default, kept, -1))
        if mode == _MAX:
            out = call(aten.amax.default, rows, [1])
        elif mode == _SUM:
            out = call(aten.sum.dim_IntList, rows, [1])
        elif padding is None:
            out = call(aten.mean.dim, rows, [1])
        else:  # a mean over the entries that are not padding; a bag of padding only stays zeros
            count = call(aten.clamp_min.default, call(aten.sum.dim_IntList, kept, [1], True), 1)
            out = call(aten.div.Tensor, call(aten.sum.dim_IntList, rows, [1]), count)
    for user in list(node.users):
        user.replace_all_uses_with(out)
        graph.erase_node(user)
    inputs = [x for x in node.all_input_nodes if x.op == "call_function"]  # the flat views and the offsets
    graph.erase_node(node)
    for x in inputs:
        if not x.users:
            graph.erase_node(x)
