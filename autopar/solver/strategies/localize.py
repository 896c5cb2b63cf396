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
- gather along a dim the input shards: `masked_gather` with this rank's block
  (vocabulary-parallel cross-entropy, see `rules_cross_entropy`);
- log-softmax over a dim the input shards: `runtime.vocab_parallel.vocab_parallel_log_softmax`,
  which exchanges per-row statistics over the mesh axes splitting that dim;
- training batch norm with its batch (or spatial) dims sharded: `runtime.sync_batch_norm`,
  which exchanges per-channel statistics (see `rules_batch_norm`).
  These two need `group_names` (one c10d group name per mesh axis) and run collectives
  inside the node (`in_node_collectives` lists them for the cost model).
Tensor arguments are returned unchanged (fx.Nodes); the caller substitutes
each rank's local tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx

# The lowerings that exchange values between ranks live with the runtime's collectives.
from autopar.runtime.sync_batch_norm import sync_batch_norm
from autopar.runtime.vocab_parallel import vocab_parallel_log_softmax
from autopar.solver.spec import Shard, Spec, Strategy

aten = torch.ops.aten

# op -> index of its size argument (DTensor keeps a similar table for views, `op_to_shape_and_stride_idx`).
_SIZE_ARG = {
    aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
    aten.view_copy.default: 1, aten.expand_copy.default: 1,
    aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_empty.default: 1, aten.new_full.default: 1,
    aten.full.default: 0, aten.zeros.default: 0, aten.ones.default: 0, aten.empty.memory_format: 0,
    aten.empty_permuted.default: 0,
    aten.rand.default: 0, aten.randn.default: 0,
}
_ARANGE = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_MEAN = (aten.mean.default, aten.mean.dim)
_BATCH_NORM = aten._native_batch_norm_legit_functional.default


def reduced_dims(op: Any, args: Sequence, kwargs: dict, ndim: int) -> frozenset[int]:
    """The dims a mean/sum reduces, normalised (None or [] over a mean.dim/sum.dim_IntList: all dims)."""
    if op in (aten.mean.default, aten.sum.default):
        return frozenset(range(ndim))
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return frozenset(range(ndim))
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return frozenset(int(d) % max(ndim, 1) for d in dims)


def _local_indices(indices: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices into this rank's block [lo, hi), with 0 where outside; the outside mask)."""
    outside = aten.logical_or.default(aten.lt.Scalar(indices, lo), aten.ge.Scalar(indices, hi))
    return aten.masked_fill.Scalar(aten.sub.Scalar(indices, lo), outside, 0), outside


def masked_embedding(weight: torch.Tensor, indices: torch.Tensor, lo: int, hi: int, padding_idx: int = -1) -> torch.Tensor:
    """This rank's term of a lookup into rows [lo, hi) of a table: indices outside the range give
    zero rows (and, through masked_fill's backward, no gradient), so the ranks' terms sum to the lookup."""
    local, outside = _local_indices(indices, lo, hi)
    local_pad = padding_idx - lo if lo <= padding_idx < hi else -1
    rows = aten.embedding.default(weight, local, local_pad)
    return aten.masked_fill.Scalar(rows, aten.unsqueeze.default(outside, -1), 0.0)


def masked_gather(x: torch.Tensor, dim: int, index: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """This rank's term of `gather(full_x, dim, index)` when it holds positions [lo, hi) of `dim`:
    indices outside its block give zeros (and no gradient), so the ranks' terms sum to the lookup."""
    local, outside = _local_indices(index, lo, hi)
    return aten.masked_fill.Scalar(aten.gather.default(x, dim, local), outside, 0.0)


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


def split_axes_of_dim(spec: Spec, dim: int) -> tuple[int, ...]:
    """The mesh axes on which `spec` shards tensor dim `dim`."""
    return tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim == dim)


def _op_dim(node: fx.Node) -> int:
    """The `dim` argument of a log_softmax / gather node, normalised."""
    return int(node.args[1]) % max(node.args[0].meta["val"].dim(), 1)


@dataclass(frozen=True)
class InNodeCollective:
    """A collective a node's lowering runs inside the node, for the cost model."""
    kind: str  # a `CollectiveStep` kind
    nbytes: float  # per rank
    mesh_axis: int
    forward: bool  # in forward (run again when the node is recomputed) or in backward


def exchange_axes(node: fx.Node, strategy: Strategy) -> tuple[int, ...]:
    """Mesh axes over which the lowering of `node` exchanges statistics inside the node: the class
    dim of a log-softmax, the batch/spatial dims of a training batch norm; () for every other node."""
    if not strategy.input_specs:
        return ()
    x = strategy.input_specs[0]
    if node.target is aten._log_softmax.default:
        return split_axes_of_dim(x, _op_dim(node))
    if node.target is _BATCH_NORM and node.args[5]:
        return tuple(a for a, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim != 1)
    return ()


def needs_groups(node: fx.Node, strategy: Strategy) -> bool:
    """Whether `local_call` needs the mesh's group names for this node under `strategy`."""
    return bool(exchange_axes(node, strategy))


def in_node_collectives(node: fx.Node, strategy: Strategy, mesh_shape: Sequence[int]) -> tuple[InNodeCollective, ...]:
    """Collectives the lowering of `node` under `strategy` runs inside the node in one training step."""
    axes = exchange_axes(node, strategy)
    if not axes:
        return ()
    if node.target is _BATCH_NORM:
        # forward: per-channel sum and sum of squared deviations; backward: their gradients
        out = node.meta["val"][0]
        local = strategy.output_specs[0].local_shape(tuple(int(s) for s in out.shape), mesh_shape)
        nbytes, phases = local[1] * out.element_size(), (True, True, False, False)
    else:
        # forward: each row's max and sum of exponentials; backward: the sum of its output gradient
        dim, val = _op_dim(node), node.meta["val"]
        local = strategy.output_specs[0].local_shape(tuple(int(s) for s in val.shape), mesh_shape)
        nbytes, phases = math.prod(local) // max(local[dim], 1) * val.element_size(), (True, True, False)
    return tuple(InNodeCollective("all_reduce", float(nbytes), a, forward) for a in axes for forward in phases)


def _groups_of(node: fx.Node, strategy: Strategy, group_names: Sequence[str] | None) -> tuple[str, ...]:
    if group_names is None:
        raise ValueError(f"{node.name}: its lowering under {strategy} exchanges values between ranks; pass the mesh's group names")
    return tuple(group_names[a] for a in exchange_axes(node, strategy))


def local_call(node: fx.Node, strategy: Strategy, mesh_shape: Sequence[int], coordinate: Sequence[int],
               group_names: Sequence[str] | None = None) -> tuple[Any, tuple, dict]:
    args, kwargs = tuple(node.args), dict(node.kwargs)
    op = node.target
    if op is _BATCH_NORM and needs_groups(node, strategy):
        x = node.args[0].meta["val"]
        count = x.numel() // int(x.shape[1])  # elements per channel in the global batch
        return sync_batch_norm, (*args[:5], args[6], args[7], count, _groups_of(node, strategy, group_names)), {}
    if op is aten.native_group_norm.default and strategy.input_specs:
        # (x, weight, bias, N, C, HxW, group, eps) spells the batch size out: split, it is the local one
        x = node.args[0].meta["val"]
        n_local = strategy.input_specs[0].local_shape(tuple(int(s) for s in x.shape), mesh_shape)[0]
        return op, args[:3] + (n_local,) + args[4:], kwargs
    val = node.meta.get("val")
    if not strategy.output_specs or not isinstance(val, torch.Tensor):
        return op, args, kwargs
    out_spec = strategy.output_specs[0]
    if op in _MEAN:
        return _local_mean(node, strategy, mesh_shape)
    if op is aten._log_softmax.default and needs_groups(node, strategy):
        groups = _groups_of(node, strategy, group_names)
        return vocab_parallel_log_softmax, (args[0], _op_dim(node), bool(args[2]), groups), {}
    if op is aten.gather.default and strategy.input_specs and split_axes_of_dim(strategy.input_specs[0], _op_dim(node)):
        dim = _op_dim(node)
        index, count = block_index(strategy.input_specs[0], dim, mesh_shape, coordinate)
        block = int(node.args[0].meta["val"].shape[dim]) // count
        return masked_gather, (args[0], dim, args[2], index * block, (index + 1) * block), {}
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
