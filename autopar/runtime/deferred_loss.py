"""A loss whose all-reduce finishes in the background: the forward does not stop for it.

    loss = deferred_all_reduce(partial_loss, group)       # codegen emits this for the model's loss...
    count = start_count(token_count, group)               # ...or, for a mean over a global count, this
    loss = deferred_mean(loss_sum, count, group)          #    early in the forward, and this at its end
    loss.backward()                                       # does not wait for the sum
    loss.item()                                           # waits here (or during backward) for the global value

The generated graph computes each rank's term of the global loss (Partial) and
must return the sum (Replicate). A blocking all-reduce there makes every rank
wait for the slowest at the end of the forward: a synchronisation point DDP
does not have (it returns each rank's local loss). Yet backward never needs the
sum: the gradient of a sum with respect to each term is the output gradient
itself. So the loss is returned as a `DeferredSum`, a tensor subclass that
holds the in-flight all-reduce and
- seeds backward without waiting: `loss.backward()` asks for `ones_like(loss)`,
  which needs only the shape (torch's `AsyncCollectiveTensor` would wait here);
- waits on first use of its value (`item()`, printing, arithmetic, `detach()`:
  every other op), then behaves as the plain summed tensor;
- is waited at the latest when its backward's graph task ends (an autograd
  engine callback), so no collective is left in flight across steps.

A mean over a global count (cross-entropy with ignored labels: sum of the
kept tokens' losses / number of kept tokens over all ranks) needs the global
count in backward: the gradient of sum / count is grad / count. The count
depends on the labels alone, so codegen starts its all-reduce (`start_count`)
together with the ops computing it right after the labels' placeholder
(`codegen.schedule`): it runs in the background during the forward and has
finished, on every rank, long before backward reads it. `deferred_mean` then
sends only the local sum, deferred like any loss, and its backward divides the
scalar gradient by the count, which costs nothing. Two earlier designs cost
more: sent at the end of the forward with the sum, the count made the first
step of backward wait for the slowest rank's forward (3.7 ms of a 39 ms step on
4 CPU ranks); leaving the division to the gradient sync instead took a pass
over every gradient (1.7% of a one-rank GPT-2 step). A count computed from
activations is started where it is computed, and backward may wait for it.
Every rank issues these collectives at the same point of its forward, so a
rank that reads the loss early (or never) cannot desynchronise the others.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils import _pytree as pytree

from autopar.runtime import comm
from autopar.runtime.comm import Started

_aten = torch.ops.aten


class DeferredSum(torch.Tensor):
    """A Replicate value whose all-reduce may still be in flight; any use of its value waits for it."""

    _pending: Started  # the all-reduce, shared with the autograd node (no cycle: a loss dropped without backward frees its graph)
    _finish: Callable[[torch.Tensor], torch.Tensor] | None  # summed buffer -> value (None: the buffer itself)

    @staticmethod
    def __new__(cls, pending: Started, like: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor] | None = None):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    def __init__(self, pending: Started, like: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self._pending, self._like, self._finish = pending, like, finish

    def value(self) -> torch.Tensor:
        """The global value (a plain tensor), waiting for the all-reduce the first time."""
        summed = self._pending.wait()
        return summed if self._finish is None else self._finish(summed)

    def __repr__(self) -> str:  # printing reads the value
        return f"DeferredSum({self.value()!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SHAPE_ONLY:
            # autograd's seed for loss.backward(): only shape, dtype and device are read, never the data
            self, *rest = args
            return func(self._like, *rest, **kwargs)
        args, kwargs = pytree.tree_map_only(DeferredSum, DeferredSum.value, (args, kwargs))
        return func(*args, **kwargs)


_SHAPE_ONLY = (_aten.ones_like.default, _aten.zeros_like.default, _aten.empty_like.default)


class _DeferredAllReduce(torch.autograd.Function):
    """P -> R started, not waited; backward: identity (and the sum is waited when backward ends)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: str) -> DeferredSum:
        ctx.pending = comm.all_reduce(x, group, async_op=True)
        return DeferredSum(ctx.pending, x.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.pending.wait)
        return grad, None


class _DeferredMean(torch.autograd.Function):
    """sum P -> sum / count R, the sum's all-reduce started, not waited; backward: grad / count."""

    @staticmethod
    def forward(ctx, total: torch.Tensor, count: Started, group: str) -> DeferredSum:
        dtype = total.dtype
        ctx.pending, ctx.count, ctx.dtype = _start_sum(total, group), count, dtype
        return DeferredSum(ctx.pending, total.detach(), lambda summed: _mean(summed, count, dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.pending.wait)
        return grad / ctx.count.wait().to(ctx.dtype), None, None


def deferred_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """P -> R whose result is waited when first read: the loss, returned without a synchronisation point.

    Without autograd (no grad mode, or `x` needs none) there is no backward to overlap with: a plain
    all-reduce, waited now, keeps eval loops simple."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return comm.all_reduce(x, group)
    return _DeferredAllReduce.apply(x, group)


def start_count(count: torch.Tensor, group: str, replicas: int = 1) -> Started:
    """The global number of a mean's terms: `count` (Partial, no gradient) summed over `group`, started
    now, in float64 (exact to 2**53). `replicas`: how many ranks of `group` hold each count term (the
    count is Partial over fewer axes than the mean's sum, Replicate over the rest): each sends count / replicas."""
    return comm.all_reduce(count.detach().to(torch.float64) / replicas, group, async_op=True)


def deferred_mean(total: torch.Tensor, count: Started, group: str) -> torch.Tensor:
    """sum(total) / global count over `group` (total: a scalar Partial sum; count: `start_count`'s), the
    sum's all-reduce started now and waited when the value is first read."""
    if not (torch.is_grad_enabled() and total.requires_grad):
        return _mean(_start_sum(total, group).wait(), count, total.dtype)
    return _DeferredMean.apply(total, count, group)


def _start_sum(total: torch.Tensor, group: str) -> Started:
    return comm.all_reduce(total.detach().to(torch.float64), group, async_op=True)  # float64: the terms add exactly


def _mean(summed: torch.Tensor, count: Started, dtype: torch.dtype) -> torch.Tensor:
    return (summed / count.wait()).to(dtype)
