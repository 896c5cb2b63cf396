"""From a traced graph to a built problem, and from a problem's assignment back to a `Plan`.

    built = build_for(traced, profile, mesh, budget_bytes)
    plan = to_plan(traced, mesh, built, solution)
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from autopar.profiler.types import ConcreteProfile, GraphProfile
from autopar.solver.comm_volume import comm_bytes_by_kind
from autopar.solver.ilp import Solution
from autopar.solver.mesh import Mesh
from autopar.solver.notes import plan_notes
from autopar.solver.plan import NodeDecision, ParamDecision, Plan
from autopar.solver.plan_io import fingerprint
from autopar.solver.problem import BuiltProblem, build_problem
from autopar.solver.spec import Strategy
from autopar.solver.strategies import enumerate_strategies
from autopar.solver.timeline import memory_timeline
from autopar.tracer import TracedGraph, module_path, tensor_args
from autopar.tracer.param_layouts import param_layouts


def concrete(profile: GraphProfile | ConcreteProfile, sizes: Mapping[str, int] | None) -> ConcreteProfile:
    return profile.evaluate(**(sizes or {})) if isinstance(profile, GraphProfile) else profile


def build_for(traced: TracedGraph, profile: GraphProfile | ConcreteProfile, mesh: Mesh, budget_bytes: float | None,
              sizes: Mapping[str, int] | None = None, grouped: bool = True, per_layer: bool = False,
              host_budget_bytes: float | None = None) -> BuiltProblem:
    """The problem of `traced` on `mesh` (`grouped`, `per_layer`, `host_budget_bytes`: see `build_problem`)."""
    strategies = enumerate_strategies(traced, mesh)
    return build_problem(traced, concrete(profile, sizes), mesh, strategies, budget_bytes, grouped=grouped,
                         per_layer=per_layer, host_budget_bytes=host_budget_bytes)


def budget_of(mesh: Mesh, memory_budget_bytes: float | None) -> float:
    """The per-device budget a solve keeps to: the one given (for the step's tensors: what
    `torch.cuda.max_memory_allocated` measures), else the device's memory less its fixed overheads
    (`Mesh.overhead_bytes`)."""
    return mesh.memory_bytes - mesh.overhead_bytes() if memory_budget_bytes is None else float(memory_budget_bytes)


def to_plan(traced: TracedGraph, mesh: Mesh, built: BuiltProblem, sol: Solution) -> Plan:
    """Map a problem assignment back onto every graph node and parameter."""
    g, a = built.grouping, sol.assignment
    layouts = param_layouts(traced)
    chosen: dict[str, Strategy] = {}
    nodes, params = [], []
    for node in traced.graph.nodes:
        if node.op == "output":
            ins = tuple(chosen[x.name].output_specs[0] for x in tensor_args(node) if x.name in chosen)
            nodes.append(NodeDecision(node.name, "output", Strategy(ins, ())))
            continue
        cls = g.class_of[g.cluster_of[node.name]]
        k = built.member_strategy(node.name, a.choice[cls])
        strat = chosen[node.name] = built.strategies[node.name][k]
        op = "placeholder" if node.op == "placeholder" else str(node.target)
        nodes.append(NodeDecision(node.name, op, strat, a.recompute[cls] and node.op == "call_function", module_path(node)))
        if node.name in traced.param_fqns:
            use = strat.output_specs[0]
            storage = built.storage[node.name, k] if a.zero[cls] else use
            fqn = traced.param_fqns[node.name]
            params.append(ParamDecision(fqn, node.name, use, storage, layouts[fqn], "host" if a.offloaded(cls) else "device"))
    plan = Plan(fingerprint(traced, mesh, built.problem.budget_bytes), mesh, tuple(nodes), tuple(params),
                sol.memory, sol.time, sol.report, notes=plan_notes(traced, mesh),
                memory_timeline=memory_timeline(traced, built, a, sol.memory))
    return dataclasses.replace(plan, comm_bytes_by_kind=comm_bytes_by_kind(traced, plan, built.summed_per_computed))
