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
kept tokens' losses / number of kept tokens over all ranks) divides its
gradient by the global count. The count depends on the labels alone, so codegen
starts its all-reduce (`start_count`) together with the ops computing it right
after the labels' placeholder (`codegen.schedule`); `deferred_mean` then sends
only the local sum, deferred like any loss. Every rank issues these
collectives at the same point of its forward, so a rank that reads the loss
early (or never) cannot desynchronise the others.

Where the division happens. Backward's first step could divide the scalar
gradient by the count, but waiting for the count there stops every rank in
the middle of its step until all have computed it: on 4 CPU ranks sharing 2
cores that one wait cost 5% of a GPT-2 step (measured against DDP with the
same small collective waited there, and waited at the end of backward
instead: no cost). So under `grads_scaled_by(taker)` (what
`ParallelModule.forward` does) backward passes on the gradient of the SUM and
the taker (`GradSync`) divides every gradient this backward gives the module's
parameters by the count once backward ends, where it waits for its buckets
anyway. The taker accepts only when that is exact (`GradSync.defer_scale`);
otherwise backward divides here. The module's other outputs (a Hugging Face
model's logits) pass through `other_output`: gradient entering there is
multiplied by the count if the division was already taken over, or else makes
the taker leave the division in backward, whichever of the two backward steps
the engine runs first. Two designs came before: sending the count with the sum
at the end of the forward made backward's first step wait for the slowest
rank's whole forward (3.7 ms of a 39 ms step on 4 CPU ranks), and a division
in backward with the count started early still waited mid-step (above).
"""
from __future__ import annotations

import contextlib
import functools
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

    def defer_scale(self, count: Started) -> bool:
        """Called at the loss's backward: True when the taker will divide every gradient this backward
        gives its parameters by `count.wait()`; False: divide here."""

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
        ctx.pending = _start_sum(x, group)
        return DeferredSum(ctx.pending, x.detach(), functools.partial(torch.Tensor.to, dtype=x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.pending.wait)
        return grad, None


class _DeferredMean(torch.autograd.Function):
    """sum P -> sum / count R, the sum's all-reduce started, not waited; backward: grad / count, or the
    gradient of the sum when the forward's `ScaleTaker` divides later (see the module docstring)."""

    @staticmethod
    def forward(ctx, total: torch.Tensor, count: Started, group: str) -> DeferredSum:
        dtype = total.dtype
        ctx.pending, ctx.count, ctx.dtype = _start_sum(total, group), count, dtype
        ctx.taker = _SCALE_TAKER.get()
        if ctx.taker is not None:
            ctx.taker.loss_forward()
        return DeferredSum(ctx.pending, total.detach(), lambda summed: _mean(summed, count, dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.pending.wait)
        if ctx.taker is not None and ctx.taker.defer_scale(ctx.count):
            return grad, None, None  # the gradient of the sum: the taker divides by the count
        return grad / ctx.count.wait().to(ctx.dtype), None, None


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
    Summed in float64, as every loss collective here (exact terms; and a rank that has joined torch's
    `Join` shadows each as a 0-d float64 all-reduce, whatever the loss's dtype: `runtime.join`).

    Without autograd (no grad mode, or `x` needs none) there is no backward to overlap with: a plain
    all-reduce, waited now, keeps eval loops simple."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _start_sum(x, group).wait().to(x.dtype)
    return _DeferredAllReduce.apply(x, group)


def start_count(count: torch.Tensor, group: str, replicas: int = 1) -> Started:
    """The global number of a mean's terms: `count` (Partial, no gradient) summed over `group`, started
    now, in float64 (exact to 2**53). `replicas`: how many ranks of `group` hold each count term (the
    count is Partial over fewer axes than the mean's sum, Replicate over the rest): each sends count / replicas."""
    terms = count.detach().to(torch.float64, memory_format=torch.contiguous_format, copy=True)  # summed in place
    if replicas != 1:
        terms.div_(replicas)
    return comm.start_sum(terms, group)


def deferred_mean(total: torch.Tensor, count: Started, group: str) -> torch.Tensor:
    """sum(total) / global count over `group` (total: a scalar Partial sum; count: `start_count`'s), the
    sum's all-reduce started now and waited when the value is first read."""
    if not (torch.is_grad_enabled() and total.requires_grad):
        return _mean(_start_sum(total, group).wait(), count, total.dtype)
    return _DeferredMean.apply(total, count, group)


def _start_sum(total: torch.Tensor, group: str) -> Started:
    # float64: the terms add exactly; a dense copy of its own, summed in place
    return comm.start_sum(total.detach().to(torch.float64, memory_format=torch.contiguous_format, copy=True), group)


def _mean(summed: torch.Tensor, count: Started, dtype: torch.dtype) -> torch.Tensor:
    return (summed / count.wait()).to(dtype)
