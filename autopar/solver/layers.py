"""Recompute and ZeRO decided per layer: a tied plan's repeated layers split into runs that decide apart.

The search decides each family of repeated blocks once (`cluster.tie_blocks`): every layer of it takes the same
sharding, recompute and ZeRO decisions, so its problem does not grow with depth. Where the budget binds, some
layers recomputed and the others not can be faster than all or none. `per_layer` keeps the tied plan's sharding
and decides recompute and ZeRO again on the problem tied in runs of 1, 2, 4, ... layers (`cluster.layer_runs`),
whose subsets give any number of a family's layers one set of decisions and the rest another: the layer-level
choice Checkmate- and Mist-style planners make over each layer's (time, memory) options, here as a small ILP
(the sharding held, each run's recompute and ZeRO binaries free, the memory row exact), whose size grows with
log2 of the depth (7 runs for 96 layers).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from autopar.profiler.types import ConcreteProfile, GraphProfile
from autopar.solver.clock import cpu_s
from autopar.solver.anytime import fits, priced, solve_problem
from autopar.solver.assemble import build_for
from autopar.solver.backends import Backend
from autopar.solver.ilp import DEFAULT_GAP, Restrictions, Solution
from autopar.solver.mesh import Mesh
from autopar.solver.problem import Assignment, BuiltProblem
from autopar.solver.textbook import held
from autopar.tracer import TracedGraph


def mixable(built: BuiltProblem, sol: Solution) -> bool:
    """Whether deciding per layer can beat `sol`: a class standing for several layers is recomputed or ZeRO-sharded
    (some of its layers might do without)."""
    a = sol.assignment
    return any(node.copies > 1 and (a.recompute[v] or a.zero[v] or a.offloaded(v)) for v, node in enumerate(built.problem.nodes))


def spread(tied: BuiltProblem, runs: BuiltProblem, a: Assignment) -> Assignment:
    """`a` (on the tied problem) on the problem tied in runs: every run of a family decides as the family did."""
    of = [tied.grouping.class_of[runs.grouping.classes[v][0]] for v in range(len(runs.problem.nodes))]
    return Assignment(tuple(a.choice[c] for c in of), tuple(a.recompute[c] for c in of), tuple(a.zero[c] for c in of),
                      tuple(a.offload[c] for c in of) if a.offload else ())


def per_layer(traced: TracedGraph, profile: GraphProfile | ConcreteProfile, mesh: Mesh, tied: BuiltProblem, sol: Solution,
              restrictions: Restrictions = Restrictions(), time_limit_s: float = 10.0, backend: Backend = "highs",
              sizes: Mapping[str, int] | None = None, mip_rel_gap: float = DEFAULT_GAP) -> tuple[BuiltProblem, Solution]:
    """`sol`'s sharding with recompute and ZeRO decided per layer, on the problem it lives on; `tied` and `sol` as
    they are when that is not faster (or nothing per layer could be: `mixable`). The report keeps `sol`'s status;
    its gap is against the bound the tied search proved."""
    if not mixable(tied, sol) or not fits(tied.problem, sol):
        return tied, sol
    began = cpu_s()
    runs = build_for(traced, profile, mesh, tied.problem.budget_bytes, sizes, per_layer=True,
                     host_budget_bytes=tied.problem.host_budget_bytes)
    start = spread(tied, runs, sol.assignment)
    if not fits(runs.problem, priced(runs.problem, start)):  # priced alike on both problems; a hair over: keep `sol`
        return tied, sol
    left_s = max(0.0, time_limit_s - (cpu_s() - began))
    # held to `sol`'s options, with the search's recompute and ZeRO rules (its per-node options are held anyway)
    rules = Restrictions(zero=restrictions.zero, recompute=restrictions.recompute, offload=restrictions.offload)
    mixed = solve_problem(runs.problem, left_s, backend, held(start.choice, rules), mip_rel_gap, starts=[start])
    if mixed.time.total_s >= sol.time.total_s * (1 - 1e-9):
        return tied, sol
    bound_s = sol.time.total_s * (1 - (sol.report.gap or 0.0))  # a bound of the tied problem, not of the per-layer one
    gap = max(0.0, 1 - bound_s / mixed.time.total_s) if sol.report.gap else None
    report = replace(sol.report, solve_s=sol.report.solve_s + cpu_s() - began, gap=gap or None)
    return runs, replace(mixed, report=report)
