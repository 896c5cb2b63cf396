"""Training-mode batch norm over a batch split across ranks: statistics of the global batch.

Splitting a batch-norm layer's batch (or spatial) dims over ranks changes what it
computes unless the per-channel mean and variance are those of the whole batch;
that is what `nn.SyncBatchNorm` does for DDP, and what makes the split plan train
exactly like the single-device model. Per channel, over the N elements of the
global batch:

    mean = all_reduce(sum x) / N
    var  = all_reduce(sum (x - mean)^2) / N          (two passes: exact in float32)
    out  = (x - mean) / sqrt(var + eps) * weight + bias
    running_mean <- (1 - momentum) running_mean + momentum mean
    running_var  <- (1 - momentum) running_var  + momentum var N / (N - 1)

Written with autograd-aware collectives (`autopar.runtime.collectives`): each
statistic is all-reduced (P -> R) and then marked as feeding a computation split
over the same ranks, so its gradient, to which every rank's rows contribute, is
all-reduced in backward. Autograd then derives the synchronised backward; the
plain-torch formulation replaces `nn.SyncBatchNorm`'s CUDA-only kernels.
"""
from __future__ import annotations

from typing import Sequence

import torch

from autopar.runtime.collectives import all_reduce, grad_all_reduce


def _global_sum(x: torch.Tensor, groups: Sequence[str]) -> torch.Tensor:
    for g in groups:
        x = all_reduce(x, g)
    for g in groups:
        x = grad_all_reduce(x, g)
    return x


def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float, eps: float,
                    count: int, groups: Sequence[str]) -> tuple[torch.Tensor, ...]:
    """`aten._native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, True, momentum, eps)`
    for an `x` whose non-channel dims are split over the mesh axes named by `groups`; `count` is the
    number of elements per channel in the global batch. Returns (out, mean, rstd, new running mean,
    new running var), as the ATen op does: a bf16 or fp16 `x` (mixed precision) has its statistics computed in
    float32 and its output in its own dtype, as the ATen op's mixed-type kernels do."""
    dims = [d for d in range(x.ndim) if d != 1]
    per_channel = [1, -1] + [1] * (x.ndim - 2)
    given = x.dtype
    x = x.to(torch.promote_types(given, torch.float32))  # (x itself when float32 or float64)
    mean = _global_sum(x.sum(dims), groups) / count
    centered = x - mean.view(per_channel)
    var = _global_sum((centered * centered).sum(dims), groups) / count
    rstd = torch.rsqrt(var + eps)
    out = centered * rstd.view(per_channel)
    if weight is not None:
        out = out * weight.view(per_channel)
    if bias is not None:
        out = out + bias.view(per_channel)
    with torch.no_grad():
        new_mean = running_mean * (1 - momentum) + mean * momentum
        new_var = running_var * (1 - momentum) + var * (momentum * count / max(count - 1, 1))
    return out.to(given), mean.detach(), rstd.detach(), new_mean, new_var
