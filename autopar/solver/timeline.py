"""The memory model's timeline of one training step, as a plan records it for its reports.

    plan.memory_timeline  # (("start: parameters, gradients, optimizer state", 1.2e9), ("forward: transformer.h.0", ...), ...)

The ILP prices a plan's peak as a sum (`evaluate.evaluate`): what stays through the step (parameters,
gradients, optimizer state), every activation saved for backward, and the largest transient. This
draws that sum out in graph order: the saved activations accumulate through forward, the largest
transient sits on top of all of them, and backward frees them in reverse. Its largest point is the
plan's `MemoryBreakdown.total_bytes`, so a chart of it and the report's peak cannot disagree.
"""
from __future__ import annotations

from autopar.solver.evaluate import evaluate
from autopar.solver.plan import MemoryBreakdown
from autopar.solver.problem import Assignment, BuiltProblem
from autopar.tracer import TracedGraph, module_path

MAX_FORWARD_POINTS = 120  # a few KB of plan file; forward's curve only rises, so fewer points lose no peak


def _saved_by_position(traced: TracedGraph, built: BuiltProblem, a: Assignment) -> list[tuple[int, str, float]]:
    """(graph position, module path, saved bytes) per cluster: a tied class's share split evenly over the layers
    it stands for, each at its own layer's place in the graph."""
    saved = [0.0] * len(built.problem.nodes)
    evaluate(built.problem, a, saved)
    position = {n.name: i for i, n in enumerate(traced.graph.nodes)}
    nodes = {n.name: n for n in traced.graph.nodes}
    g = built.grouping
    out = []
    for v, clusters in enumerate(g.classes):
        if saved[v] <= 0.0:
            continue
        for c in clusters:
            leader = nodes[g.clusters[c].leader]
            where = traced.param_fqns.get(leader.name, "").rpartition(".")[0] or module_path(leader)
            out.append((position[leader.name], where or "(top level)", saved[v] / len(clusters)))
    return sorted(out)


def _by_module(points: list[tuple[int, str, float]]) -> list[tuple[str, float]]:
    """Consecutive clusters of one module joined into one step of the curve."""
    out: list[tuple[str, float]] = []
    for _, where, nbytes in points:
        if out and out[-1][0] == where:
            out[-1] = (where, out[-1][1] + nbytes)
        else:
            out.append((where, nbytes))
    return out


def _fewer(steps: list[tuple[str, float]], limit: int) -> list[tuple[str, float]]:
    """At most `limit` steps: runs of consecutive ones joined, named after their first and last module."""
    if len(steps) <= limit:
        return steps
    size = -(-len(steps) // limit)
    out = []
    for i in range(0, len(steps), size):
        run = steps[i:i + size]
        name = run[0][0] if len(run) == 1 else f"{run[0][0]} .. {run[-1][0]}"
        out.append((name, sum(b for _, b in run)))
    return out


def memory_timeline(traced: TracedGraph, built: BuiltProblem, a: Assignment, memory: MemoryBreakdown) -> tuple[tuple[str, float], ...]:
    """Per-device bytes through the step under assignment `a`, whose memory is `memory` (see module docstring)."""
    static = memory.params_bytes + memory.grads_bytes + memory.optimizer_bytes
    steps = _fewer(_by_module(_saved_by_position(traced, built, a)), MAX_FORWARD_POINTS)
    points = [("start: parameters, gradients, optimizer state", static)]
    live = [static]
    for where, nbytes in steps:
        live.append(live[-1] + nbytes)
        points.append((f"forward: {where}", live[-1]))
    if steps:  # the model's own total ends forward (the parts summed in another order may differ in the last bits)
        points[-1] = (points[-1][0], static + memory.activations_bytes)
    points.append(("peak: every saved activation and the largest transient", memory.total_bytes))
    for (where, _), before in zip(reversed(steps), reversed(live[:-1])):
        points.append((f"backward: {where}", before))
    return tuple(points)
