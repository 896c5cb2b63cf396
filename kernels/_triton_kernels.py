"""The @triton.jit kernels. Imported only on the Triton path (see `_dispatch.triton_kernels`).

Every kernel loads its inputs in their own dtype, does its arithmetic in float32 and rounds once
when it stores, so a kernel and its torch fallback agree bit for bit wherever the fallback also
rounds once (the tests check this).

Three kernels:
- `multi_tensor_pack_kernel`: many contiguous tensors of one dtype -> slices of a flat bucket,
  times `scale`, cast to the bucket's dtype. One launch for a whole bucket instead of one
  copy + one scale + one cast per gradient.
- `multi_tensor_unpack_kernel`: the inverse; optionally adds into the existing values (.grad); its scale
  may be a 0-d tensor on the device (a mean's divisor the host has not read).
- `strided_ew_kernel`: out = x * scale [+ r] over a 4-d index space where every operand has its
  own strides. Without r it is a permuting copy (the resharding layouts: chunks of a non-leading
  dim <-> a leading chunk dim, cast on the way if out has another dtype); it also serves
  non-contiguous members of pack/unpack (r = out: accumulate).

Only builtins of triton.language are used (load, store, where, arange, ...), no functions that
triton.language itself defines with @triton.jit (tl.cdiv, tl.sum, ...): those are decorated when
*triton* is imported, so if triton was imported before TRITON_INTERPRET was set, calling one
from an interpreted kernel fails ("Cannot call @triton.jit'd outside of the scope of a kernel").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import interpret_requested

# Whether these kernels were decorated under TRITON_INTERPRET (triton.jit decides at decoration).
BUILT_INTERPRETED: bool = interpret_requested()

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _fp32_to_bf16(x):
    # Round-to-nearest-even by integer arithmetic, as c10::BFloat16 does. A plain
    # `x.to(tl.bfloat16)` is also RTNE when compiled, but Triton 3.9's interpreter truncates
    # (its fp32->bf16 cast ignores the rounding mode), so the explicit version is what lets the
    # interpreter tests check the GPU arithmetic bit for bit. The cost (4 integer ops per
    # element) is invisible in these memory-bound kernels.
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast(x, DTYPE: tl.constexpr):
    # float32 -> DTYPE with a single round-to-nearest-even.
    if DTYPE == tl.bfloat16:
        return _fp32_to_bf16(x)
    else:
        return x.to(DTYPE)


@triton.jit
def multi_tensor_pack_kernel(
    table_ptr,  # int64 (n_chunks, 4): (address, numel, bucket offset, chunk start)
    out_ptr,  # the flat bucket
    scale,  # float32: multiplies every element (1 / world size for a gradient average)
    SRC_DTYPE: tl.constexpr,  # dtype of every source in this launch (one launch per dtype)
    CHUNK: tl.constexpr,  # elements per program: big tensors are split, so programs balance
    BLOCK: tl.constexpr,  # elements per loop step
):
    row = table_ptr + tl.program_id(0) * 4
    src = tl.load(row).to(tl.pointer_type(SRC_DTYPE))  # raw address -> typed pointer
    numel = tl.load(row + 1)
    dst = out_ptr + tl.load(row + 2)
    start = tl.load(row + 3)
    for step in range(0, CHUNK, BLOCK):
        idx = start + step + tl.arange(0, BLOCK)
        mask = idx < numel
        x = tl.load(src + idx, mask=mask).to(tl.float32) * scale
        tl.store(dst + idx, _cast(x, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def multi_tensor_unpack_kernel(
    table_ptr,  # int64 (n_chunks, 4): (address, numel, bucket offset, chunk start)
    bucket_ptr,  # the flat bucket
    scale,  # float32
    scale_ptr,  # a float32 scale in device memory, read instead of `scale` when SCALE_IN_MEMORY (else any tensor)
    DST_DTYPE: tl.constexpr,  # dtype of every destination in this launch
    ACCUMULATE: tl.constexpr,  # dst = dst + bucket * scale instead of dst = bucket * scale
    SCALE_IN_MEMORY: tl.constexpr,  # a scale the host does not know (a mean's global count): no sync to read it
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = table_ptr + tl.program_id(0) * 4
    dst = tl.load(row).to(tl.pointer_type(DST_DTYPE))
    numel = tl.load(row + 1)
    src = bucket_ptr + tl.load(row + 2)
    start = tl.load(row + 3)
    factor = scale
    if SCALE_IN_MEMORY:
        factor = tl.load(scale_ptr)
    for step in range(0, CHUNK, BLOCK):
        idx = start + step + tl.arange(0, BLOCK)
        mask = idx < numel
        x = tl.load(src + idx, mask=mask).to(tl.float32) * factor
        if ACCUMULATE:
            x += tl.load(dst + idx, mask=mask).to(tl.float32)
        tl.store(dst + idx, _cast(x, DST_DTYPE), mask=mask)


@triton.jit
def _offsets(i0, i1, i2, cols, s0, s1, s2, s3):
    # (BLOCK_R, BLOCK_C) element offsets of one operand from its four strides.
    return (i0 * s0 + i1 * s1 + i2 * s2)[:, None] + cols[None, :] * s3


@triton.jit
def strided_ew_kernel(
    out_ptr, x_ptr, r_ptr,  # r_ptr is ignored (pass any tensor) unless HAS_R
    scale,  # float32: multiplies x only
    ROWS, S1, S2, S3,  # index space (S0, S1, S2, S3); ROWS = S0 * S1 * S2
    so0, so1, so2, so3,  # strides of out
    sx0, sx1, sx2, sx3,  # strides of x
    sr0, sr1, sr2, sr3,  # strides of r
    HAS_R: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows (flattened dims 0-2) per tile: index math is per row
    BLOCK_C: tl.constexpr,  # columns (dim 3) per tile: unit-stride columns vectorize
):
    # out = round(float32(x) * scale + float32(r)), in that order.
    pid = tl.program_id(0)
    # A 1-d grid (a 2-d one caps columns at 65535 blocks). Not tl.cdiv: see the module docstring.
    col_blocks = (S3 + BLOCK_C - 1) // BLOCK_C
    rows = (pid // col_blocks).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % col_blocks).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    i2 = rows % S2
    i1 = (rows // S2) % S1
    i0 = rows // S2 // S1
    mask = (rows < ROWS)[:, None] & (cols < S3)[None, :]
    x = tl.load(x_ptr + _offsets(i0, i1, i2, cols, sx0, sx1, sx2, sx3), mask=mask)
    acc = x.to(tl.float32) * scale
    if HAS_R:
        acc += tl.load(r_ptr + _offsets(i0, i1, i2, cols, sr0, sr1, sr2, sr3), mask=mask).to(tl.float32)
    out = _cast(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + _offsets(i0, i1, i2, cols, so0, so1, so2, so3), out, mask=mask)
