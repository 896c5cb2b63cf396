"""The plan-independent input convention: each rank feeds its slice of the global batch.

    local = batch_slice(global_batch, rank, world_size)                # the batch along dim 0
    local = batch_slice(global_batch, rank, world_size, batch_dim=1)   # (seq, batch) inputs

With `input_layout="shard"` rank r feeds the contiguous part [r*B/W, (r+1)*B/W) of the global batch
(B samples, W ranks) along each batched input's batch dim, ranks in row-major mesh order: dim 0
unless `parallelize(..., batch_dim=...)` says otherwise (`autopar.tracer.batch_dims`, which also
says which inputs are batched: by default those whose dim 0 is the batch size, dim 0 of the first
tensor input; other inputs, scalars or a shared position table, are fed whole on every rank).
On the mesh that is `Shard(dim)` on every axis (`fed_spec`), whatever the plan: the generated
module reshards from there to the layout its plan wants, so a data loader never depends on the plan.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.solver.spec import Replicate, Shard, Spec
from autopar.tracer import split_sample_input
from autopar.tracer.batch_dims import BatchDim, batch_dims, batch_size


class BatchError(AutoparError):
    """The global batch cannot be split evenly over the ranks."""


def check_divisible(batch: int, world_size: int) -> None:
    if batch % world_size:
        raise BatchError(
            f"global batch size {batch} does not divide over world size {world_size}, so ranks cannot feed equal slices; "
            f"use a batch size divisible by {world_size} (e.g. {(batch // world_size + 1) * world_size}) "
            "or parallelize(..., input_layout='replicate') and feed the whole batch on every rank"
        )


def fed_spec(dim: int | None, mesh_ndim: int) -> Spec:
    """How a rank feeds a tensor whose batch runs along `dim` (None: fed whole): `Shard(dim)` on every mesh axis."""
    return Spec(((Replicate() if dim is None else Shard(dim)),) * mesh_ndim)


def batch_slice(batch: Any, rank: int, world_size: int, batch_dim: BatchDim = 0) -> Any:
    """This rank's slice of every batched tensor of `batch` (a tensor, tuple, dict...): the DistributedSampler split.
    A mapping other than a dict (a tokenizer's `BatchEncoding`, which pytree does not open) comes back a dict."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)
    flat, treespec = pytree.tree_flatten(batch)
    dims = batch_dims(*split_sample_input(batch), batch_dim)
    size = batch_size(flat, dims)
    if size is None:
        return batch
    check_divisible(size, world_size)
    return pytree.tree_unflatten(slice_leaves(flat, dims, rank, world_size), treespec)


def slice_leaves(leaves: Sequence[Any], dims: Sequence[int | None], rank: int, world_size: int) -> list[Any]:
    """Rank `rank`'s part of each leaf along its batch dim (None: the leaf whole). A part cut from any dim but
    the first is copied to its own contiguous storage, as a data loader would hand it over."""
    out = []
    for leaf, dim in zip(leaves, dims, strict=True):
        if dim is not None:
            part = leaf.shape[dim] // world_size
            leaf = leaf.narrow(dim, rank * part, part)
            leaf = leaf if dim == 0 else leaf.contiguous()
        out.append(leaf)
    return out


def global_like(leaves: Sequence[Any], dims: Sequence[int | None], world_size: int) -> list[Any]:
    """Meta tensors shaped as the global batch whose slices each rank fed as `leaves`, batched along `dims` (the
    inverse of the split, in shapes and dtypes only: for tracing the model at the batch's sizes)."""
    out = []
    for leaf, dim in zip(leaves, dims, strict=True):
        if isinstance(leaf, torch.Tensor):
            shape = list(leaf.shape)
            if dim is not None:
                shape[dim] *= world_size
            leaf = torch.empty(shape, dtype=leaf.dtype, device="meta")
        out.append(leaf)
    return out
