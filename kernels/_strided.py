"""Host side of `strided_ew_kernel`: collapse an N-d problem to 4 dims and launch it.

The kernel indexes (S0, S1, S2, S3) with its own strides per operand. Most real layouts need
far fewer dims once neighbours that are contiguous for *every* operand are merged (the same
coalescing torch's TensorIterator does): a Shard(1) -> Shard(2) layout of a contiguous (B, S, H)
tensor is 4 dims, a copy between contiguous tensors is 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels._dispatch import device_guard, triton_kernels

_KERNEL_DIMS = 4
_TILE_ELEMENTS = 4096  # elements per program: 32 per thread at triton's default 4 warps
_MAX_BLOCK_C = 1024


def collapse_dims(
    sizes: Sequence[int], *strides: Sequence[int]
) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge each dim into its outer neighbour when, for every operand,
    outer stride == inner stride * inner size. Returns (sizes, one stride list per operand)."""
    out_sizes: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for d, n in enumerate(sizes):
        if n == 1:
            continue
        if out_sizes and all(st[-1] == s[d] * n for st, s in zip(out_strides, strides)):
            out_sizes[-1] *= n
            for st, s in zip(out_strides, strides):
                st[-1] = s[d]
        else:
            out_sizes.append(n)
            for st, s in zip(out_strides, strides):
                st.append(s[d])
    return out_sizes, out_strides


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def launch_strided(
    out: torch.Tensor,
    x: torch.Tensor,
    *,
    scale: float = 1.0,
    r: torch.Tensor | None = None,
) -> None:
    """out = round(float32(x) * scale + float32(r)); all operands have out's shape. `r` may be `out` itself
    (accumulate in place)."""
    if out.numel() == 0:
        return
    operands = [out, x] + ([r] if r is not None else [])
    sizes, strides = collapse_dims(out.shape, *(t.stride() for t in operands))
    if len(sizes) > _KERNEL_DIMS:  # only for exotic layouts; costs one extra copy
        if not all(t is None or t is out or t.is_contiguous() for t in (x, r)):
            r_arg = out if r is out else None if r is None else r.contiguous()
            launch_strided(out, x.contiguous(), scale=scale, r=r_arg)
        else:  # the output itself is fragmented: compute into a dense buffer, then copy
            tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            launch_strided(tmp, x, scale=scale, r=None if r is None else r.contiguous())
            out.copy_(tmp)
        return

    pad = _KERNEL_DIMS - len(sizes)
    s0, s1, s2, s3 = [1] * pad + sizes
    full = [[0] * pad + st for st in strides]
    so, sx = full[0], full[1]
    sr = full[2] if r is not None else [0] * 4
    block_c = min(_pow2_at_least(s3), _MAX_BLOCK_C)
    block_r = max(1, _TILE_ELEMENTS // block_c)
    rows = s0 * s1 * s2
    grid = (-(-rows // block_r) * -(-s3 // block_c),)
    with device_guard(out.device):
        triton_kernels().strided_ew_kernel[grid](
            out, x, x if r is None else r,
            float(scale),
            rows, s1, s2, s3,
            *so, *sx, *sr,
            HAS_R=r is not None,
            BLOCK_R=block_r, BLOCK_C=block_c,
            enable_fp_fusion=False,  # x * scale + r stays two roundings, as in the torch fallback
        )
