"""Cut a traced graph into pipeline stages between its layers.

    layers = find_layers(traced)                  # numbered layers in graph order, where a stage may start
    stages = cut(traced, (layers.starts[2],))     # two stages: everything before layer 2, and the rest

A layer is a module path with a numbered part (`transformer.h.3`, `layer1.0`: `solver.regions.layer_key`).
A stage starts at the first op of a layer (or right after the last layer: the head alone) and takes
every op up to the next stage's start in graph order, so the code around the layers goes where it
runs: embeddings to the first stage, the final norm, head and loss to the last.

Each stage's part becomes a `TracedGraph` of its own, which the solver plans and codegen lowers as
it would a whole model (`StageGraph.traced`):
- the model's inputs it reads are its inputs, fed by every stage that reads them (labels go straight
  to the last stage, not through the others);
- the values earlier stages computed that this or a later stage reads arrive from the stage before
  (`received`), each fed cut along the dim the stage before returns it cut along
  (`codegen.lower.output_batch_dim`), so both sides agree on the layout whatever the plans; a value
  a later stage reads passes through;
- it returns what later stages read (`sent`), or, for the last stage, its micro-batch's part of the
  loss (`loss.split_loss`).
A parameter read by several stages (a tied embedding and LM head) is a parameter of each.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from torch import fx
from torch.utils import _pytree as pytree

from autopar.codegen.lower import output_batch_dim
from autopar.errors import AutoparError
from autopar.pipeline.loss import LossSplit, split_loss
from autopar.solver.regions import draws_random, layer_key
from autopar.tracer import TracedGraph, module_path
from autopar.tracer.batch_dims import batch_size
from autopar.tracer.nodes import differentiable

# ops that normalise over the batch in training: a micro-batch would be normalised by its own statistics
_BATCH_STATISTICS = frozenset({
    torch.ops.aten._native_batch_norm_legit_functional.default, torch.ops.aten.native_batch_norm.default,
    torch.ops.aten._native_batch_norm_legit.default, torch.ops.aten.batch_norm.default,
})


class CutError(AutoparError):
    """The model cannot be cut into pipeline stages there (or anywhere): says why."""


@dataclass(frozen=True)
class Layers:
    """Where a traced graph can be cut: its numbered layers in graph order."""

    names: tuple[str, ...]  # layer keys ('transformer.h.0', ...) in graph order
    starts: tuple[int, ...]  # per layer, the position of its first op among the graph's ops
    end: int  # the position right after the last layer's last op
    valid: frozenset[int]  # positions a stage may start at: no layer straddles them, no tuple is split there
    num_ops: int
    batch_statistics: bool  # the model normalises over the batch (batch norm): one micro-batch only
    reason: str = ""  # why no stage can start anywhere ("" when some can)

    def cut_points(self) -> tuple[int, ...]:
        """Every position a stage may start at, ascending: before each layer but the first (the first
        layer's start too, where code runs before it), and after the last (a head alone)."""
        return tuple(sorted(p for p in (*self.starts, self.end) if p in self.valid and 0 < p < self.num_ops))

    def layers_in(self, start: int, stop: int) -> tuple[str, ...]:
        return tuple(n for n, s in zip(self.names, self.starts) if start <= s < stop)


@dataclass(frozen=True)
class StageGraph:
    """One stage's part of the model, as a graph of its own."""

    index: int
    traced: TracedGraph
    start: int  # its first op's position in the model's graph
    stop: int
    layers: tuple[str, ...]  # the numbered layers it holds
    user_inputs: tuple[str, ...]  # the model's inputs it reads (its first inputs, fed by name)
    received: tuple[str, ...]  # values from the stage before (its other inputs, in order)
    receives_grad: tuple[bool, ...]  # per value received: whether it carries a gradient (sent back in backward)
    sent: tuple[str, ...]  # values for the stage after, in order (the last stage: none)
    sends_grad: tuple[bool, ...]  # per value sent: whether it carries a gradient
    loss: LossSplit | None = None  # the last stage's

    @property
    def is_last(self) -> bool:
        return self.loss is not None


def _ops(traced: TracedGraph) -> list[fx.Node]:
    return [n for n in traced.graph.nodes if n.op == "call_function"]


def find_layers(traced: TracedGraph) -> Layers:
    """The numbered layers of `traced` and the positions a stage may start at."""
    ops = _ops(traced)
    position = {n.name: i for i, n in enumerate(ops)}
    spans: dict[str, list[int]] = {}
    for i, node in enumerate(ops):
        key = layer_key(module_path(node))
        if any(part.isdigit() for part in key.split(".")):
            spans.setdefault(key, [i, i])[1] = i
    names = tuple(spans)
    starts = tuple(spans[n][0] for n in names)
    end = max((last for _, last in spans.values()), default=-1) + 1
    straddled = set()
    for first, last in spans.values():
        straddled.update(range(first + 1, last + 1))  # a stage starting there would split the layer
    for node in ops:  # a tuple's producer and its getitems stay together
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].name in position:
            straddled.update(range(position[node.args[0].name] + 1, position[node.name] + 1))
    valid = frozenset(range(1, len(ops))) - straddled
    batch_stats = any(n.target in _BATCH_STATISTICS and _training_norm(n) for n in ops)
    layers = Layers(names, starts, end, valid, len(ops), batch_stats)
    reason = ""
    between = [p for p in layers.cut_points() if any(last < p for _, last in spans.values())
               and any(first >= p for first, _ in spans.values())]
    if not names:
        reason = ("it has no numbered layers (no module path with a number, like `h.3`): pipeline stages are cut "
                  "between the layers of an nn.ModuleList or nn.Sequential")
    elif len(names) == 1:
        reason = f"it has one layer ({names[0]}): stages are cut between layers"
    elif not between:
        reason = f"its layers {names[0]} .. {names[-1]} do not run one after another, so no stage boundary separates them"
    return replace(layers, reason=reason)


def _training_norm(node: fx.Node) -> bool:
    """A batch norm that computes the batch's statistics (training mode), not one reading running statistics:
    each op of `_BATCH_STATISTICS` takes (input, weight, bias, running_mean, running_var, training, ...)."""
    return bool(node.args[5]) if len(node.args) > 5 else True


def cut(traced: TracedGraph, starts: Sequence[int], layers: Layers | None = None) -> tuple[StageGraph, ...]:
    """`traced` as len(starts) + 1 stages, stage s > 0 starting at op position starts[s - 1]."""
    layers = layers or find_layers(traced)
    if layers.reason:
        raise CutError(f"{traced.model_name or 'the model'} cannot be cut into pipeline stages: {layers.reason}")
    if traced.input_mutations or traced.param_mutations:
        what = sorted({*traced.input_mutations.values(), *traced.param_mutations.values()})
        raise CutError(f"the forward writes {what[:3]} in place; a pipeline stage writes only the buffers of its own "
                       "layers: move the update out of the forward to train with pp")
    bad = [p for p in starts if p not in layers.valid]
    if bad or list(starts) != sorted(set(starts)):
        raise CutError(f"stages cannot start at op positions {list(starts)}: each must be one of {layers.cut_points()}, "
                       "ascending (the first op of a layer, or right after the last layer)")
    loss = split_loss(traced)
    ops = _ops(traced)
    bounds = (0, *starts, len(ops))
    stage_of = {n.name: s for s in range(len(bounds) - 1) for n in ops[bounds[s]:bounds[s + 1]]}
    readers: dict[str, set[int]] = {}
    for n in ops:
        for a in n.all_input_nodes:
            if a.name in stage_of:
                readers.setdefault(a.name, set()).add(stage_of[n.name])
    last_needs = {loss.total, *([loss.count] if loss.count else [])}
    for name in last_needs:
        readers.setdefault(name, set()).add(len(bounds) - 1)
    trainable = _trainable_values(traced)
    out, received, dims, grads = [], (), (), ()
    for s in range(len(bounds) - 1):
        last = s == len(bounds) - 2
        sent = () if last else tuple(n.name for n in ops[:bounds[s + 1]]
                                     if n.name in readers and max(readers[n.name]) > s)
        sent_values = [traced.node(n).meta.get("val") for n in sent]
        not_tensors = [n for n, v in zip(sent, sent_values) if not isinstance(v, torch.Tensor)]
        if not_tensors:
            raise CutError(f"stage {s} would send {not_tensors[:3]}, which are not tensors; cut elsewhere")
        stage = _stage_graph(traced, s, ops[bounds[s]:bounds[s + 1]], received, dims, sent,
                             (loss.total, loss.count) if last else None, layers)
        stage = replace(stage, start=bounds[s], stop=bounds[s + 1], layers=layers.layers_in(bounds[s], bounds[s + 1]),
                        receives_grad=grads, sends_grad=tuple(n in trainable for n in sent), loss=loss if last else None)
        out.append(stage)
        received, dims, grads = sent, _sent_dims(stage.traced, sent, sent_values), stage.sends_grad
    return tuple(out)


def _drop_unread(graph: fx.Graph) -> None:
    """Drop the ops whose values no output needs (the loss's division, logits the loss does not read): pure ops
    only, never one that draws random numbers (the draws after it would change)."""
    for node in reversed(graph.nodes):
        if node.op == "call_function" and not node.users and not draws_random(node) and not _writes(node):
            graph.erase_node(node)


def _writes(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def _sent_dims(stage: TracedGraph, sent: tuple[str, ...], values: list[torch.Tensor]) -> tuple[int | None, ...]:
    """The dim each value sent comes back cut along, as codegen returns a stage's outputs: a value passed through
    as it was fed, any other by `output_batch_dim` (the next stage is fed along the same dims)."""
    fed = stage.batch_dim_of()
    batch = batch_size([stage.node(n).meta.get("val") for n in stage.input_names], stage.input_batch_dims)
    return tuple(fed[n] if n in fed else output_batch_dim(v, stage.input_batch_dims, batch) for n, v in zip(sent, values))


def _trainable_values(traced: TracedGraph) -> set[str]:
    """Nodes whose value carries a gradient at run time: differentiable and computed from a trainable parameter."""
    frozen = traced.frozen_params()
    out = {ph for ph in traced.param_fqns if ph not in frozen}
    for node in traced.graph.nodes:
        if node.op == "call_function" and any(a.name in out for a in node.all_input_nodes):
            val = node.meta.get("val")
            if differentiable(val) or isinstance(val, (tuple, list)):
                out.add(node.name)
    return out


def _stage_graph(traced: TracedGraph, index: int, ops: list[fx.Node], received: tuple[str, ...],
                 received_dims: tuple[int | None, ...], sent: tuple[str, ...], loss: tuple[str, str | None] | None,
                 layers: Layers) -> StageGraph:
    """Stage `index` as a TracedGraph: its ops, the parameters, buffers and model inputs they read, the values it
    receives as inputs and what it returns."""
    names = {n.name for n in ops}
    read = {a.name for n in ops for a in n.all_input_nodes} | set(received) | set(sent)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    user_inputs = []
    dims_of = traced.batch_dim_of()
    for ph in (n for n in traced.graph.nodes if n.op == "placeholder"):
        if ph.name in read and ph.name not in names:
            env[ph.name] = graph.node_copy(ph)
            if ph.name in dims_of:
                user_inputs.append(ph.name)
    for name in received:
        if name not in env:  # (a model input is fed to each stage, never received)
            env[name] = graph.placeholder(name)
            env[name].meta = dict(traced.node(name).meta)
    for node in ops:
        env[node.name] = graph.node_copy(node, lambda a: env[a.name])
    outputs = sent if loss is None else tuple(n for n in loss if n is not None)
    mutations = {n: fqn for n, fqn in traced.buffer_mutations.items() if n in names}
    graph.output(tuple(env[n] for n in (*outputs, *mutations)))
    _drop_unread(graph)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    inputs = (*user_inputs, *(n for n in received if n not in dims_of))
    in_dims = (*(dims_of[n] for n in user_inputs), *(d for n, d in zip(received, received_dims) if n not in dims_of))
    placeholders = set(env) - names
    params = {ph: fqn for ph, fqn in traced.param_fqns.items() if ph in placeholders}
    buffers = {ph: fqn for ph, fqn in traced.buffer_fqns.items() if ph in placeholders}
    constants = {fqn: t for fqn, t in traced.constants.items() if fqn in buffers.values()}
    _, in_spec = pytree.tree_flatten(((), {n: None for n in inputs}))
    _, out_spec = pytree.tree_flatten(tuple(outputs))
    stage = replace(
        traced, gm=gm, param_fqns=params, buffer_fqns=buffers, input_names=inputs, in_spec=in_spec, out_spec=out_spec,
        output_names=outputs, loss_index=0 if loss is not None else None, buffer_mutations=mutations,
        input_mutations={}, param_mutations={},
        tied_params={k: v for k, v in traced.tied_params.items() if k in params.values()},
        constants=constants, nonpersistent_buffers=traced.nonpersistent_buffers & set(buffers.values()),
        batch_dim=0, input_batch_dims=tuple(in_dims), model_name=f"{traced.model_name} stage {index}")
    return StageGraph(index, stage, 0, 0, (), tuple(user_inputs), tuple(n for n in received if n not in dims_of), (), sent, ())
