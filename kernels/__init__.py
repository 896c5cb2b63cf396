"""Fused data movement around the runtime's collectives: Triton kernels with torch fallbacks.

    python -m pytest tests/kernels         # torch fallback + Triton interpreter tests (CPU)
    python benchmarks/kernel_fusion.py           # fused vs unfused bucket packing

Public functions (all take `impl="auto" | "triton" | "torch"`, see `_dispatch` for the rule:
Triton on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1, else torch):

- `pack(tensors, out=None, scale=1.0, dtype=None)`: gradients -> flat bucket, scaled and cast.
- `unpack(bucket, tensors, scale=1.0, accumulate=False)`: bucket -> tensors (or += into them).
- `chunk_to_leading(x, dim, parts)`: split `dim` into `parts` chunks laid out back to back,
  the send buffer of an all-to-all / reduce-scatter along `dim`.
- `leading_to_dim(buf, dim, parts, shape)`: the inverse, after an all-gather / all-to-all.

Each is called by `parallelize`'s training step: `pack` by the gradient sync (a bucket's gradients, cast to the
reduce dtype) and, under mixed precision, by the compute copies (float32 masters to bf16) and by a ZeRO
parameter's all-gather (its float32 shard to bf16); `unpack` by the gradient sync (a summed bucket into the
float32 gradients, cast and added); the layouts by the collectives of a split along a dim other than 0.

This package imports neither `autopar` nor (until a Triton path runs) `triton`.
"""

from kernels._dispatch import Impl, TritonUnavailableError, interpret_requested, triton_importable
from kernels.bucket import bucket_offsets, pack, unpack
from kernels.layout import chunk_to_leading, leading_to_dim

__all__ = [
    "Impl",
    "TritonUnavailableError",
    "bucket_offsets",
    "chunk_to_leading",
    "interpret_requested",
    "leading_to_dim",
    "pack",
    "triton_importable",
    "unpack",
]
