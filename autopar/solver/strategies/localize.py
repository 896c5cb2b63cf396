"""Rewrite a node's non-tensor arguments from global to per-rank (local) values.

Codegen and the numeric proof both run the raw ATen op on local shards; ops
whose arguments spell out a shape must then get the local shape:
view/reshape/expand sizes, new_* and factory sizes, and arange bounds (a rank
that holds block k of an arange builds exactly that block).

    target, args, kwargs = local_call(node, strategy, mesh_shape, coordinate)

`target` differs from `node.target` only for arange (a sharded block needs
`arange.start_step`). Tensor arguments are returned unchanged (fx.Nodes); the caller substitutes
each rank's local tensor.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import fx

from autopar.solver.spec import Shard, Spec, Strategy

aten = torch.ops.aten

# op -> index of its size argument (DTensor keeps a similar table for views, `op_to_shape_and_stride_idx`).
_SIZE_ARG = {
    aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
    aten.view_copy.default: 1, aten.expand_copy.default: 1,
    aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_empty.default: 1, aten.new_full.default: 1,
    aten.full.default: 0, aten.zeros.default: 0, aten.ones.default: 0, aten.empty.memory_format: 0,
    aten.rand.default: 0, aten.randn.default: 0,
}
_ARANGE = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def block_index(spec: Spec, dim: int, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> tuple[int, int]:
    """(which block, how many blocks) of tensor dim `dim` a rank at `coordinate` holds.

    Axes sharding the same dim split it outer axis first (DTensor's order)."""
    index, count = 0, 1
    for p, n, c in zip(spec.placements, mesh_shape, coordinate):
        if isinstance(p, Shard) and p.dim == dim:
            index, count = index * n + c, count * n
    return index, count


def local_call(node: fx.Node, strategy: Strategy, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> tuple[Any, tuple, dict]:
    args, kwargs = tuple(node.args), dict(node.kwargs)
    op = node.target
    val = node.meta.get("val")
    if not strategy.output_specs or not isinstance(val, torch.Tensor):
        return op, args, kwargs
    out_spec = strategy.output_specs[0]
    if out_spec.shard_factor(mesh_shape) == 1:
        return op, args, kwargs
    if op in _SIZE_ARG:
        i = _SIZE_ARG[op]
        local = list(out_spec.local_shape(tuple(int(s) for s in val.shape), mesh_shape))
        if i < len(args):
            args = args[:i] + (local,) + args[i + 1:]
        else:
            kwargs["size"] = local
    elif op in _ARANGE:
        return aten.arange.start_step, _local_arange(op, args, out_spec, int(val.shape[0]), mesh_shape, coordinate), kwargs
    return op, args, kwargs


def _local_arange(op: Any, args: tuple, spec: Spec, length: int, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> tuple:
    if op is aten.arange.default:
        start, step = 0, 1
    else:  # start_step's step defaults to 1 and may be omitted
        start, step = args[0], args[2] if len(args) > 2 else 1
    index, count = block_index(spec, 0, mesh_shape, coordinate)
    block = length // count
    lo = start + index * block * step
    return (lo, lo + block * step, step)
