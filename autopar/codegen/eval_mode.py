"""Eval mode as the training graph with dropout off, where that is all eval mode changes.

A plan is solved for the model's training forward, and `ParallelModule` runs that graph.
In eval mode (`pm.eval()`) most transformers compute the same ops but for dropout
(`nn.Dropout`, attention's `dropout_p`); BatchNorm (running statistics rather than the
batch's), stochastic depth and other `if self.training:` branches compute something else.
So eval mode lowers the training graph with its dropout turned off (`without_dropout`)
when `eval_difference` finds, op by op, nothing else in the model's own eval-mode trace;
otherwise the eval graph runs under a plan of its own that keeps the parameters where the
training plan stores them (`solver.pinned.solve_keeping_params`).
"""
from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any

import torch
from torch import fx

from autopar.tracer import TracedGraph
from autopar.tracer.nodes import is_dropout_clone, module_path

aten = torch.ops.aten
# Schema arguments that switch dropout on in an op (`native_dropout`'s train, attention's dropout_p)
# and their values with dropout off.
_DROPOUT_OFF = {"train": False, "dropout_p": 0.0}
# Ops whose second argument is the output's size, which a -1 may stand in for.
_SIZED = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default}


def without_dropout(traced: TracedGraph) -> TracedGraph:
    """A copy of `traced` whose ops drop nothing; node names, and so the plan's decisions, unchanged."""
    graph = copy.deepcopy(traced.gm.graph)
    for node in graph.nodes:
        if node.op == "call_function":
            node.args, node.kwargs = _dropout_off(node)
    gm = fx.GraphModule(traced.gm, graph)
    return dataclasses.replace(traced, gm=gm)


def eval_difference(train: TracedGraph, evaluated: TracedGraph) -> str | None:
    """None when `evaluated` (the model traced in eval mode) computes what `train`'s graph computes with
    dropout off: the same ops on the same inputs, in the same order, once every dropout (a
    `native_dropout`'s output in training, the `clone` export writes for it in eval) and every
    contiguous copy is read as its input. Else the first op that differs, and where."""
    ours, theirs = _ops_without_dropout(train.graph), _ops_without_dropout(evaluated.graph)
    position = next((i for i, ((_, a), (_, b)) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    if position == len(ours) == len(theirs):
        return None
    if position >= len(theirs):
        return "fewer ops"
    node = theirs[position][0]
    return f"{node.target} in {module_path(node) or 'the top-level forward'}"


def _dropout_off(node: fx.Node) -> tuple[tuple, dict]:
    """`node`'s args and kwargs with every dropout switch of its schema turned off."""
    args, kwargs = list(node.args), dict(node.kwargs)
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema else ()):
        if arg.name not in _DROPOUT_OFF:
            continue
        if arg.name in kwargs:
            kwargs[arg.name] = _DROPOUT_OFF[arg.name]
        elif i < len(args):
            args[i] = _DROPOUT_OFF[arg.name]
    return tuple(args), kwargs


def _without_defaults(target: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args` and `kwargs` without the trailing arguments that equal their schema defaults: a traced call
    may spell out `dropout_p=0.0` or leave it out."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return args, kwargs
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    kwargs = {k: v for k, v in kwargs.items() if k not in defaults or v != defaults[k]}
    args = list(args)
    while args and len(args) <= len(schema.arguments):
        arg = schema.arguments[len(args) - 1]
        if arg.name not in defaults or args[-1] != defaults[arg.name] or isinstance(args[-1], fx.Node):
            break
        args.pop()
    return tuple(args), kwargs


def _ops_without_dropout(graph: fx.Graph) -> list[tuple[fx.Node, tuple[str, Any, tuple, tuple]]]:
    """Each computing node with what it computes, (op, target, args, kwargs): dropout switched off and every
    node an argument names replaced by its position in this list (a dropout's output by its input's)."""
    index: dict[fx.Node, Any] = {}
    out = []
    for node in graph.nodes:
        if node.op == "placeholder":
            index[node] = ("input", len(index))
            continue
        if _reads_as_input(node):
            index[node] = index[node.args[0].args[0] if node.target is operator.getitem else node.args[0]]
            continue
        if node.target is aten.native_dropout.default:
            continue  # its output is read through `getitem(., 0)`, mapped above
        args, kwargs = _without_defaults(node.target, *_dropout_off(node)) if node.op == "call_function" else (node.args, node.kwargs)
        if node.target in _SIZED and isinstance(node.meta.get("val"), torch.Tensor):
            args = (args[0], tuple(node.meta["val"].shape), *args[2:])  # `view(x, [4, -1])` is `view(x, [4, 8])`
        mapped = fx.node.map_arg((args, kwargs), lambda n: index[n])
        index[node] = ("op", len(out))
        out.append((node, (node.op, node.target, mapped[0], tuple(sorted(mapped[1].items())))))
    return out


def _reads_as_input(node: fx.Node) -> bool:
    """A dropout's output, or a copy of its input that changes only its layout (which the kernels that ran
    when tracing decide: SDPA's output needed a `.contiguous()` copy with dropout, not without)."""
    if is_dropout_clone(node) or (node.target is aten.clone.default and node.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format):
        return True
    return (node.target is operator.getitem and node.args[1] == 0
            and getattr(node.args[0], "target", None) is aten.native_dropout.default)
