"""Embedding tables declared with sparse gradients train with dense ones.

`nn.Embedding(sparse=True)` and `nn.EmbeddingBag(sparse=True)` make backward
return the table's gradient as a sparse tensor: the rows the batch looked up,
with their indices. Everything after the tracer works on dense tensors: the
profiler's byte counts, the plan's reductions, the gradient sync's flat buckets.
A sparse gradient stopped `parallelize` inside the profiler ("Cannot access
storage of SparseTensorImpl").

The dense gradient holds the same numbers, with zeros in the rows no index
reached, so the tracer clears the op's `sparse` flag (`densify_sparse_gradients`)
and logs it once per table. SGD and Adagrad step the same with either form.
`torch.optim.SparseAdam` takes sparse gradients only; with the dense gradient it
raises at its first step, and `Adam` is the optimizer to use instead (it also
steps the rows no index reached, where SparseAdam skips them). A dense gradient
is the table's size: the memory model counts it, and the solver can split the
table by rows so that each rank holds its part of both.
"""
from __future__ import annotations

import logging

import torch
from torch import fx

from autopar.tracer.source_lines import node_line

log = logging.getLogger(__name__)
aten = torch.ops.aten

_LOOKUPS = (aten.embedding.default, aten._embedding_bag.default, aten._embedding_bag_forward_only.default)


def densify_sparse_gradients(gm: fx.GraphModule) -> int:
    """Clear `sparse` on every embedding lookup of `gm` that sets it; returns how many lookups."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _LOOKUPS:
            continue
        position = [a.name for a in node.target._schema.arguments].index("sparse")
        if len(node.args) > position and node.args[position]:
            node.args = (*node.args[:position], False, *node.args[position + 1:])
        elif node.kwargs.get("sparse"):
            node.kwargs = {**node.kwargs, "sparse": False}
        else:
            continue
        changed += 1
        module = next(reversed(node.meta.get("nn_module_stack", {}).values()), ("", None))[0] or "the model"
        log.warning("tracer: `%s` at %s asks for sparse gradients; the parallel module gives its table a dense "
                    "gradient (the same values, zeros in rows not looked up). SGD and Adagrad step alike; for "
                    "torch.optim.SparseAdam use torch.optim.Adam", module, node_line(node))
    if changed:
        gm.recompile()
    return changed
