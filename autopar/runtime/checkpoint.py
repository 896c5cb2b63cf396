"""Activation checkpointing for the generated graph's recompute regions.

    y, = checkpointed(region, x, weight)         # region: an fx.GraphModule outlined by codegen
    y, = checkpointed_with_rng(region, x, p)     # the same, for a region that draws random numbers

Forward runs the region without recording autograd and keeps only its inputs;
backward runs it again, with autograd, and differentiates that run. A region's
inputs are everything it reads, parameters included (codegen passes them as
arguments), so their gradients leave through this function's backward into
the outer graph, where gradient accumulation and the gradient-sync hooks run
as for any other parameter use.

Why not `torch.utils.checkpoint`: its non-reentrant form, which codegen used
before, packs and unpacks every saved tensor through Python hooks in forward
and rebuilds through a holder in backward; its reentrant form accumulates
the region's gradients into leaf `.grad` fields (so `torch.autograd.grad`
cannot be taken through it) and saves device state per call. Measured on
gpt2-tiny's data-parallel plan with 4 regions (2 layers; one rank, one
thread, the step's CPU time over the plan without recompute, interleaved
runs): non-reentrant +2.9-3.2 ms, this +2.3-2.7 ms, of which 1.3 ms are the
recomputed ops themselves. The design is the reentrant one (a custom
autograd Function); what it adds is returning the gradients, and holding
no more memory in backward than torch's checkpoint (`_HandOver`).

A region that draws random numbers restores the default generators' states
captured before its forward (`rng.capture_states`), so the recompute draws
the same masks (`runtime.rng` seeds each random op from the default
generator). An autocast state is captured and restored the same way, as
torch's checkpoint does.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from autopar.runtime import rng

# Autocast's state is per thread and per device type, readable with no device present: asking
# `torch.cuda.is_available()` here instead would initialise CUDA at `import autopar`, before
# `run_ranks` forks its ranks (a forked child cannot use CUDA initialised in its parent).
_AUTOCAST_DEVICES = ("cpu", "cuda")


def checkpointed(region: fx.GraphModule, *args: Any) -> Any:
    """`region(*args)`, its activations rebuilt in backward rather than kept."""
    return _run(region, None, args)


def checkpointed_with_rng(region: fx.GraphModule, *args: Any) -> Any:
    """`checkpointed` for a region with random ops: backward's rebuild draws what forward drew."""
    return _run(region, rng.capture_states(tree_leaves(args)), args)


def _run(region: fx.GraphModule, rng_states: Any, args: tuple) -> Any:
    # autograd tracks tensors passed directly to a Function, not inside containers (a region may read a
    # split's list of pieces): flatten the inputs, and the outputs, whose structure only forward knows
    flat_args, in_spec = tree_flatten(args)
    out_spec: list = []
    handed: dict[int, torch.Tensor] = {}  # output index -> its gradient, from `_HandOver` to the region's backward
    flat_out = _Region.apply(region, in_spec, out_spec, handed, rng_states, *flat_args)
    flat_out = [_HandOver.apply(handed, i, out) if isinstance(out, torch.Tensor) and out.requires_grad else out
                for i, out in enumerate(flat_out)]
    return tree_unflatten(flat_out, out_spec[0])


class _HandOver(torch.autograd.Function):
    """Identity on a region's output. Its backward hands the output's gradient to the region's backward
    through `handed` and passes autograd a 4-byte stand-in of the same shape: the gradients a Function's
    backward receives stay referenced by autograd until that backward returns, so the region's would be
    held through the whole rebuild and nested backward (measured: llama-tiny's tightest plan simulated
    0.13 MB higher, one hidden-state gradient), where torch's checkpoint frees each after its first use."""

    @staticmethod
    def forward(ctx, handed, index, out):
        ctx.handed, ctx.index = handed, index
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.handed[ctx.index] = grad
        return None, None, grad.new_zeros(()).expand(grad.shape)


_FIXED_ARGS = 5  # region, in_spec, out_spec, handed, rng_states: the Function's inputs before the flattened ones

# region -> {which inputs require grad: which outputs do}. A Function's outputs all require grad when an
# input does, but a region may also return values a plain run computes without grad (a clone of a
# running statistic, a count): made to require grad, an op that may not differentiate them would
# raise. So the first call with a given pattern runs the region with autograd to learn which do.
_DIFFERENTIABLE: "weakref.WeakKeyDictionary[Any, dict[tuple[bool, ...], tuple[bool, ...]]]" = weakref.WeakKeyDictionary()


class _Region(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region, in_spec, out_spec, handed, rng_states, *flat_args):
        ctx.set_materialize_grads(False)  # an output nothing differentiates gets None, not a zero tensor
        ctx.region, ctx.in_spec, ctx.handed, ctx.rng_states = region, in_spec, handed, rng_states
        ctx.autocast = [(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                        for device in _AUTOCAST_DEVICES]
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in flat_args]
        ctx.save_for_backward(*(a for a in flat_args if isinstance(a, torch.Tensor)))
        ctx.others = [a for a in flat_args if not isinstance(a, torch.Tensor)]
        wants_grad = ctx.needs_input_grad[_FIXED_ARGS:]
        known = _DIFFERENTIABLE.setdefault(region, {})
        if wants_grad in known:
            flat_out, spec = tree_flatten(region(*tree_unflatten(list(flat_args), in_spec)))
        else:
            with torch.enable_grad():
                probe = [a.detach().requires_grad_(wants) if isinstance(a, torch.Tensor) else a
                         for a, wants in zip(flat_args, wants_grad)]
                flat_out, spec = tree_flatten(region(*tree_unflatten(probe, in_spec)))
            known[wants_grad] = tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in flat_out)
            flat_out = [o.detach() if isinstance(o, torch.Tensor) else o for o in flat_out]
        ctx.mark_non_differentiable(*(o for o, differentiable in zip(flat_out, known[wants_grad])
                                      if isinstance(o, torch.Tensor) and not differentiable))
        out_spec.append(spec)
        return tuple(flat_out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *stand_ins):
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        wants_grad = ctx.needs_input_grad[_FIXED_ARGS:]
        inputs = [next(tensors).detach().requires_grad_(wants) if is_tensor else next(others)
                  for is_tensor, wants in zip(ctx.is_tensor, wants_grad)]
        with contextlib.ExitStack() as stack:
            if ctx.rng_states is not None:
                stack.enter_context(rng.replay_states(ctx.rng_states))
            for device, enabled, dtype in ctx.autocast:
                if (enabled, dtype) != (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)):
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            outputs = tree_leaves(ctx.region(*tree_unflatten(inputs, ctx.in_spec)))
            # differentiate sum_i <output_i, grad_i>: a scalar root, so the output gradients are held only by
            # the dot products' backward, which frees each after its first use (as torch's checkpoint does);
            # a dot, not (out * grad).sum(), which would make an output-sized product first. For a complex
            # output the product whose gradient is backward's is Re(sum(conj(grad) * out)): `vdot`, real part
            grads_out = [ctx.handed.pop(i, None) for i in range(len(outputs))]
            products = [torch.vdot(grad.reshape(-1), out.reshape(-1)).real for out, grad in zip(outputs, grads_out)
                        if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad]
            root = sum(products[1:], products[0]) if products else None  # `sum`: outputs may differ in dtype
            del grads_out, products
        # differentiating needs the outputs' autograd nodes, not their values: free those now (measured on
        # bert-tiny's tightest plan, holding them through the backward raised the step's peak by 12%)
        del outputs
        wanted = [x for x, wants in zip(inputs, wants_grad) if wants]
        grads = iter(torch.autograd.grad(root, wanted, allow_unused=True) if root is not None and wanted
                     else [None] * len(wanted))
        return (None,) * _FIXED_ARGS + tuple(next(grads) if wants else None for wants in wants_grad)
