"""Recompute decisions as checkpointed regions.

Each maximal run (in graph order) of lowered nodes whose traced node the plan
marks `recompute`, cut at layer boundaries and bridging cheap work (views,
copies, elementwise ops) between them (`solver.regions.region_runs`), is outlined into a sub-GraphModule `recompute_<i>` and called
through `runtime.checkpoint.checkpointed` (`checkpointed_with_rng` when it draws random numbers): its
activations are freed after forward and rebuilt in backward, drawing the same random numbers. Backward rebuilds a whole region at
once, so a region spanning every block of a model would bring all their
activations back together (measured: the peak of GPT-2 with every block recomputed
equalled the peak without recompute); cutting runs per layer (`solver.regions.layer_key`:
'transformer.h.3') keeps one layer's activations live at a time, as per-layer
activation checkpointing does. Collectives inside a region run
again during recomputation; every rank recomputes the same regions in the same
order, so they stay matched.
"""
from __future__ import annotations

import operator
from typing import Mapping

from torch import fx, nn

from autopar.runtime.checkpoint import checkpointed, checkpointed_with_rng
from autopar.solver.regions import draws_random, region_runs


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
    # `region_runs`), and nothing outside the run reads it before then
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
    for run, deferred in region_runs(graph.nodes, recompute, origin, layer):
        if not any(u not in set(run) for n in run for u in n.users):
            continue  # nothing leaves the region: dead code, fx's DCE removes it
        runner = checkpointed_with_rng if any(draws_random(n) for n in run) else checkpointed
        outline(graph, root, run, f"recompute_{count}", runner, deferred)
        count += 1
    return count
