"""Cross-entropy over a vocabulary split across ranks (Megatron's vocabulary-parallel loss).

When the language-model head is column parallel, each rank holds the logits of
one block of the vocabulary. Gathering them to compute the loss would move the
largest activation of the model; instead each rank keeps its block and the
ranks exchange one number per row:

    log_softmax(x)_i = x_i - m - log(sum_j exp(x_j - m)),   m = max_j x_j

where m (only a shift for range: the result does not depend on it) is an
all-reduce max and the sum of exponentials an all-reduce sum, both over every
mesh axis that splits the vocabulary. The backward of log-softmax,
dx = g - softmax(x) * sum_j g_j, needs one more all-reduce sum per row.

The label lookup that follows (`gather` of the target's log-probability) is a
masked gather: the rank holding the label's column contributes it, the others
zero (see `autopar.solver.strategies.localize.masked_gather`), so the looked-up
values are a Partial sum and the loss stays exact with ignored labels.

Gradient conventions are `autopar.runtime.collectives`': the incoming grad of
the output is this rank's block of the complete gradient, and so is the grad
returned for the input.
"""
from __future__ import annotations

from typing import Sequence

import torch

from autopar.runtime.collectives import all_reduce, all_reduce_max


class _VocabParallelLogSoftmax(torch.autograd.Function):
    """One function for forward and backward (autograd does not record inside either), so
    backward keeps only the output, as native log_softmax does, and runs one all-reduce."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, groups: tuple[str, ...]) -> torch.Tensor:
        row_max = x.amax(dim, keepdim=True)
        for g in groups:
            row_max = all_reduce_max(row_max, g)
        sum_exp = torch.exp(x - row_max).sum(dim, keepdim=True)
        for g in groups:
            sum_exp = all_reduce(sum_exp, g)
        out = x - row_max - torch.log(sum_exp)
        ctx.dim, ctx.groups = dim, groups
        ctx.save_for_backward(out)  # what native log_softmax keeps too
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        grad_sum = grad.sum(ctx.dim, keepdim=True)
        for g in ctx.groups:
            grad_sum = all_reduce(grad_sum, g)
        return grad - torch.exp(out) * grad_sum, None, None


def vocab_parallel_log_softmax(x: torch.Tensor, dim: int, half_to_float: bool, groups: Sequence[str]) -> torch.Tensor:
    """`aten._log_softmax(x, dim, half_to_float)` of a tensor whose `dim` is split over the mesh axes
    named by `groups` (c10d group names); returns this rank's block of the result."""
    if half_to_float:
        x = x.float()
    return _VocabParallelLogSoftmax.apply(x, dim % x.ndim, tuple(groups))
