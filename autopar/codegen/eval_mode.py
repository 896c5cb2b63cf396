"""The training graph run in eval mode: dropout off, and nothing else may differ.

A plan is solved for the model's training forward, and `ParallelModule` runs that graph.
In eval mode (`pm.eval()`) most transformers compute the same ops but for dropout
(`nn.Dropout`, attention's `dropout_p`); BatchNorm (running statistics rather than the
batch's), stochastic depth and other `if self.training:` branches compute something else.
So eval mode lowers the training graph with its dropout turned off (`without_dropout`),
after `check_eval_graph` has compared it, op by op, with the model's own eval-mode trace;
where anything else differs it raises, naming the first op that does.
"""
from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any

import torch
from torch import fx

from autopar.codegen.shapes import LoweringError
from autopar.tracer import TracedGraph
from autopar.tracer.nodes import is_dropout_clone, module_path

aten = torch.ops.aten
# Schema arguments that switch dropout on in an op (`native_dropout`'s train, attention's dropout_p)
# and their values with dropout off.
_DROPOUT_OFF = {"train": False, "dropout_p": 0.0}


def without_dropout(traced: TracedGraph) -> TracedGraph:
    """A copy of `traced` whose ops drop nothing; node names, and so the plan's decisions, unchanged."""
    graph = copy.deepcopy(traced.gm.graph)
    for node in graph.nodes:
        if node.op == "call_function":
            node.args, node.kwargs = _dropout_off(node)
    gm = fx.GraphModule(traced.gm, graph)
    return dataclasses.replace(traced, gm=gm)


def check_eval_graph(train: TracedGraph, evaluated: TracedGraph) -> None:
    """Raise unless `evaluated` (the model traced in eval mode) computes what `train`'s graph
    computes with dropout off: the same ops on the same inputs, in the same order, once every
    dropout (a `native_dropout`'s output in training, the `clone` export writes for it in eval) and
    every contiguous copy is read as its input."""
    ours, theirs = _ops_without_dropout(train.graph), _ops_without_dropout(evaluated.graph)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            raise _eval_error(evaluated.graph, i, b)
    if len(ours) != len(theirs):
        raise _eval_error(evaluated.graph, min(len(ours), len(theirs)), None)


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


def _ops_without_dropout(graph: fx.Graph) -> list[tuple[str, Any, tuple, tuple]]:
    """Each computing node as (op, target, args, kwargs), with dropout switched off and every node
    an argument names replaced by its position in this list (a dropout's output by its input's)."""
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
        args, kwargs = _dropout_off(node) if node.op == "call_function" else (node.args, node.kwargs)
        mapped = fx.node.map_arg((args, kwargs), lambda n: index[n])
        index[node] = ("op", len(out))
        out.append((node.op, node.target, mapped[0], tuple(sorted(mapped[1].items()))))
    return out


def _reads_as_input(node: fx.Node) -> bool:
    """A dropout's output, or a copy of its input that changes only its layout (which the kernels that ran
    when tracing decide: SDPA's output needed a `.contiguous()` copy with dropout, not without)."""
    if is_dropout_clone(node) or (node.target is aten.clone.default and node.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format):
        return True
    return (node.target is operator.getitem and node.args[1] == 0
            and getattr(node.args[0], "target", None) is aten.native_dropout.default)


def _eval_error(graph: fx.Graph, position: int, op: tuple | None) -> LoweringError:
    nodes = [n for n in graph.nodes if n.op != "placeholder" and not _reads_as_input(n)
             and n.target is not aten.native_dropout.default]
    where = ""
    if op is not None and position < len(nodes):
        node = nodes[position]
        where = f" ({node.target} in {module_path(node) or 'the top-level forward'})"
    return LoweringError(
        f"in eval mode the model computes something other than its training graph with dropout off{where}: "
        "autopar runs the graph its plan was solved for, the training forward, with dropout turned off in eval "
        "mode, so batch norm's running statistics, stochastic depth and other `if self.training:` branches "
        "cannot run. Evaluate in train mode (with dropout set to 0), or evaluate the full model on one device "
        "after `pm.state_dict()`.")
