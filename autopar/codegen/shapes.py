"""Local sizes: shape arguments rewritten for one rank's shard, and shard slicing.

The traced graph carries global sizes (`view(x, [32, 64])`); on a rank that
holds `S(0)` over 2 devices the same op must read `view(x, [16, 64])`. The
output's meta shape and its spec give the local shape exactly (a `-1` in the
argument is resolved the same way), so we never guess from the argument.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import fx

from autopar.errors import AutoparError
from autopar.solver.spec import Shard, Spec, Strategy
from autopar.solver.strategies.localize import local_call

aten = torch.ops.aten


class LoweringError(AutoparError):
    """A node cannot run on local shards under the planned strategy; names the node and the strategy."""


# ops that cut along a dim given as an argument: (index of the dim argument, its default)
_SPLITS = {aten.split_with_sizes.default: (2, 0), aten.split.Tensor: (2, 0)}
_DIM_INDEXING = {aten.slice.Tensor: (1, 0), aten.narrow.default: (1, None), aten.select.int: (1, None)}


def shard_factor_of_dim(spec: Spec, dim: int, mesh_shape: Sequence[int]) -> int:
    n = 1
    for p, size in zip(spec.placements, mesh_shape):
        if isinstance(p, Shard) and p.dim == dim:
            n *= size
    return n


def local_block(t: torch.Tensor, spec: Spec, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> torch.Tensor:
    """This rank's block of a full tensor (Partial placements keep the whole value: callers decide)."""
    for p, n, c in zip(spec.placements, mesh_shape, coordinate):
        if isinstance(p, Shard):
            if t.shape[p.dim] % n:
                raise LoweringError(f"dim {p.dim} of size {t.shape[p.dim]} does not divide over a mesh axis of {n} (spec {spec})")
            t = t.chunk(n, p.dim)[c]
    return t


def localize_call(node: fx.Node, strategy: Strategy, mesh_shape: Sequence[int], coordinate: Sequence[int],
                  group_names: Sequence[str]) -> tuple[Any, tuple, dict]:
    """(target, args, kwargs) of `node` for this rank; tensor arguments stay the traced fx.Nodes.

    Sizes of views/factories and arange bounds come from the strategies' `local_call`
    (shared with their numeric proof), as do rank-dependent lowerings and those with
    collectives inside the node (which get the mesh axes' group names); split sizes
    along a sharded dim are ours.
    """
    target, args, kwargs = local_call(node, strategy, mesh_shape, coordinate, group_names)
    return target, tuple(_localize_dims(node, target, list(args), strategy.input_specs, mesh_shape)), kwargs


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
    if op in _DIM_INDEXING and first_in is not None:
        dim_i, default = _DIM_INDEXING[op]
        dim = args[dim_i] if len(args) > dim_i else default
        x_dim = node.args[0].meta["val"].dim()
        if dim is not None and shard_factor_of_dim(first_in, dim % x_dim, mesh_shape) > 1:
            raise LoweringError(
                f"{node.format_node()}: strategy {first_in} shards dim {dim}, which {op} indexes into; "
                "the strategy rule for this op must not allow sharding the indexed dim"
            )
    return args
