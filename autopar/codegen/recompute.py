"""Recompute decisions as checkpointed regions, using torch's own mechanism.

Each maximal run (in graph order) of lowered nodes whose traced node the plan
marks `recompute`, cut at layer boundaries, is outlined into a sub-GraphModule `recompute_<i>` and called
through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: its
activations are freed after forward and rebuilt in backward (RNG state
included, which torch's checkpoint restores). Backward rebuilds a whole region at
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

import torch.utils.checkpoint
from torch import fx, nn


def checkpointed(region: fx.GraphModule, *args):
    """Run `region` under non-reentrant activation checkpointing (a named call in `gm.code`)."""
    return torch.utils.checkpoint.checkpoint(region, *args, use_reentrant=False)


def layer_key(path: str) -> str:
    """The repeated layer a module path belongs to: up to its first numeric part ('transformer.h.3'), else its first part."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


def _runs(graph: fx.Graph, recompute: set[str], origin: Mapping[str, str], layer: Mapping[str, str]) -> list[list[fx.Node]]:
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in graph.nodes:
        traced = origin.get(node.name)
        if node.op == "call_function" and traced in recompute:
            if current and layer.get(traced) != layer.get(origin[current[-1].name]):
                runs.append(current)  # one region per layer: backward rebuilds one layer's activations at a time
                current = []
            current.append(node)
            continue
        if current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def outline(graph: fx.Graph, root: nn.Module, run: list[fx.Node], name: str, runner) -> None:
    """Move the nodes of `run` (graph order) into a sub-GraphModule `name` on `root`, called as `runner(region, *inputs)`."""
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
    with graph.inserting_before(run[0]):
        region = graph.get_attr(name)
        call = graph.call_function(runner, (region, *inputs))
        results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for old, new in zip(outputs, results):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in members)
    for node in reversed(run):
        graph.erase_node(node)


def outline_recompute_regions(graph: fx.Graph, root: nn.Module, recompute: set[str], origin: Mapping[str, str],
                              layer: Mapping[str, str]) -> int:
    """Rewrite `graph` in place (regions registered on `root`, before the GraphModule is built: one compile); returns the count.

    `layer`: traced node -> `layer_key` of its module path; a run is cut where it changes.
    """
    count = 0
    for run in _runs(graph, recompute, origin, layer):
        if not any(u not in set(run) for n in run for u in n.users):
            continue  # nothing leaves the region: dead code, fx's DCE removes it
        outline(graph, root, run, f"recompute_{count}", checkpointed)
        count += 1
    return count
