"""Rewrite a node's non-tensor arguments from global to per-rank (local) values.

Codegen and the numeric proof both run the raw ATen op on local shards; ops
whose arguments spell out a shape must then get the local shape:
view/reshape/expand sizes, new_* and factory sizes, and arange bounds (a rank
that holds block k of an arange builds exactly that block).

    target, args, kwargs = local_call(node, strategy, mesh_shape, coordinate)

`target` differs from `node.target` only for
- arange: a sharded block needs `arange.start_step`;
- embedding with its table sharded by rows (vocabulary parallel): `masked_embedding`
  with this rank's row range (a rank-dependent lookup, see `rules_embedding`);
- mean over a dim that the input shards: `mean_of_shards`, the local mean divided by
  the number of shards, i.e. the local sum over the GLOBAL count (exact for even
  shards), so the ranks' terms add up to the global mean (a Partial output).
Tensor arguments are returned unchanged (fx.Nodes); the caller substitutes
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
_MEAN = (aten.mean.default, aten.mean.dim)


def reduced_dims(op: Any, args: Sequence, kwargs: dict, ndim: int) -> frozenset[int]:
    """The dims a mean/sum reduces, normalised (None or [] over a mean.dim/sum.dim_IntList: all dims)."""
    if op in (aten.mean.default, aten.sum.default):
        return frozenset(range(ndim))
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return frozenset(range(ndim))
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return frozenset(int(d) % max(ndim, 1) for d in dims)


def masked_embedding(weight: torch.Tensor, indices: torch.Tensor, lo: int, hi: int, padding_idx: int = -1) -> torch.Tensor:
    """This rank's term of a lookup into rows [lo, hi) of a table: indices outside the range give
    zero rows (and, through masked_fill's backward, no gradient), so the ranks' terms sum to the lookup."""
    outside = aten.logical_or.default(aten.lt.Scalar(indices, lo), aten.ge.Scalar(indices, hi))
    local = aten.masked_fill.Scalar(aten.sub.Scalar(indices, lo), outside, 0)
    local_pad = padding_idx - lo if lo <= padding_idx < hi else -1
    rows = aten.embedding.default(weight, local, local_pad)
    return aten.masked_fill.Scalar(rows, aten.unsqueeze.default(outside, -1), 0.0)


def mean_of_shards(x: torch.Tensor, dims: list[int], keepdim: bool, shards: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One rank's term of a mean whose reduced dims are split into `shards` even blocks:
    local mean / shards = local sum / global count; the terms sum to the global mean."""
    return aten.div.Scalar(aten.mean.dim(x, dims, keepdim, dtype=dtype), shards)


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
    if op in _MEAN:
        return _local_mean(node, strategy, mesh_shape)
    if op is aten.embedding.default and strategy.input_specs and any(
            isinstance(p, Shard) and p.dim == 0 for p in strategy.input_specs[0].placements):
        return _local_embedding(node, strategy, mesh_shape, coordinate)
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


def _local_mean(node: fx.Node, strategy: Strategy, mesh_shape: Sequence[int]) -> tuple[Any, tuple, dict]:
    args, kwargs = tuple(node.args), dict(node.kwargs)
    ndim = node.args[0].meta["val"].dim()
    dims = reduced_dims(node.target, args, kwargs, ndim)
    x_spec = strategy.input_specs[0]
    shards = 1
    for p, n in zip(x_spec.placements, mesh_shape):
        if isinstance(p, Shard) and p.dim in dims:
            shards *= n
    if shards == 1:
        return node.target, args, kwargs
    keepdim = node.target is aten.mean.dim and bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    return mean_of_shards, (args[0], sorted(dims), keepdim, shards), {"dtype": kwargs.get("dtype")}


def _local_embedding(node: fx.Node, strategy: Strategy, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> tuple[Any, tuple, dict]:
    rows = int(node.args[0].meta["val"].shape[0])
    index, count = block_index(strategy.input_specs[0], 0, mesh_shape, coordinate)
    block = rows // count
    padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
    return masked_embedding, (node.args[0], node.args[1], index * block, (index + 1) * block, padding_idx), {}
