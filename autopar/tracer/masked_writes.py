"""A write through a boolean mask (`x[mask] = value`) becomes `torch.where(mask, value, x)`.

`labels[labels == pad] = -100` and `scores[~keep] = float("-inf")` export as
`index_put(x, [mask], value)`. With a boolean mask, index_put's indices are a
mask over x's leading dims, not positions along dim 0, and the sharding rules
torch's DTensor gives index_put are written for positions: they split x along a
dim the mask covers while keeping the mask whole, and the step failed with "The
shape of the mask [4, 6] at index 1 does not match the shape of the indexed
tensor [4, 3]". When the value broadcasts over the dims the mask leaves (a
scalar, or one row for every selected position), the write is exactly
`where(mask, value, x)`, whose elementwise rules split mask, value and x alike;
`masks_as_where` writes it so. Other masked writes (a value per selected
element, which only the data sizes) keep index_put.
"""
from __future__ import annotations

import logging

import torch
from torch import fx
from torch._guards import detect_fake_mode

log = logging.getLogger(__name__)
aten = torch.ops.aten


def masks_as_where(gm: fx.GraphModule) -> int:
    """Rewrite every `index_put(x, [bool mask], value)` of `gm` whose value broadcasts as `where`; returns how many."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.index_put.default and _broadcast_mask(node):
            _rewrite(gm.graph, node)
            rewritten += 1
    if rewritten:
        gm.recompile()
        log.info("tracer: %d writes through a boolean mask written as where", rewritten)
    return rewritten


def _broadcast_mask(node: fx.Node) -> bool:
    """Whether `node` writes one value, broadcast, wherever a boolean mask over x's leading dims is set."""
    x, indices, value, *rest = node.args
    if (rest and rest[0]) or node.kwargs.get("accumulate") or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return False  # accumulate=True adds: a mask's duplicates cannot occur, but keep the op as written
    x_val, mask_val, value_val = (a.meta.get("val") for a in (x, indices[0], value))
    if not all(isinstance(v, torch.Tensor) for v in (x_val, mask_val, value_val)) or mask_val.dtype != torch.bool:
        return False
    covered = mask_val.dim()
    if covered > x_val.dim() or tuple(mask_val.shape) != tuple(x_val.shape[:covered]):
        return False
    trailing = tuple(x_val.shape[covered:])
    try:  # index_put broadcasts the value to (selected, *trailing): a leading dim of 1 is the one case without data
        shape = tuple(value_val.shape)
        if len(shape) == len(trailing) + 1 and shape[0] == 1:
            shape = shape[1:]
        return torch.broadcast_shapes(shape, trailing) == trailing
    except RuntimeError:
        return False


def _rewrite(graph: fx.Graph, node: fx.Node) -> None:
    x, (mask,), value = node.args[:3]
    x_val, value_val = x.meta["val"], value.meta["val"]
    fake_mode = detect_fake_mode([x_val])

    def call(target, *args, **kwargs):
        new = graph.call_function(target, args, kwargs)
        new.meta = {k: v for k, v in node.meta.items() if k != "val"}  # the module stack and the user's line
        with fake_mode:
            new.meta["val"] = target(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args), **kwargs)
        return new

    with graph.inserting_before(node):
        trailing = x_val.dim() - mask.meta["val"].dim()
        if trailing:  # the mask selects whole rows: it broadcasts over the dims it leaves
            mask = call(aten.view.default, mask, [*mask.meta["val"].shape, *([1] * trailing)])
        if value_val.dim() == trailing + 1:  # (1, *trailing): the selected positions' dim, of one
            value = call(aten.squeeze.dims, value, [0])
        if value_val.dtype != x_val.dtype:  # index_put casts the value to x's dtype; where would promote
            value = call(aten._to_copy.default, value, dtype=x_val.dtype)
        out = call(aten.where.self, mask, value, x)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
