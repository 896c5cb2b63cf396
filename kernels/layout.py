"""Layouts for resharding along a dim other than 0.

Collectives move contiguous buffers split along their leading dim: `all_to_all_single` and
`reduce_scatter_tensor` send chunk i of the input's dim 0 to rank i, `all_gather_into_tensor`
stacks rank i's buffer at position i of dim 0. Resharding along another dim therefore needs a
layout change around the collective, which a naive runtime writes as
`torch.cat([c.contiguous() for c in x.chunk(parts, dim)])` before and
`torch.cat(buf.chunk(parts), dim)` after: `parts` copies plus a concatenation, i.e. every byte
moved twice. Here each side is one pass (one Triton kernel, or one torch strided copy):

    # all-gather on the last dim: local (B, S, H/p) -> (B, S, H)
    buf = all_gather_into_tensor(..., x.contiguous())            # (p*B, S, H/p)
    y = leading_to_dim(buf, dim=-1, parts=p, shape=(B, S, H))
    # all-to-all Shard(1) -> Shard(2): local (B, S/p, H) -> (B, S, H/p)
    send = chunk_to_leading(x, dim=2, parts=p)                   # (p, B, S/p, H/p)
    recv = all_to_all_single(..., send)                           # (p, B, S/p, H/p)
    y = leading_to_dim(recv, dim=1, parts=p, shape=(B, S, H // p))

`dim` must be divisible by `parts` (pad uneven shards before, as DTensor does). Passing `out`
in another dtype fuses a cast (e.g. to bf16 for the wire) into the same pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kernels._dispatch import Impl, use_triton
from kernels._strided import launch_strided


def chunk_to_leading(
    x: torch.Tensor,
    dim: int,
    parts: int,
    out: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Contiguous (parts, *chunk_shape) buffer whose [i] is `x.chunk(parts, dim)[i]`, i.e. the
    input of an all-to-all / reduce-scatter that splits `x` along `dim`. When no data has to
    move (dim 0, or only size-1 dims before `dim`) and `out` is None, returns a view of `x`."""
    dim = _normalize(dim, x.dim(), "chunk_to_leading")
    chunk = _chunk_size(x.shape[dim], parts, dim, "chunk_to_leading")
    src = x.unflatten(dim, (parts, chunk)).movedim(dim, 0)  # (parts, *pre, chunk, *post), a view
    if out is None:
        if src.is_contiguous():
            return src
        out = torch.empty(src.shape, dtype=x.dtype, device=x.device)
    elif out.numel() != src.numel() or not out.is_contiguous():
        raise ValueError(f"chunk_to_leading: out must be contiguous with {src.numel()} elements "
                         f"(shape {tuple(src.shape)}), got shape {tuple(out.shape)}, strides {out.stride()}")
    _copy(out.view(src.shape), src, impl, "chunk_to_leading")
    return out


def leading_to_dim(
    buf: torch.Tensor,
    dim: int,
    parts: int,
    shape: Sequence[int],
    out: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Inverse of `chunk_to_leading`: `buf` holds `parts` chunks back to back (e.g. the output
    of an all-gather or all-to-all, any shape with prod(shape) elements); returns the tensor of
    `shape` with chunk i at position i along `dim`, i.e. `torch.cat(chunks, dim)`. Returns a view
    of `buf` when no data has to move and `out` is None."""
    shape = tuple(int(n) for n in shape)
    dim = _normalize(dim, len(shape), "leading_to_dim")
    chunk = _chunk_size(shape[dim], parts, dim, "leading_to_dim")
    if buf.numel() != math.prod(shape):
        raise ValueError(f"leading_to_dim: buf has {buf.numel()} elements, shape {shape} needs {math.prod(shape)}")
    src = buf.reshape(parts, *shape[:dim], chunk, *shape[dim + 1:])  # a view when buf is contiguous
    if out is None:
        in_place = src.movedim(0, dim)  # (*pre, parts, chunk, *post)
        if in_place.is_contiguous():
            return in_place.view(shape)
        out = torch.empty(shape, dtype=buf.dtype, device=buf.device)
    elif tuple(out.shape) != shape:
        raise ValueError(f"leading_to_dim: out has shape {tuple(out.shape)}, expected {shape}")
    _copy(out.unflatten(dim, (parts, chunk)).movedim(dim, 0), src, impl, "leading_to_dim")
    return out


def _copy(dst: torch.Tensor, src: torch.Tensor, impl: Impl, op: str) -> None:
    """dst[...] = src, cast to dst's dtype: one strided pass either way."""
    if dst.device != src.device:
        raise ValueError(f"{op}: out is on {dst.device} but the input is on {src.device}")
    with torch.no_grad():
        if use_triton(impl, [dst, src], op):
            launch_strided(dst, src)
        else:
            dst.copy_(src)


def _normalize(dim: int, ndim: int, op: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: dim {dim} out of range for a {ndim}-d tensor")
    return dim % ndim


def _chunk_size(size: int, parts: int, dim: int, op: str) -> int:
    if parts < 1 or size % parts:
        raise ValueError(f"{op}: dim {dim} of size {size} does not split into {parts} equal parts; "
                         f"pad it to a multiple of {parts} first")
    return size // parts
