"""Local sizes: shape arguments of view/factory ops rewritten for one rank's shard.

The traced graph carries global sizes (`view(x, [32, 64])`); on a rank that
holds `S(0)` over 2 devices the same op must read `view(x, [16, 64])`. The
output's meta shape and its spec give the local shape exactly, so we never
guess from the argument (a `-1` in the argument is resolved the same way).
"""
from __future__ import annotations

import operator
from typing import Sequence

import torch
from torch import fx

from autopar.errors import AutoparError
from autopar.solver.spec import Shard, Spec

aten = torch.ops.aten


class LoweringError(AutoparError):
    """A node cannot run on local shards under the planned strategy; names the node and the strategy."""


# op -> index of the argument that is the output's size
_SIZE_ARG = {
    aten.view.default: 1,
    aten._unsafe_view.default: 1,
    aten.reshape.default: 1,
    aten.expand.default: 1,
    aten.view_copy.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_empty.default: 1,
    aten.new_full.default: 1,
    aten.full.default: 0,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.empty.memory_format: 0,
    aten.rand.default: 0,
    aten.randn.default: 0,
}
_ARANGE = (aten.arange.default, aten.arange.start, aten.arange.start_step)
# ops that cut along a dim given as an argument: (index of dim arg, default dim)
_SPLITS = {aten.split_with_sizes.default: (2, 0), aten.split.Tensor: (2, 0)}
_DIM_SLICING = {aten.slice.Tensor: (1, 0), aten.narrow.default: (1, None), aten.select.int: (1, None)}


def shard_factor_of_dim(spec: Spec, dim: int, mesh_shape: Sequence[int]) -> int:
    n = 1
    for p, size in zip(spec.placements, mesh_shape):
        if isinstance(p, Shard) and p.dim == dim:
            n *= size
    return n


def shard_offset(spec: Spec, dim: int, global_size: int, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> int:
    """Index along `dim` where this rank's block starts (mesh axes in order, axis 0 outermost)."""
    start, size = 0, global_size
    for p, n, c in zip(spec.placements, mesh_shape, coordinate):
        if isinstance(p, Shard) and p.dim == dim:
            size //= n
            start += c * size
    return start


def local_block(t: torch.Tensor, spec: Spec, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> torch.Tensor:
    """This rank's block of a full tensor (Partial placements keep the whole value: callers decide)."""
    for p, n, c in zip(spec.placements, mesh_shape, coordinate):
        if isinstance(p, Shard):
            if t.shape[p.dim] % n:
                raise LoweringError(f"dim {p.dim} of size {t.shape[p.dim]} does not divide over a mesh axis of {n} (spec {spec})")
            t = t.chunk(n, p.dim)[c]
    return t


def localize_call(
    node: fx.Node,
    args: list,
    in_specs: Sequence[Spec | None],
    out_specs: Sequence[Spec],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[object, list]:
    """(target, args) for this rank: `args` (already mapped to the new graph) with global sizes made local."""
    op = node.target
    if op is operator.getitem or not out_specs:
        return op, args
    out_val = node.meta.get("val")
    if op in _SIZE_ARG and isinstance(out_val, torch.Tensor):
        i = _SIZE_ARG[op]
        args = list(args)
        args[i] = list(out_specs[0].local_shape(tuple(out_val.shape), mesh_shape))
        return op, args
    if op in _ARANGE and out_specs[0].shard_factor(mesh_shape) > 1:
        # a sharded arange becomes this rank's sub-range, always in the (start, end, step) overload
        return aten.arange.start_step, _local_arange(node, list(args), out_specs[0], mesh_shape, coordinate)
    return op, _localize_dims(node, op, args, in_specs, mesh_shape)


def _localize_dims(node: fx.Node, op, args: list, in_specs: Sequence[Spec | None], mesh_shape: Sequence[int]) -> list:
    first_in = in_specs[0] if in_specs else None
    if op in _SPLITS and first_in is not None:
        dim_i, default = _SPLITS[op]
        dim = args[dim_i] if len(args) > dim_i else default
        x_dim = node.args[0].meta["val"].dim()
        n = shard_factor_of_dim(first_in, dim % x_dim, mesh_shape)
        if n > 1:
            args = list(args)
            sizes = args[1]
            args[1] = [s // n for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // n
        return args
    if op in _DIM_SLICING and first_in is not None:
        dim_i, default = _DIM_SLICING[op]
        dim = args[dim_i] if len(args) > dim_i else default
        x_dim = node.args[0].meta["val"].dim()
        if dim is not None and shard_factor_of_dim(first_in, dim % x_dim, mesh_shape) > 1:
            raise LoweringError(
                f"{node.format_node()}: strategy {first_in} shards dim {dim}, which {op} indexes into; "
                "the strategy rule for this op must not allow sharding the indexed dim"
            )
    return args


def _local_arange(node: fx.Node, args: list, spec: Spec, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> list:
    """arange(start, end, step) on a Shard(0) output: this rank's sub-range."""
    start, end, step = 0, None, 1
    if node.target is aten.arange.default:
        end = args[0]
    elif node.target is aten.arange.start:
        start, end = args[0], args[1]
    else:
        start, end, step = args[0], args[1], args[2]
    global_len = node.meta["val"].shape[0]
    local_len = global_len // shard_factor_of_dim(spec, 0, mesh_shape)
    offset = shard_offset(spec, 0, global_len, mesh_shape, coordinate)
    first = start + offset * step
    return [first, first + local_len * step, step]

