"""A loss whose all-reduce finishes in the background: the forward does not stop for it.

    loss = deferred_all_reduce(partial_loss, group)       # codegen emits this for the model's loss...
    loss = deferred_mean(loss_sum, token_count, group)     # ...or this, for a mean over a global count
    loss.backward()                                       # does not wait for the sum (a mean: its first op does)
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
kept tokens' losses / number of kept tokens over all ranks) would need a
second all-reduce for the count, waited in the forward. `deferred_mean` sends
(local sum, local count) as one two-element all-reduce instead; its backward
waits for it (the gradient of sum / count is grad / count) at its first step.
Every rank issues these collectives at the same point of its forward, so a
rank that reads the loss early (or never) cannot desynchronise the others.

Waiting for the count at the first step of backward stops every rank until the
slowest has finished its forward (measured: 3.7 ms of a 39 ms step on 4 CPU
ranks). Under `grads_scaled_by(taker)` (what `ParallelModule.forward` does) the
backward may instead pass on the gradient of the SUM and leave the division to
the taker (`GradSync`), which divides every gradient that backward gives the
module's parameters by the count once the all-reduce is waited at the end of
backward. The taker accepts only when that is exact (`GradSync.defer_scale`);
otherwise backward waits and divides here, as before. The module's other outputs
(a Hugging Face model's logits) are passed through `other_output`: gradient
entering there is multiplied by the count if the division was already taken
over, or else makes the taker leave the division in backward, whichever of the
two backward steps the engine runs first.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator, Protocol

import torch
from torch.utils import _pytree as pytree

from autopar.runtime import comm
from autopar.runtime.comm import Started

_aten = torch.ops.aten


class ScaleTaker(Protocol):
    """Who may take a mean loss's division by its count out of backward (`GradSync`)."""

    def loss_forward(self) -> None:
        """A mean loss that may defer its division was computed."""

    def defer_scale(self, pending: Started) -> bool:
        """Called at the loss's backward: True when the taker will divide every gradient this backward
        gives its parameters by the count in `pending.wait()[1]`; False: divide here."""

    def gradient_enters(self) -> torch.Tensor | None:
        """Called when gradient enters through another output of the module in this backward: the
        count to multiply it by if the division was taken over, else None (and it stays in backward)."""


_SCALE_TAKER: ContextVar[ScaleTaker | None] = ContextVar("autopar_scale_taker", default=None)


@contextlib.contextmanager
def grads_scaled_by(taker: ScaleTaker | None) -> Iterator[None]:
    """Mean losses computed inside offer their division by the count to `taker` (None: they keep it)."""
    token = _SCALE_TAKER.set(taker)
    try:
        yield
    finally:
        _SCALE_TAKER.reset(token)


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
    """(sum P, count P) -> sum / count R, one all-reduce started; backward waits for it (grad / count)
    or leaves the division to the `ScaleTaker` of the forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, total: torch.Tensor, count: torch.Tensor, group: str, replicas: int) -> DeferredSum:
        ctx.pending = _start_pair(total, count, group, replicas)
        ctx.dtype = total.dtype
        ctx.taker = _SCALE_TAKER.get()
        if ctx.taker is not None:
            ctx.taker.loss_forward()
        return DeferredSum(ctx.pending, total.detach(), lambda summed, dtype=total.dtype: _mean(summed, dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.taker is not None and ctx.taker.defer_scale(ctx.pending):
            return grad, None, None, None  # the gradient of the sum: the taker divides by the count
        count = ctx.pending.wait()[1].to(ctx.dtype)
        return grad / count, None, None, None


class _EntersScaled(torch.autograd.Function):
    """Identity on a module output other than the loss. Backward: the gradient entering there, times
    the global count when the division by it was taken over (the taker's division then restores it);
    otherwise unchanged, and the taker leaves the division in backward for the rest of this backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, taker: ScaleTaker) -> torch.Tensor:
        ctx.taker = taker
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        count = ctx.taker.gradient_enters()
        return (grad if count is None else grad * count.to(grad.dtype)), None


def other_output(x: torch.Tensor, taker: ScaleTaker) -> torch.Tensor:
    """`x`, an output of the module besides its loss, marked so that gradient entering through it in a
    backward whose division by the count was taken over is scaled back (see `_EntersScaled`). Without
    such gradient, which is every `loss.backward()`, the mark costs nothing in backward."""
    return _EntersScaled.apply(x, taker)


def deferred_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """P -> R whose result is waited when first read: the loss, returned without a synchronisation point.

    Without autograd (no grad mode, or `x` needs none) there is no backward to overlap with: a plain
    all-reduce, waited now, keeps eval loops simple."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return comm.all_reduce(x, group)
    return _DeferredAllReduce.apply(x, group)


def deferred_mean(total: torch.Tensor, count: torch.Tensor, group: str, replicas: int = 1) -> torch.Tensor:
    """sum(total) / sum(count) over `group` (total: a scalar Partial sum, count: the Partial number of
    its terms, no gradient), one all-reduce started now and waited when the value or its gradient is
    first needed. `replicas`: how many ranks of `group` hold each count term (the count is Partial over
    fewer axes than the sum, Replicate over the rest): each sends count / replicas."""
    if not (torch.is_grad_enabled() and total.requires_grad):
        return _mean(_start_pair(total, count, group, replicas).wait(), total.dtype)
    return _DeferredMean.apply(total, count, group, replicas)


def _start_pair(total: torch.Tensor, count: torch.Tensor, group: str, replicas: int) -> Started:
    """The all-reduce of (sum, count), started; float64 keeps both exact (float32 terms; counts to 2**53)."""
    pair = torch.stack([total.detach().to(torch.float64), count.detach().to(torch.float64) / replicas])
    return comm.all_reduce(pair, group, async_op=True)


def _mean(summed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (summed[0] / summed[1]).to(dtype)
