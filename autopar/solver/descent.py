"""Axis-wise descent: a plan on a mesh of several axes improved one mesh axis at a time.

    better = descend(built, start, restrictions, time_limit_s=5.0)

On a mesh of several axes a node's options are its placements on each axis combined (up to ~50), and the
joint model is large: LLaMA-7B's on 4x2 has 65k variables, most of them edge pairs, and HiGHS took 30 CPU s at
its root to prove a 4-layer model's optimum (13.9 ms). Holding every node's placements on all axes but one
leaves a few options per node, a model the size of a 1-D mesh's (~6k variables) solved in a fraction of a
second; alternating over the axes until a round improves nothing reached, from ZeRO-3's layout, the 13.92 ms
the joint model proved optimal, in 1.5 CPU s. From Megatron's layout it stopped at 15.2 ms: a local optimum.
So its plans start the joint search (`anytime.solve_problem`), which may still improve them.
"""
from __future__ import annotations

from dataclasses import replace

from autopar.errors import SearchTimeoutError
from autopar.solver.clock import cpu_s
from autopar.solver.anytime import fits, priced, solve_problem
from autopar.solver.backends import Backend
from autopar.solver.ilp import DEFAULT_GAP, Restrictions, Solution
from autopar.solver.problem import Assignment, BuiltProblem, Problem
from autopar.solver.spec import Strategy

_ROUNDS = 3  # over every axis; a round that improves less than _GAIN ends it (3 rounds: LLaMA's settled in 2)
_GAIN = 1e-3


def _axis_free(strategy: Strategy, axis: int) -> tuple:
    """`strategy`'s placements on every mesh axis but `axis`: what descending along `axis` holds."""
    return tuple(tuple(p for a, p in enumerate(spec.placements) if a != axis)
                 for spec in (*strategy.input_specs, *strategy.output_specs))


def descend(built: BuiltProblem, mesh_shape: tuple[int, ...], start: Assignment,
            restrictions: Restrictions = Restrictions(), time_limit_s: float = 10.0, backend: Backend = "highs",
            problem: Problem | None = None, mip_rel_gap: float = DEFAULT_GAP) -> Solution:
    """`start` improved one mesh axis at a time (see the module docstring) on `problem` (default: `built`'s), within
    its budget when `start` fits it; `start` itself when the mesh has one axis of more than one device, or nothing
    better is found in time."""
    problem = problem or built.problem
    best = priced(problem, start)
    axes = [a for a, n in enumerate(mesh_shape) if n > 1]
    if len(axes) < 2 or not fits(problem, best):
        return best
    began = cpu_s()
    leaders = [built.grouping.clusters[built.grouping.classes[v][0]].leader for v in range(len(problem.nodes))]
    options = [[built.strategies[leader][built.member_strategy(leader, s)] for s in range(len(node.options))]
               for leader, node in zip(leaders, problem.nodes)]
    steps_left = _ROUNDS * len(axes)
    for _ in range(_ROUNDS):
        before_s = best.time.total_s
        for axis in axes:
            left_s = time_limit_s - (cpu_s() - began)
            if left_s <= 0:
                return best
            held = {}
            for v, opts in enumerate(options):
                keep = _axis_free(opts[best.assignment.choice[v]], axis)
                allowed = restrictions.allowed.get(v, range(len(opts)))
                # a node whose option the restrictions rule out (a start of another layout) is free on every axis
                held[v] = frozenset(s for s in allowed if _axis_free(opts[s], axis) == keep) or frozenset(allowed)
            try:
                found = solve_problem(problem, left_s / steps_left, backend, replace(restrictions, allowed=held),
                                      mip_rel_gap, starts=[best.assignment], bounded=True)
            except SearchTimeoutError:
                found = best
            steps_left -= 1
            if fits(problem, found) and found.time.total_s < best.time.total_s:
                best = found
        if before_s - best.time.total_s < _GAIN * before_s:
            break
    return best
