"""Recompute decisions as checkpointed regions.

Each maximal run (in graph order) of lowered nodes whose traced node the plan
marks `recompute`, cut at layer boundaries and bridging cheap work (views,
copies, elementwise ops) between them (`_runs`), is outlined into a sub-GraphModule `recompute_<i>` and called
through `runtime.checkpoint.checkpointed` (`checkpointed_with_rng` when it draws random numbers): its
activations are freed after forward and rebuilt in backward, drawing the same random numbers. Backward rebuilds a whole region at
once, so a region spanning every block of a model would bring all their
activations back together (measured: the peak of GPT-2 with every block recomputed
equalled the peak without recompute); cutting runs per layer (`layer_key`:
'transformer.h.3') keeps one layer's activations live at a time, as per-layer
activation checkpointing does. Collectives inside a region run
again during recomputation; every rank recomputes the same regions in the same
order, so they stay matched.
"""
from __future__ import annotations

import operator
from typing import Mapping

import torch
from torch import fx, nn

from autopar.runtime import rng
from autopar.runtime.checkpoint import checkpointed, checkpointed_with_rng


def layer_key(path: str) -> str:
    """The repeated layer a module path belongs to: up to its first numeric part ('transformer.h.3'), else its first part."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


# Ops that only alias or copy their input: free to run again, so a region may take them in (see `_runs`).
_COPY_OPS = frozenset({"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "squeeze", "unsqueeze",
                       "slice", "select", "alias", "clone", "contiguous", "split", "split_with_sizes", "unbind", "detach"})


def _is_copy(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and packet.__name__ in _COPY_OPS


def _is_cheap(node: fx.Node) -> bool:
    """A copy, an elementwise op (torch's `pointwise` tag) or a concatenation: one pass over its output to
    run again. Never an op that draws random numbers or writes its input (run again, it would write twice)."""
    if _is_copy(node):
        return True
    if node.op != "call_function" or _draws_random(node) or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target._schema.is_mutable:
        return False
    return torch.Tag.pointwise in node.target.tags or node.target is torch.ops.aten.cat.default


def _draws_random(node: fx.Node) -> bool:
    return node.target is rng.random_op or (
        isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags)


def _deferrable(node: fx.Node) -> bool:
    """Kept work that may run later than its place in the graph: it draws no random numbers (their order is
    part of the result) and writes none of its inputs (a later reader would see the old value). Our
    collectives never write their input (`runtime.comm`)."""
    if node.op != "call_function" or _draws_random(node):
        return False
    return not (isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable)


def _runs(graph: fx.Graph, recompute: set[str], origin: Mapping[str, str], layer: Mapping[str, str]
          ) -> list[tuple[list[fx.Node], list[fx.Node]]]:
    """Maximal runs (graph order) of recomputed nodes of one layer, bridging cheap work between them
    and stepping over kept nodes; each with the kept nodes to move after the region's call.

    A view or a dropout-free clone the plan keeps sits between most recomputed ops (a linear is
    `t(weight)` then `addmm`), and kept work interleaves with recomputed work (LLaMA's up projection
    between `silu(gate)` and the product). Cutting the run there would make the run's output so far
    the next region's input, which checkpoint saves: the region would free nothing of what the solver
    priced it to free (`Problem.recompute_with` assumes one region per layer), and pay a region's
    fixed cost per op (measured: gpt2-tiny's 22 recomputed ops made 13 regions and saved no memory).
    So a kept node that reads nothing of the run stays outside it (the region is called where its last
    node was, after it: `outline`); cheap work on the run's values (a copy, an elementwise op, a
    concatenation: `_is_cheap`) is taken into the region when a recomputed node of the same layer
    follows, and run again in backward; other kept work that reads the run (the reduce-scatter of a
    row-parallel output whose consumer is kept) is deferred: moved after the region's call, with the
    kept work that reads it. The run ends only where a recomputed node reads deferred work, or at kept
    work that cannot be deferred (`_deferrable`: it draws random numbers or writes its input). The solver never recomputes an
    op that saves nothing (it would free nothing), yet such ops sit inside recomputed work: LLaMA's
    rotary embedding (`q * cos`, `cat(-x2, x1)`) cut a recomputed attention into four regions
    (measured on llama-tiny's tightest plan: 10 regions made 4, 144 -> 138 ms a step); the reduce-scatters
    of its row-parallel projections cut it into 11 regions for 2 layers and the head."""
    runs: list[tuple[list[fx.Node], list[fx.Node]]] = []
    current: list[fx.Node] = []
    bridge: list[fx.Node] = []  # cheap work after the run's last recomputed node, kept only if the run goes on
    deferred: dict[fx.Node, None] = {}  # kept work that reads the run (or deferred work), in graph order
    moved = 0  # how many of `deferred` precede the run's last recomputed node: those move after the region's call

    def end_run() -> None:
        runs.append((current, list(deferred)[:moved]))

    for node in graph.nodes:
        traced = origin.get(node.name)
        reads_deferred = not deferred.keys().isdisjoint(node.all_input_nodes)
        if node.op == "call_function" and traced in recompute:
            if current and (reads_deferred or layer.get(traced) != layer.get(origin[current[-1].name])):
                # one region per layer: backward rebuilds one layer's activations at a time
                end_run()
                current, deferred = [], {}
            elif current:
                current.extend(bridge)
            bridge = []
            current.append(node)
            moved = len(deferred)
            continue
        members = {*current, *bridge}
        kept_work = _deferrable(node)
        if current and kept_work and not reads_deferred and not any(a in members for a in node.all_input_nodes):
            continue  # independent kept work: stays before the region's call
        if current and not reads_deferred and _is_cheap(node) and layer.get(traced) == layer.get(origin[current[-1].name]):
            bridge.append(node)  # cheap work on the run's values: taken in if the run goes on
            continue
        if current and kept_work:
            deferred[node] = None  # reads the run (or deferred work): runs after the region's call
            continue
        if current:
            end_run()
            current, bridge, deferred = [], [], {}
    if current:
        end_run()
    return runs


def outline(graph: fx.Graph, root: nn.Module, run: list[fx.Node], name: str, runner, after: list[fx.Node] = ()) -> None:
    """Move the nodes of `run` (graph order) into a sub-GraphModule `name` on `root`, called as `runner(region, *inputs)`;
    the nodes of `after` (graph order, outside the run, before its last node) move after the call."""
    members = set(run)
    inputs: dict[fx.Node, None] = {}
    for node in run:
        for a in node.all_input_nodes:
            if a not in members:
                inputs.setdefault(a, None)
    outputs = [n for n in run if any(u not in members for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
    for node in run:
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[n] for n in outputs))
    root.add_module(name, fx.GraphModule(nn.Module(), sub, class_name="Region"))
    # at the run's last node: every outside input is defined by then (the run may step over kept nodes,
    # `_runs`), and nothing outside the run reads it before then
    with graph.inserting_before(run[-1]):
        region = graph.get_attr(name)
        call = graph.call_function(runner, (region, *inputs))
        results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for old, new in zip(outputs, results):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in members)
    place = results[-1] if results else call
    for node in after:
        place.append(node)  # fx: moves the node right after `place`
        place = node
    for node in reversed(run):
        graph.erase_node(node)


def outline_recompute_regions(graph: fx.Graph, root: nn.Module, recompute: set[str], origin: Mapping[str, str],
                              layer: Mapping[str, str]) -> int:
    """Rewrite `graph` in place (regions registered on `root`, before the GraphModule is built: one compile); returns the count.

    `layer`: traced node -> `layer_key` of its module path; a run is cut where it changes.
    """
    count = 0
    for run, deferred in _runs(graph, recompute, origin, layer):
        if not any(u not in set(run) for n in run for u in n.users):
            continue  # nothing leaves the region: dead code, fx's DCE removes it
        runner = checkpointed_with_rng if any(_draws_random(n) for n in run) else checkpointed
        outline(graph, root, run, f"recompute_{count}", runner, deferred)
        count += 1
    return count
