"""Autograd-aware collectives over one mesh axis, named by the axis' c10d group name.

Every function here is a plain module-level function `f(x, ..., group: str)`, so
codegen can put it in an fx graph as a `call_function` node and `gm.code` reads
`all_gather(linear_1, 2, '3')`. Each wraps a small `torch.autograd.Function`
whose backward is the conjugate collective (Megatron/picotron f/g operators).

Gradient conventions (all reductions are sums; the loss is the global loss):
- the grad of a Replicate tensor is the complete gradient, identical on every rank;
- the grad of a Shard(d) tensor is this rank's chunk of the complete gradient;
- the grad of a Partial tensor is the complete gradient of the sum (on every rank),
  because d(sum_r x_r)/dx_r = 1;
- a "partial grad" (a rank holds one term of the gradient) arises when a
  Replicate tensor feeds a computation sharded over the axis.

The data moves through `runtime.comm` (c10d calls on named groups; why not torch's
functional collectives is said there). All of them move flat buffers split along
dim 0; for another tensor dim the data is laid out with the fused
`kernels.chunk_to_leading` / `kernels.leading_to_dim` (one pass each, Triton on
GPU, a strided torch copy on CPU).

Mixed precision (`autopar.MixedPrecision`): a ZeRO parameter's float32 shard is gathered in the
compute dtype, cast in the packing of the gather's send buffer (`kernels.pack`, one pass), and
its gradient is reduce-scattered in the reduce dtype, cast in the layout of the send buffer
(`kernels.chunk_to_leading`, one pass): `all_gather_rs(shard, dim, group, torch.bfloat16, torch.float32)`.
"""
from __future__ import annotations

import torch

from autopar.runtime import comm
from autopar.runtime.comm import Started
from autopar.runtime.comm import group_size_rank as _group
from autopar.runtime.deferred_loss import deferred_all_reduce, deferred_mean, start_count
from kernels import chunk_to_leading, leading_to_dim, pack


def _check_even(x: torch.Tensor, dim: int, size: int, group: str) -> None:
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} (shape {tuple(x.shape)}) does not split evenly over group {group!r} of {size} ranks")


def _local_chunk(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    size, rank = _group(group)
    _check_even(x, dim, size, group)
    # a fresh tensor, also where the chunk is already contiguous (dim 0): a view would keep all of x alive
    # wherever the chunk is saved (measured: bert's tightest plan saved its full-batch all-reduce outputs)
    return x.chunk(size, dim)[rank].clone(memory_format=torch.contiguous_format)


def _gather(x: torch.Tensor, dim: int, group: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """All-gather along `dim`, in `dtype` (default: x's own)."""
    size, _ = _group(group)
    send = x.contiguous().view(-1) if dtype in (None, x.dtype) else pack([x], dtype=dtype)
    buf = comm.all_gather(send, group)
    shape = list(x.shape)
    shape[dim] *= size
    return leading_to_dim(buf, dim, size, shape)


def _reduce_scatter(x: torch.Tensor, dim: int, group: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reduce-scatter along `dim`, summed in `dtype` (default: x's own)."""
    size, _ = _group(group)
    _check_even(x, dim, size, group)
    out = None if dtype in (None, x.dtype) else torch.empty(x.numel(), dtype=dtype, device=x.device)
    send = chunk_to_leading(x, dim, size, out)  # (size, *chunk_shape)
    summed = comm.reduce_scatter(send.reshape(-1), group)
    return summed.view(x.shape[:dim] + (x.shape[dim] // size,) + x.shape[dim + 1:])


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return comm.all_reduce(x, group)


def all_reduce_max(x: torch.Tensor, group: str) -> torch.Tensor:
    """Elementwise max over `group`, outside autograd: for values that only steady a computation
    (the row max that keeps a sharded softmax's exponentials in range), never differentiated."""
    return comm.all_reduce(x, group, "max")


def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group: str) -> torch.Tensor:
    """Chunk j of `x` along dst_dim goes to rank j; chunks received from rank i are stacked along src_dim."""
    size, _ = _group(group)
    _check_even(x, dst_dim, size, group)
    recv = comm.all_to_all(chunk_to_leading(x, dst_dim, size).reshape(-1), group)
    shape = list(x.shape)
    shape[src_dim] *= size
    shape[dst_dim] //= size
    return leading_to_dim(recv, src_dim, size, shape)


class _AllGather(torch.autograd.Function):
    """S(dim) -> R (in `dtype`). Backward keeps this rank's chunk of the (complete) grad. Megatron: gather_from_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: str, dtype: torch.dtype | None) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group, dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _local_chunk(grad, ctx.dim, ctx.group), None, None, None


class _AllGatherReduceScatter(torch.autograd.Function):
    """S(dim) -> R (in `dtype`) feeding a sharded consumer; backward reduce-scatters the partial grads (in
    `reduce_dtype`). Megatron: gather_from_sequence_parallel_region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: str, dtype: torch.dtype | None,
                reduce_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.reduce_dtype = dim, group, reduce_dtype
        return _gather(x, dim, group, dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # (autograd casts a gradient summed in another dtype than x's to x's)
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.reduce_dtype), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    """P -> S(dim). Backward all-gathers. Megatron: reduce_scatter_to_sequence_parallel_region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _AllReduce(torch.autograd.Function):
    """P -> R; backward identity. Megatron's "g": reduce_from_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: str) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; backward all-reduces the partial grads. Megatron's "f": copy_to_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: str) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a new tensor object, so autograd records this node

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """S(src_dim) -> S(dst_dim); backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, src_dim: int, dst_dim: int, group: str) -> torch.Tensor:
        ctx.src_dim, ctx.dst_dim, ctx.group = src_dim, dst_dim, group
        return _all_to_all(x, src_dim, dst_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.dst_dim, ctx.src_dim, ctx.group), None, None, None


class _LocalSlice(torch.autograd.Function):
    """R -> S(dim): keep this rank's chunk (a copy, so the full tensor can be freed); backward all-gathers. Megatron: scatter_to_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _local_chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _ReplicateToPartial(torch.autograd.Function):
    """R -> P: rank 0 of the axis keeps x, the others hold zeros; backward identity (the grad of each term is the complete grad)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: str) -> torch.Tensor:
        _, rank = _group(group)
        return x.clone() if rank == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_gather(x: torch.Tensor, dim: int, group: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """S(dim) -> R over `group`, gathered in `dtype` (default: x's); backward: this rank's chunk of the complete grad."""
    return _AllGather.apply(x, dim % x.ndim, group, dtype)


def all_gather_rs(x: torch.Tensor, dim: int, group: str, dtype: torch.dtype | None = None,
                  reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """S(dim) -> R for a consumer sharded over the same axis (ZeRO params, sequence parallelism), gathered in `dtype`
    (default: x's); backward: reduce-scatter, summed in `reduce_dtype` (default: the gradient's)."""
    return _AllGatherReduceScatter.apply(x, dim % x.ndim, group, dtype, reduce_dtype)


def reduce_scatter(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """P -> S(dim); backward: all-gather."""
    return _ReduceScatter.apply(x, dim % x.ndim, group)


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """P -> R; backward: identity."""
    return _AllReduce.apply(x, group)


def grad_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """R entering a computation sharded over `group`: identity forward; backward: all-reduce of the partial grads."""
    return _GradAllReduce.apply(x, group)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group: str) -> torch.Tensor:
    """S(src_dim) -> S(dst_dim); backward: S(dst_dim) -> S(src_dim)."""
    return _AllToAll.apply(x, src_dim % x.ndim, dst_dim % x.ndim, group)


def local_slice(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """R -> S(dim); backward: all-gather."""
    return _LocalSlice.apply(x, dim % x.ndim, group)


def replicate_to_partial(x: torch.Tensor, group: str) -> torch.Tensor:
    """R -> P (rank 0 of the axis holds x, the others zeros); backward: identity."""
    return _ReplicateToPartial.apply(x, group)


# Collectives on values without gradient (token counts, labels), issued without waiting: the result
# may only be read after its wait, so codegen can start them early and overlap them with compute
# (`autopar.codegen.schedule`).

def all_reduce_start(x: torch.Tensor, group: str) -> Started:
    """P -> R, started; `wait(result)` gives the sum."""
    return comm.all_reduce(x, group, async_op=True)


def wait(started: Started) -> torch.Tensor:
    """Block until the collective `started` (`all_reduce_start`) has finished; its result."""
    return started.wait()


def all_gather_start(x: torch.Tensor, group: str) -> Started:
    """S(dim) -> R, started: the ranks' flat buffers, stacked; `wait_all_gather` lays them out."""
    return comm.all_gather(x.reshape(-1), group, async_op=True)


def wait_all_gather(started: Started, x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """The gathered tensor of `all_gather_start(x, group)`, concatenated along `dim`."""
    size, _ = _group(group)
    shape = list(x.shape)
    shape[dim % x.ndim] *= size
    return leading_to_dim(started.wait(), dim % x.ndim, size, shape)


# Every collective codegen may emit, by name (codegen maps CollectiveStep.kind onto these).
COLLECTIVES = {
    f.__name__: f
    for f in (all_gather, all_gather_rs, reduce_scatter, all_reduce, grad_all_reduce, all_to_all, local_slice, replicate_to_partial,
              all_reduce_start, all_gather_start, deferred_all_reduce, start_count, deferred_mean)
}
