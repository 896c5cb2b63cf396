"""Export's functional `copy(self, src)` rewritten as ops autograd can differentiate.

A slice assignment (`out[..., :d].copy_(x)`, `shifted[:, 1:] = ids[:, :-1]`) exports as
`copy(slice, src)` followed by `slice_scatter`: the functional form of `copy_`. Its value
is `src` cast to `self`'s dtype and broadcast to `self`'s shape; `self` gives only its
shape and dtype. torch has no derivative for it ("derivative for aten::copy is not
implemented"): the graph is run with autograd by the profiler's probes and by the
generated module, and a gradient that flows through a copy (DeepSeek-V3's attention
assembles its keys from two parts this way) stopped both.

This pass writes each copy as the ops it is made of, each with a derivative and with
sharding rules every later stage knows: `_to_copy` to `self`'s dtype where it differs,
`expand` to `self`'s shape where it differs, and `clone` for the fresh tensor the copy
returns (where the cast has not already made one).
"""
from __future__ import annotations

import torch
from torch import fx

from autopar.tracer.nodes import replace_calls

aten = torch.ops.aten


def differentiable_copies(gm: fx.GraphModule) -> int:
    """Rewrite every `aten.copy` of `gm` as `_to_copy`/`expand`/`clone`; returns how many."""
    return replace_calls(gm, aten.copy.default, lambda node: _copy_as_ops(gm.graph, node),
                         "functional copies written as cast/expand/clone")


def _copy_as_ops(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """The nodes computing `copy(self, src)`, inserted before it; the last one is returned."""
    self_arg, src = node.args[0], node.args[1]
    want, have = self_arg.meta["val"], src.meta["val"]
    value, fresh = src, False
    if have.dtype != want.dtype:
        value = _call(graph, node, aten._to_copy.default, (value,), {"dtype": want.dtype}, have.to(want.dtype))
        have, fresh = value.meta["val"], True
    if tuple(have.shape) != tuple(want.shape):
        sizes = [_size(graph, node, self_arg, d, n) for d, n in enumerate(want.shape)]
        value = _call(graph, node, aten.expand.default, (value, sizes), {}, have.expand(want.shape))
        have = value.meta["val"]
    if not fresh:
        value = _call(graph, node, aten.clone.default, (value,), {}, have.clone())
    return value


def _size(graph: fx.Graph, node: fx.Node, of: fx.Node, dim: int, size) -> int | fx.Node:
    """`of`'s size at `dim`: the int, or for a symbolic size a `sym_size` node reading it in the graph."""
    if isinstance(size, int):
        return size
    return _call(graph, node, aten.sym_size.int, (of, dim), {}, size)


def _call(graph: fx.Graph, like: fx.Node, target, args: tuple, kwargs: dict, val) -> fx.Node:
    """A new call node with `like`'s provenance (module stack, source line) and the value `val`."""
    new = graph.call_function(target, args, kwargs)
    new.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    new.meta["val"] = val
    return new
