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
`masks_as_where` writes it so.

An update through a mask, `x[mask] += 1` or `x[mask] *= scale`, exports as a
gather of the selected elements (`index`, whose size only the data gives: the
trace was refused for it), elementwise ops on them, and the index_put back.
Elementwise ops commute with the gather, so it is `where(mask, f(x), x)`, with
the same gradients: f's where the mask is set, the identity elsewhere, provided
f's derivative is finite on the elements the mask leaves out too (backward
multiplies it by zero there, and zero times an infinite derivative is NaN:
`x[x > 0] = x[x > 0].sqrt()` would make NaN gradients at the negative x). So f
may use `_TOTAL` ops, whose derivatives are finite everywhere, and `_PARTIAL`
ones (and a division by the selected elements), whose input is replaced where
the mask is not set by a point of their domain (`sqrt(where(mask, x, 1))`):
the selected elements see what they saw, and the others a finite derivative,
which backward multiplies by zero. Other
masked writes (values from elsewhere, one per selected element, or other ops)
keep their ops.
"""
from __future__ import annotations

import logging

import torch
from torch import fx

from autopar.tracer.nodes import call_like

log = logging.getLogger(__name__)
aten = torch.ops.aten

# elementwise ops with a finite derivative at every finite input (`+=`, `-=`, `*=`, `/=` by a value, clamps, casts)
_TOTAL = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar,
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.abs.default,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.maximum.default, aten.minimum.default,
    aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten._to_copy.default,
})
# elementwise ops finite only on part of the line, with a point where they and their derivative are finite
_PARTIAL = {
    aten.sqrt.default: 1.0, aten.rsqrt.default: 1.0, aten.reciprocal.default: 1.0, aten.log.default: 1.0,
    aten.log2.default: 1.0, aten.log10.default: 1.0, aten.log1p.default: 0.0, aten.pow.Tensor_Scalar: 1.0,
    aten.exp.default: 0.0, aten.asin.default: 0.0, aten.acos.default: 0.0, aten.atanh.default: 0.0,
}


def masks_as_where(gm: fx.GraphModule) -> int:
    """Rewrite every `index_put(x, [bool mask], value)` of `gm` whose value broadcasts, or is computed elementwise
    from `x[mask]`, as `where`; returns how many."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.index_put.default:
            continue
        if _broadcast_mask(node):
            _rewrite(gm.graph, node)
            rewritten += 1
        elif (chain := _elementwise_update(node)) is not None:
            _rewrite(gm.graph, node, chain)
            rewritten += 1
    if rewritten:
        gm.recompile()
        log.info("tracer: %d writes through a boolean mask written as where", rewritten)
    return rewritten


def _mask_write(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, tuple] | None:
    """(x, mask, value, the dims of x the mask leaves) when `node` is `index_put(x, [mask], value)` with a
    boolean mask over x's leading dims that replaces (accumulate=True adds: kept as written); else None."""
    x, indices, value, *rest = node.args
    if (rest and rest[0]) or node.kwargs.get("accumulate") or len(indices) != 1:
        return None
    mask = indices[0]
    x_val, mask_val, value_val = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x, mask, value))
    if not all(isinstance(v, torch.Tensor) for v in (x_val, mask_val, value_val)) or mask_val.dtype != torch.bool:
        return None
    covered = mask_val.dim()
    if covered > x_val.dim() or tuple(mask_val.shape) != tuple(x_val.shape[:covered]):
        return None
    return x, mask, value, tuple(x_val.shape[covered:])


def _broadcast_mask(node: fx.Node) -> bool:
    """Whether `node` writes one value, broadcast, wherever a boolean mask over x's leading dims is set."""
    write = _mask_write(node)
    if write is None:
        return False
    shape, trailing = tuple(write[2].meta["val"].shape), write[3]
    # index_put broadcasts the value to (selected, *trailing): a leading dim of 1 is the one case without data
    if len(shape) == len(trailing) + 1 and isinstance(shape[0], int) and shape[0] == 1:
        shape = shape[1:]
    return _broadcasts(shape, trailing)  # a data-dependent dim (a value per selected element) does not


def _elementwise_update(node: fx.Node) -> list[fx.Node] | None:
    """The ops from `x[mask]` (an `index` node, first) to index_put's value (last) when `node` writes back into x
    an elementwise function of the elements it gathered with the same boolean mask, each op's other tensors
    broadcasting over the dims the mask leaves; None otherwise."""
    write = _mask_write(node)
    if write is None:
        return None
    x, mask, value, trailing = write
    chain, current = [], value
    while not (current.target is aten.index.Tensor and current.args[0] is x and list(current.args[1]) == [mask]):
        if current.op != "call_function" or (current.target not in _TOTAL and current.target not in _PARTIAL):
            return None
        inputs = [a for a in current.args if isinstance(a, fx.Node)]
        gathered = [a for a in inputs if _selected(a)]
        if len(gathered) != 1 or any(not _broadcasts(_shape(a), trailing) for a in inputs if a is not gathered[0]):
            return None
        chain.append(current)
        current = gathered[0]
    chain.append(current)
    if any(_real_users(n) != ({node} if i == 0 else {chain[i - 1]}) for i, n in enumerate(chain)):
        return None  # a gathered value read elsewhere keeps its data-dependent size
    return chain[::-1]


def _safe_point(op: fx.Node, chain: list[fx.Node]) -> float | None:
    """Where `op` of an update chain is finite only on part of the line: a point of its domain, with a finite
    derivative, that its chain input takes where the mask is not set (a divisor: 1). None for a `_TOTAL` op."""
    if op.target is aten.div.Tensor and op.args[1] in chain:
        return 1.0
    return _PARTIAL.get(op.target)


def _selected(node: fx.Node) -> bool:
    """Whether `node`'s value has a data-dependent leading dim (elements a mask selected)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() > 0 and not isinstance(val.shape[0], int)


def _shape(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()  # a number broadcasts like a 0-d tensor


def _broadcasts(shape: tuple, trailing: tuple) -> bool:
    """Whether a value of `shape` broadcasts to `trailing` without growing it."""
    try:
        return torch.broadcast_shapes(shape, trailing) == trailing
    except RuntimeError:
        return False


def _real_users(node: fx.Node) -> set[fx.Node]:
    """Users of `node` but for the size checks export adds on a gathered value (`sym_size`, comparisons, and
    `_assert_scalar` of the bounds of its data-dependent size), which go with it."""
    return {u for u in node.users if not _size_check(u)}


def _size_check(node: fx.Node) -> bool:
    checks = node.target is aten._assert_scalar.default or not node.is_impure()
    return checks and all(_size_check(u) for u in node.users)


def _rewrite(graph: fx.Graph, node: fx.Node, chain: list[fx.Node] | None = None) -> None:
    x, (mask,), value = node.args[:3]
    x_val = x.meta["val"]

    def call(target, *args, **kwargs):
        return call_like(graph, node, target, *args, **kwargs)

    with graph.inserting_before(node):
        trailing = x_val.dim() - mask.meta["val"].dim()
        if trailing:  # the mask selects whole rows: it broadcasts over the dims it leaves
            mask = call(aten.view.default, mask, [*mask.meta["val"].shape, *([1] * trailing)])
        if chain is not None:  # f(x[mask]) -> f(x): the same ops on every element
            value = x
            for op in chain[1:]:
                safe = _safe_point(op, chain)
                if safe is not None:  # off the mask, a point of its domain (the module docstring says why)
                    value = call(aten.where.self, mask, value, call(aten.full_like.default, value, safe))
                args = [value if isinstance(a, fx.Node) and a in chain else a for a in op.args]
                value = call(op.target, *args, **op.kwargs)
        elif value.meta["val"].dim() == trailing + 1:  # (1, *trailing): the selected positions' dim, of one
            value = call(aten.squeeze.dims, value, [0])
        if value.meta["val"].dtype != x_val.dtype:  # index_put casts the value to x's dtype; where would promote
            value = call(aten._to_copy.default, value, dtype=x_val.dtype)
        out = call(aten.where.self, mask, value, x)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    for gathered in reversed(chain or []):  # the old gather and ops on it, with the size queries on them
        for query in list(gathered.users):
            _erase_with_users(graph, query)
        graph.erase_node(gathered)


def _erase_with_users(graph: fx.Graph, node: fx.Node) -> None:
    for user in list(node.users):
        _erase_with_users(graph, user)
    graph.erase_node(node)
