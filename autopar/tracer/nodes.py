"""Small helpers over fx nodes that every later stage agrees on.

The solver's strategies, the profiler and codegen all need "the tensor
arguments of a node, in a fixed order"; defining that order once here keeps
the stages consistent (a strategy's `input_specs[i]` is about
`tensor_args(node)[i]`).
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree


def is_tensor_node(arg: object) -> bool:
    return isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)


def call_like(graph: fx.Graph, like: fx.Node, target: Callable, *args: object, **kwargs: object) -> fx.Node:
    """A call of `target` at `graph`'s insertion point carrying `like`'s metadata (its module stack and source
    line, for reports and errors) and its own value computed on the fake tensors of its arguments, as the
    nodes export makes carry theirs: for a pass that rewrites one traced op as others."""
    new = graph.call_function(target, args, kwargs)
    new.meta = {k: v for k, v in like.meta.items() if k != "val"}
    vals = pytree.tree_map_only(fx.Node, lambda a: a.meta["val"], (args, kwargs))
    with detect_fake_mode(pytree.tree_leaves(vals)):
        new.meta["val"] = target(*vals[0], **vals[1])
    return new


def tensor_args(node: fx.Node) -> tuple[fx.Node, ...]:
    """The fx.Node arguments of `node` that carry tensors, flattened in args-then-kwargs order.

    A node used twice as an argument appears twice (each use may want its own spec).
    """
    flat, _ = pytree.tree_flatten((node.args, node.kwargs))
    return tuple(a for a in flat if is_tensor_node(a))


def output_vals(node: fx.Node) -> tuple[torch.Tensor | None, ...]:
    """The fake tensors a node produces: one for single-output ops, one per element for tuple outputs."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (val,)
    if isinstance(val, (tuple, list)):
        return tuple(v if isinstance(v, torch.Tensor) else None for v in val)
    return ()


def module_path(node: fx.Node) -> str:
    """The innermost module path that produced `node` ('' for top-level code)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return fqn(path)


def fqn(stack_path: str) -> str:
    """A path of `nn_module_stack` in FQN style: export records "L['self'].transformer.h[0].attn" in some versions."""
    path = stack_path.replace("L['self'].", "").replace("L['self']", "")
    return path.replace("[", ".").replace("]", "")


def is_dropout_clone(node: fx.Node) -> bool:
    """A `clone` export writes for an `nn.Dropout` that does nothing (p=0, or eval): eager returns the input."""
    stack = node.meta.get("nn_module_stack") or {}
    return node.target is torch.ops.aten.clone.default and bool(stack) and "Dropout" in str(list(stack.values())[-1][1])


def differentiable(t: object) -> bool:
    """Whether `t` is a tensor of a dtype autograd differentiates: floating point or complex (an FFT's
    output carries its input's gradient; integers and bools carry none)."""
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def is_differentiable(node: fx.Node) -> bool:
    """Whether `node`'s value can carry a gradient (`differentiable`)."""
    return differentiable(node.meta.get("val"))


def grad_carrying(graph: fx.Graph, no_grad: set[str], targs: Callable[[fx.Node], tuple[fx.Node, ...]] = tensor_args) -> set[str]:
    """Names of nodes whose value can carry a gradient: values of a differentiable dtype (`differentiable`)
    computed from such a parameter or user input, but for the placeholders in `no_grad` (buffers, frozen
    parameters). Others (integer tensors, `arange`, a float count of labels, constants) get no grad all-reduce."""
    out: set[str] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name not in no_grad and is_differentiable(node):
                out.add(node.name)
        elif node.op == "call_function":
            val = node.meta.get("val")
            # a tuple's elements are checked at their getitem
            differentiates = is_differentiable(node) or isinstance(val, (tuple, list))
            ins = (node.args[0],) if node.target is operator.getitem else targs(node)  # tensor_args skips tuple producers
            if differentiates and any(a.name in out for a in ins):
                out.add(node.name)
    return out
