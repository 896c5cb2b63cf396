"""Gradient buckets: pack many tensors into one flat buffer and unpack it again.

What the Triton path fuses, and why: a runtime that all-reduces gradients in buckets does, per
gradient, a copy into the bucket, a cast (bf16/fp16 gradients into an fp32 bucket, or fp32
into a bf16 bucket to halve the traffic), a scale by 1/world size, and after the collective a
copy (or an add into an existing .grad) back out. Unfused, that is 2-4 kernel launches and
2-4 passes over memory per gradient, hundreds of launches per bucket. `pack` and `unpack` do
each direction in one pass and (per source dtype) one launch: a table of (address, numel,
bucket offset, chunk start) rows drives `multi_tensor_pack_kernel`, chunks keep the programs
balanced when one embedding gradient is 1000x bigger than a LayerNorm's.

Numerics (both paths, bit for bit): each element is float32(src) * float32(scale) rounded to
float32, then (when accumulating) + float32(dst) with no fused multiply-add, then rounded once,
to nearest even, to the destination dtype. float64 tensors take the torch path, in float64.
Neither function is differentiable.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kernels._dispatch import Impl, device_guard, triton_kernels, use_triton
from kernels._strided import launch_strided

_BLOCK = 1024  # elements per loop step of the multi-tensor kernels
_CHUNK = 8 * _BLOCK  # elements per program; a 25 MB fp32 bucket is ~800 programs

# Casts that lose nothing: copying first and scaling in the destination dtype rounds once.
_EXACT_CASTS = {
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.float64),
    (torch.float16, torch.float64), (torch.bfloat16, torch.float64),
}


def bucket_offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Start of each tensor in a packed bucket, plus the total as the last entry."""
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + t.numel())
    return offsets


def pack(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Lay `tensors` out back to back (each in row-major order) in a flat 1-D bucket, times
    `scale`, cast to the bucket's dtype. Returns `out` (which may be longer than needed: the
    tail, e.g. padding for a reduce-scatter, is left untouched) or a new bucket of exactly the
    total size in `dtype` (default: the promoted dtype of `tensors`)."""
    tensors = list(tensors)
    offsets = bucket_offsets(tensors)
    if out is None:
        if dtype is None:
            dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors), tensors[0].dtype) \
                if tensors else torch.float32
        device = tensors[0].device if tensors else torch.device("cpu")
        out = torch.empty(offsets[-1], dtype=dtype, device=device)
    elif dtype is not None and dtype != out.dtype:
        raise ValueError(f"pack: dtype={dtype} but out has dtype {out.dtype}; pass one or make them agree")
    _check_bucket(out, tensors, offsets[-1], "pack", "out")
    with torch.no_grad():
        if use_triton(impl, [out, *tensors], "pack"):
            _pack_triton(tensors, offsets, out, float(scale))
        else:
            _pack_torch(tensors, offsets, out, float(scale))
    return out


def unpack(
    bucket: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    scale: float | torch.Tensor = 1.0,
    accumulate: bool = False,
    *,
    impl: Impl = "auto",
) -> None:
    """Inverse of `pack`: tensor i = bucket slice i * scale (or += with `accumulate`, e.g. into
    an existing .grad), cast to each tensor's own dtype. Writes in place, any strides. `scale` may
    be a 0-d tensor (a mean's divisor still on the device): the kernel reads it (in float32, as a
    number's; float64 for a float64 bucket) where a Python float would make the host wait for the device."""
    tensors = list(tensors)
    offsets = bucket_offsets(tensors)
    _check_bucket(bucket, tensors, offsets[-1], "unpack", "bucket")
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0:
            raise ValueError(f"unpack: scale must be a number or a 0-d tensor, got shape {tuple(scale.shape)}")
        scale = scale.to(device=bucket.device, dtype=torch.promote_types(bucket.dtype, torch.float32))
    else:
        scale = float(scale)
    with torch.no_grad():
        if use_triton(impl, [bucket, *tensors], "unpack"):
            _unpack_triton(bucket, tensors, offsets, scale, accumulate)
        else:
            _unpack_torch(bucket, tensors, offsets, scale, accumulate)


def _check_bucket(bucket: torch.Tensor, tensors: list[torch.Tensor], total: int, op: str, name: str) -> None:
    if bucket.dim() != 1 or not bucket.is_contiguous():
        raise ValueError(f"{op}: {name} must be a contiguous 1-D tensor, got shape {tuple(bucket.shape)} "
                         f"with strides {bucket.stride()}")
    if bucket.numel() < total:
        raise ValueError(f"{op}: {name} holds {bucket.numel()} elements but the tensors need {total}")
    devices = {t.device for t in tensors} - {bucket.device}
    if devices:
        raise ValueError(f"{op}: {name} is on {bucket.device} but tensors are on {sorted(map(str, devices))}")


def _views(bucket: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    return [bucket[o:o + t.numel()].view(t.shape) for t, o in zip(tensors, offsets)]


def _is_one(scale: float | torch.Tensor) -> bool:
    """A scale known on the host to be 1 (a tensor's value is not read: that would wait for the device)."""
    return not isinstance(scale, torch.Tensor) and scale == 1.0


def _scaled(t: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """A new tensor float32(t) * scale (float64 stays float64), not yet rounded to a target."""
    compute = torch.promote_types(t.dtype, torch.float32)
    return t * scale if t.dtype == compute else t.to(compute).mul_(scale)


# ----- torch fallback: a few foreach ops, same numerics as the kernels -----

def _pack_torch(tensors: list[torch.Tensor], offsets: list[int], out: torch.Tensor, scale: float) -> None:
    if scale == 1.0 and tensors and all(t.dtype == out.dtype for t in tensors):
        # The common case (a gradient bucket in the grads' dtype): one cat, no slice-and-view of
        # `out` per tensor (measured on 28 GPT-2 grads: 0.07 ms against 0.20 ms for the views + copy).
        torch.cat([t.reshape(-1) for t in tensors], out=out[:offsets[-1]])
        return
    views = _views(out, tensors, offsets)
    exact = [i for i, t in enumerate(tensors) if t.dtype == out.dtype or (t.dtype, out.dtype) in _EXACT_CASTS]
    inexact = sorted(set(range(len(tensors))) - set(exact))
    if exact:
        torch._foreach_copy_([views[i] for i in exact], [tensors[i] for i in exact])
        if scale != 1.0:
            out[:offsets[-1]].mul_(scale)  # inexact slices get overwritten below
    for i in inexact:  # e.g. fp32 -> bf16 bucket: scale in fp32 first, so there is one rounding
        views[i].copy_(tensors[i] if scale == 1.0 else _scaled(tensors[i], scale))


def _unpack_torch(bucket: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int],
                  scale: float | torch.Tensor, accumulate: bool) -> None:
    if not tensors:
        return
    # Scale into a float32 copy first: add_(b, alpha=scale) of two bf16 tensors rounds twice.
    src = bucket if _is_one(scale) else _scaled(bucket[:offsets[-1]], scale)
    views = _views(src, tensors, offsets)
    if not accumulate:
        torch._foreach_copy_(tensors, views)
        return
    same = [i for i, t in enumerate(tensors) if t.dtype == src.dtype]
    if same:
        torch._foreach_add_([tensors[i] for i in same], [views[i] for i in same])
    for i in sorted(set(range(len(tensors))) - set(same)):
        # Mixed dtypes: add in the promoted dtype (rounding once), but convert with copy kernels
        # first: on CPU a mixed-dtype add_ takes torch's far slower scalar casting path.
        t, v = tensors[i], views[i]
        compute = torch.promote_types(t.dtype, v.dtype)
        if compute == t.dtype:
            t.add_(v.to(compute))
        else:
            t.copy_(t.to(compute).add_(v.to(compute)))


# ----- Triton path -----

@functools.lru_cache(maxsize=256)
def _chunk_table(rows: tuple[tuple[int, int, int], ...], device: torch.device) -> torch.Tensor:
    """(address, numel, bucket offset, chunk start) per _CHUNK of each tensor, on `device`.
    Cached: a training loop packs the same gradients at the same addresses every step."""
    meta = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
    counts = (meta[:, 1] + _CHUNK - 1) // _CHUNK  # an empty tensor has no chunk
    owner = torch.repeat_interleave(torch.arange(len(rows)), counts)
    first = torch.cumsum(counts, 0) - counts
    start = (torch.arange(int(counts.sum())) - first[owner]) * _CHUNK
    return torch.cat([meta[owner], start[:, None]], dim=1).to(device)


def _grouped(tensors: list[torch.Tensor], offsets: list[int]
             ) -> tuple[dict[torch.dtype, list[tuple[int, int, int]]], list[int]]:
    """Contiguous non-empty tensors grouped by dtype as table rows; indices of the strided rest."""
    groups: dict[torch.dtype, list[tuple[int, int, int]]] = {}
    strided: list[int] = []
    for i, (t, o) in enumerate(zip(tensors, offsets)):
        if t.numel() == 0:
            continue
        if t.is_contiguous():
            groups.setdefault(t.dtype, []).append((t.data_ptr(), t.numel(), o))
        else:
            strided.append(i)
    return groups, strided


def _pack_triton(tensors: list[torch.Tensor], offsets: list[int], out: torch.Tensor, scale: float) -> None:
    mod = triton_kernels()
    groups, strided = _grouped(tensors, offsets)
    for dtype, rows in groups.items():
        table = _chunk_table(tuple(rows), out.device)
        with device_guard(out.device):
            mod.multi_tensor_pack_kernel[(table.shape[0],)](
                table, out, scale, SRC_DTYPE=mod.TL_DTYPES[dtype], CHUNK=_CHUNK, BLOCK=_BLOCK,
                enable_fp_fusion=False)  # nothing to fuse; set so triton 3.9 does not warn
    for i in strided:  # rare for gradients (a transposed parameter): one strided launch each
        t = tensors[i]
        launch_strided(out[offsets[i]:offsets[i] + t.numel()].view(t.shape), t, scale=scale)


def _unpack_triton(bucket: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int],
                   scale: float | torch.Tensor, accumulate: bool) -> None:
    mod = triton_kernels()
    groups, strided = _grouped(tensors, offsets)
    in_memory = isinstance(scale, torch.Tensor)
    for dtype, rows in groups.items():
        table = _chunk_table(tuple(rows), bucket.device)
        with device_guard(bucket.device):
            mod.multi_tensor_unpack_kernel[(table.shape[0],)](
                table, bucket, 1.0 if in_memory else scale, scale if in_memory else bucket,
                DST_DTYPE=mod.TL_DTYPES[dtype], ACCUMULATE=accumulate, SCALE_IN_MEMORY=in_memory,
                CHUNK=_CHUNK, BLOCK=_BLOCK, enable_fp_fusion=False)  # no FMA: same bits as torch
    for i in strided:
        t = tensors[i]
        if in_memory:  # rare (a transposed gradient): the fallback's ops take the tensor scale as it is
            _unpack_torch(bucket[offsets[i]:offsets[i] + t.numel()], [t], [0, t.numel()], scale, accumulate)
            continue
        src = bucket[offsets[i]:offsets[i] + t.numel()].view(t.shape)
        launch_strided(t, src, scale=scale, r=t if accumulate else None)
