"""What the model's forward asks of backward beyond its ops: checked at trace time.

The traced graph holds the forward's ops, and autograd differentiates them. Two things a forward can
add are not ops. A gradient hook registered on a tensor inside the forward (`z.register_hook(...)`)
has no place in the graph: it is refused, naming the line. And a `torch.autograd.Function` of the
user's with a backward of its own is traced as its forward:

torch.export records what a Function's forward computes, not its backward: the
traced graph differentiates the forward's ops instead. For a Function whose
backward is the forward's derivative (Bloom's fused GELU) that is the same
gradient. For one whose backward is not (a gradient reversal layer, a
straight-through estimator or a clipped gradient written as a Function) the
parallel module would train with other gradients than the model, silently.

So while the model is traced every Function defined outside torch that is
applied to a tensor needing a gradient is recorded (`recorded`), and then
checked (`check`) with torch's `gradcheck` on random float64 inputs of the
recorded shapes (leading dims cut to 2 for a large tensor; its fast mode
compares one random projection of the backward with finite differences of
the forward). A Function whose backward differs is refused, naming it, the line, the difference and how to write the
same gradient with `.detach()`, which the graph keeps (`tracer/no_grad.py`).
One the check cannot run (its forward rejects the probe's inputs) is traced
as its forward, with a warning. torch's own Functions are not checked, and
reentrant activation checkpointing (a Function that runs its function under
no_grad and again in backward) is traced as the function itself, inline, as
the non-reentrant kind is: autopar's plan picks its own recompute.

Autograd runs every Function's forward with grad off and turns it back on in
C++, where export does not see it: a no_grad block inside a forward (reentrant
checkpointing's) then seemed to last to the end of the model, and
`tracer/no_grad.py` cut every later layer off from its gradient. The recording
wrapper sets the grad mode back in Python, which export does see.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.utils.checkpoint
from torch.autograd.gradcheck import GradcheckError

from autopar.errors import TraceError
from autopar.tracer.source_lines import calling_line, in_library

log = logging.getLogger(__name__)

FIX = ("write the gradient with `.detach()`, which the traced graph keeps: a straight-through estimator as "
       "`x + (f(x) - x).detach()`, a gradient scaled by -k (gradient reversal) as `(1 + k) * x.detach() - k * x`")
FORWARD_GRADIENT_FIX = ("autopar plans a training step whose backward differentiates the forward's ops once; a gradient "
                        "taken inside the forward (a gradient penalty, a physics-informed residual) needs a second "
                        "backward through the plan's collectives, which it does not build. Train this model with "
                        "torch's DDP or FSDP, or leave the term out")
HOOK_FIX = ("scale a gradient with `.detach()`, which the traced graph keeps: `k * z + (1 - k) * z.detach()` has "
            "z's value and k times its gradient; or register the hook on the parallel module's outputs")
_PROBE_NUMEL = 1 << 20  # elements per probe input; a larger one keeps only its last dim whole


@dataclass(frozen=True)
class Applied:
    """One application of a user's Function while tracing: what to probe it with, and where."""

    function: type | None  # None: a gradient hook registered on a tensor
    args: tuple  # each tensor as a `_TensorMeta`; other values as they were
    line: str


@dataclass(frozen=True)
class _TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@contextlib.contextmanager
def recorded(model_name: str) -> Iterator[list[Applied]]:
    """Inside, every user-defined Function applied to a tensor that needs a gradient is recorded, and so is
    every gradient hook registered on a tensor (as an `Applied` whose function is None). A gradient the
    model's code takes (`torch.autograd.grad`) raises TraceError at once: export cannot capture it."""
    found: list[Applied] = []
    original_apply = torch.autograd.Function.__dict__["apply"]
    original_hook = torch.Tensor.register_hook
    original_grad = torch.autograd.grad

    def apply(cls, *args, **kwargs):
        if cls is torch.utils.checkpoint.CheckpointFunction:
            # reentrant activation checkpointing: its forward runs the function under no_grad and its
            # backward runs it again with grad, so the function's own ops are the derivative. Traced
            # inline (autopar's plan picks its own recompute), it is one ordinary region of the graph.
            run_function, _preserve_rng_state, *inputs = args
            return run_function(*inputs)
        if not cls.__module__.startswith("torch.") and not kwargs and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            found.append(Applied(cls, tuple(_meta(a) for a in args), calling_line()))
        enabled = torch.is_grad_enabled()
        try:
            return original_apply.__func__(cls, *args, **kwargs)
        finally:
            # autograd runs a Function's forward with grad off and turns it back on in C++, which export
            # does not see: a no_grad block inside the forward then seemed to last to the end of the model
            torch.set_grad_enabled(enabled)

    def register_hook(tensor, hook):
        if not in_library(sys._getframe(1).f_code.co_filename):  # the model's own hook, not torch's
            found.append(Applied(None, (), calling_line()))
        return original_hook(tensor, hook)

    def grad(*args, **kwargs):
        if not in_library(sys._getframe(1).f_code.co_filename):
            raise TraceError(f"cannot trace {model_name}: torch.autograd.grad is called in the forward at "
                             f"{calling_line()}\n  fix: {FORWARD_GRADIENT_FIX}")
        return original_grad(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    torch.Tensor.register_hook = register_hook
    torch.autograd.grad = grad
    try:
        yield found
    finally:
        torch.autograd.Function.apply = original_apply
        torch.Tensor.register_hook = original_hook
        torch.autograd.grad = original_grad


def check(found: list[Applied], model_name: str) -> None:
    """Raise TraceError for a gradient hook registered in the forward, or for the first Function whose
    backward is not its forward's derivative."""
    for applied in found:
        if applied.function is None:
            raise TraceError(f"cannot trace {model_name}: a gradient hook is registered in the forward at "
                             f"{applied.line}, and the traced graph has no place for it\n  fix: {HOOK_FIX}")
    checked: set[type] = set()
    for applied in found:
        if applied.function in checked:
            continue
        checked.add(applied.function)
        name = applied.function.__qualname__
        try:
            mismatch = _mismatch(applied)
        except Exception as err:  # the probe's inputs did not suit the forward: nothing measured
            log.warning("tracer: could not check the backward of `%s` (%s: %s) at %s; its gradients are those "
                        "of its forward's ops", name, type(err).__name__, err, applied.line)
            continue
        if mismatch is not None:
            raise TraceError(
                f"cannot trace {model_name}: `{name}`, an autograd.Function, at {applied.line} has a backward that "
                f"is not the derivative of its forward (torch.autograd.gradcheck on random inputs: {mismatch}), "
                f"and the traced graph keeps only the forward\n  fix: {FIX}")


def _mismatch(applied: Applied) -> str | None:
    """What torch's `gradcheck` finds wrong with the Function's backward on random float64 inputs of the
    recorded shapes (its fast mode: one random projection of the Jacobian, checked against finite
    differences of the forward), or None when the backward is the forward's derivative."""
    generator = torch.Generator().manual_seed(0)
    inputs = [_probe(a, generator) for a in applied.args]
    try:
        torch.autograd.gradcheck(applied.function.apply, inputs, fast_mode=True, check_undefined_grad=False)
    except GradcheckError as err:
        return str(err).strip().splitlines()[0].rstrip(",")
    return None


def _meta(a: Any) -> Any:
    if not isinstance(a, torch.Tensor):
        return a
    shape = tuple(s if isinstance(s, int) else (s.node.hint or 2) for s in a.shape)  # a symbolic size: its hint
    return _TensorMeta(shape, a.dtype, a.requires_grad)


def _probe(a: Any, generator: torch.Generator) -> Any:
    if not isinstance(a, _TensorMeta):
        return a
    shape = a.shape
    if math.prod(shape) > _PROBE_NUMEL:
        shape = tuple(min(n, 2) for n in shape[:-1]) + shape[-1:]
    if not a.dtype.is_floating_point:
        return torch.zeros(shape, dtype=a.dtype)
    return torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_(a.requires_grad)
