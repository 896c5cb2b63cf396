"""The plan-independent input convention: each rank feeds its slice of the global batch.

    local = batch_slice(global_batch, rank, world_size)   # one equal part per rank, as DistributedSampler splits data
    loss = pm(**local)

With `input_layout="shard"` rank r feeds the contiguous rows [r*B/W, (r+1)*B/W) of the global batch
(B rows, W ranks) along dim 0 of every batched input, ranks in row-major mesh order.
On the mesh that is `Shard(0)` on every axis (`fed_spec`), whatever the plan: the
generated module reshards from there to the layout its plan wants, so a data loader
never depends on the plan. A tensor input is *batched* when its dim 0 equals the
batch size (dim 0 of the first tensor input with at least one dim); other inputs
(scalars, a shared position table) are fed whole on every rank.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError
from autopar.solver.spec import Replicate, Shard, Spec


class BatchError(AutoparError):
    """The global batch cannot be split evenly over the ranks."""


def batch_size_of(shapes: Sequence[Sequence[int]]) -> int | None:
    """Dim 0 of the first shape with at least one dim (None: no batched input)."""
    return next((int(s[0]) for s in shapes if len(s) >= 1), None)


def is_batched(shape: Sequence[int], batch: int | None) -> bool:
    return batch is not None and len(shape) >= 1 and int(shape[0]) == batch


def check_divisible(batch: int, world_size: int) -> None:
    if batch % world_size:
        raise BatchError(
            f"global batch size {batch} does not divide over world size {world_size}, so ranks cannot feed equal slices; "
            f"use a batch size divisible by {world_size} (e.g. {(batch // world_size + 1) * world_size}) "
            "or parallelize(..., input_layout='replicate') and feed the whole batch on every rank"
        )


def fed_spec(shape: Sequence[int], batch: int | None, mesh_ndim: int) -> Spec:
    """How a rank feeds a tensor of the global `shape`: its batch slice = Shard(0) on every mesh axis."""
    placement = Shard(0) if is_batched(shape, batch) else Replicate()
    return Spec((placement,) * mesh_ndim)


def batch_slice(batch: Any, rank: int, world_size: int) -> Any:
    """This rank's slice of every batched tensor of `batch` (a tensor, tuple, dict...): the DistributedSampler split.
    A mapping other than a dict (a tokenizer's `BatchEncoding`, which pytree does not open) comes back a dict."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)
    flat, treespec = pytree.tree_flatten(batch)
    size = batch_size_of([t.shape for t in flat if isinstance(t, torch.Tensor)])
    if size is None:
        return batch
    check_divisible(size, world_size)
    rows = size // world_size
    out = [t[rank * rows:(rank + 1) * rows] if isinstance(t, torch.Tensor) and is_batched(t.shape, size) else t for t in flat]
    return pytree.tree_unflatten(out, treespec)


def global_like(local: Any, world_size: int) -> Any:
    """Meta tensors shaped as the global batch whose `batch_slice` each rank fed as `local` (the inverse of
    the split, in shapes and dtypes only: for tracing the model at the batch's sizes)."""
    flat, treespec = pytree.tree_flatten(local)
    rows = batch_size_of([t.shape for t in flat if isinstance(t, torch.Tensor)])
    out = []
    for t in flat:
        if isinstance(t, torch.Tensor):
            shape = (t.shape[0] * world_size, *t.shape[1:]) if is_batched(t.shape, rows) else t.shape
            t = torch.empty(shape, dtype=t.dtype, device="meta")
        out.append(t)
    return pytree.tree_unflatten(out, treespec)
