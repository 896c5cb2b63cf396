"""Textbook plans on a built problem (pure data parallel, ZeRO-3/FSDP, Megatron TP + DP) and the leanest plan.

    books = textbooks(traced, built, clock_s=10.0)        # name -> its plan on `built` (fitting, or its leanest form)
    start = leanest_start(built.problem, books["zero3"])  # every parameter ZeRO-sharded, every layer recomputed

A textbook fixes where parameters live and how the batch is split (`textbook_restrictions`). Within that layout
its sharding is the fastest without the budget (a restricted solve, whose model holds only the options the layout
allows: a small part of the whole), and recompute (ZeRO-3: with every parameter sharded) is fitted to the budget
(`anytime.fit_memory`); where nothing fits, its leanest form. The search starts from the fastest textbook plan
that fits and from the leanest plan by construction (`search.py`), so its plan is never slower than the first,
and it calls a budget infeasible only when the second provably does not fit.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

from autopar.errors import SearchTimeoutError
from autopar.profiler.profile import optimizer_cost
from autopar.profiler.types import ConcreteProfile, GraphProfile
from autopar.solver.clock import cpu_s
from autopar.solver.anytime import PRICING_GAP, fits, fit_memory, min_memory, priced, solve_problem
from autopar.solver.assemble import budget_of, build_for, to_plan
from autopar.solver.backends import Backend
from autopar.solver.descent import descend
from autopar.solver.ilp import Restrictions, Solution
from autopar.solver.evaluate import evaluate, recomputable_options
from autopar.solver.mesh import Mesh
from autopar.solver.plan import BaselineResult, Plan
from autopar.solver.problem import Assignment, BuiltProblem, Problem
from autopar.solver.spec import Replicate, Spec, Strategy
from autopar.tracer import TracedGraph

BASELINES = ("data_parallel", "zero3", "megatron")
# A textbook's layout is searched for at least this long (wall): without it the search has no valid start
_LAYOUT_FLOOR_S = 2.0


def batch_dependent(traced: TracedGraph) -> frozenset[str]:
    """User inputs and every non-scalar call_function node downstream of one: what carries the batch."""
    params = set(traced.param_fqns) | set(traced.buffer_fqns)
    out: set[str] = set()
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            carries = node.name not in params
        else:
            carries = node.op == "call_function" and any(a.name in out for a in node.all_input_nodes)
        val = node.meta.get("val")
        if carries and any(getattr(x, "ndim", 0) for x in (val if isinstance(val, (tuple, list)) else (val,))):
            out.add(node.name)
    return frozenset(out)


def splits_batch(strategy: Strategy, axes: tuple[int, ...] = (0,)) -> bool:
    """The strategy's first output is split (sharded or partial) over `axes` (default: the data-parallel, first one),
    the same way on each (on several axes, as on one axis of all their devices)."""
    if not strategy.output_specs:
        return False
    placements = {strategy.output_specs[0].placements[a] for a in axes}
    return len(placements) == 1 and not isinstance(next(iter(placements)), Replicate)


def _param_rule(name: str) -> Callable[[Spec], bool]:
    """Which use specs a baseline allows for parameters."""
    if name == "megatron":  # tensor parallel on the last (fastest) axis, replicated (data parallel) on the others
        return lambda spec: all(isinstance(p, Replicate) for p in spec.placements[:-1])
    return Spec.is_replicate  # data parallel and ZeRO-3: every parameter used whole


def params_allowed(traced: TracedGraph, built: BuiltProblem, rule: Callable[[Spec], bool]) -> dict[int, frozenset[int]]:
    """Per problem node standing for a parameter, the options whose use of it `rule` allows."""
    allowed = {}
    for v in range(len(built.problem.nodes)):
        leader = built.grouping.clusters[built.grouping.classes[v][0]].leader
        if leader in traced.param_fqns:
            allowed[v] = frozenset(i for i, s in enumerate(built.strategies[leader]) if rule(s.output_specs[0]))
    return allowed


def textbook_restrictions(traced: TracedGraph, built: BuiltProblem, name: str, mesh_shape: tuple[int, ...] = (1,)
                          ) -> Restrictions:
    """The layout textbook `name` fixes: its parameters' use specs, the batch split (data parallel and ZeRO-3: over
    every mesh axis, as on one axis of all the devices; Megatron: over all but the last), and its ZeRO rule."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {BASELINES}")
    allowed = params_allowed(traced, built, _param_rule(name))
    # the batch split: every tensor carrying it is split over the data axes, or the cheapest "data parallel" plan may
    # gather the batch and compute it whole on every rank
    axes = tuple(range(len(mesh_shape))) if name != "megatron" else tuple(range(len(mesh_shape) - 1))
    batched = batch_dependent(traced) if axes else frozenset()
    for v, node in enumerate(built.problem.nodes):
        leader = built.grouping.clusters[built.grouping.classes[v][0]].leader
        if leader in batched:  # (parameters never carry the batch: `batch_dependent`)
            split = frozenset(i for i in range(len(node.options))
                              if splits_batch(built.strategies[leader][built.member_strategy(leader, i)], axes))
            if split:  # an op with no batch-split strategy stays free (and is priced as what it can do)
                allowed[v] = split
    return Restrictions(allowed, zero="always" if name == "zero3" else "never")


def textbook(traced: TracedGraph, built: BuiltProblem, name: str, time_limit_s: float = 30.0,
             backend: Backend = "highs", mesh_shape: tuple[int, ...] = (1,), layout: Assignment | None = None) -> Solution:
    """Textbook `name` on `built` (for a mesh of `mesh_shape`): the fastest sharding of its layout, recompute (and
    ZeRO-3's sharding) fitted to the budget; where nothing fits, its leanest form (over the budget: `fits` tells).
    `layout`: a valid assignment of the layout to improve one mesh axis at a time (`descent.py`) rather than
    search the layout whole (Megatron's on a mesh of several axes, from data parallel's: its joint model on
    LLaMA-7B's 4x2 mesh holds 62k variables)."""
    began = cpu_s()
    restrictions = textbook_restrictions(traced, built, name, mesh_shape)
    problem = built.problem
    free = replace(problem, budget_bytes=None)
    layout_s = max(time_limit_s / 2, _LAYOUT_FLOOR_S)
    best = descend(built, mesh_shape, layout, restrictions, layout_s, backend, free, PRICING_GAP).assignment if layout else None
    if best is None or not allows(restrictions, best):
        best = solve_problem(free, layout_s, backend, restrictions, PRICING_GAP).assignment
    sol = priced(problem, all_on(problem, best, restrictions, recompute=False), "optimal")
    if not fits(problem, sol):
        left_s = max(0.0, time_limit_s - (cpu_s() - began))
        sol = fit_memory(problem, best.choice, restrictions, backend, left_s / 2) or min_memory(
            problem, left_s / 2, backend, held(best.choice, restrictions), start=all_on(problem, best, restrictions))
    return replace(sol, report=replace(sol.report, solve_s=cpu_s() - began))


def textbooks(traced: TracedGraph, built: BuiltProblem, names: tuple[str, ...] = BASELINES, time_limit_s: float = 30.0,
              backend: Backend = "highs", mesh_shape: tuple[int, ...] = (1,)) -> dict[str, Solution]:
    """Each textbook of `names` on `built`, the time limit shared among them; one whose layout was not found in
    its share is left out. On a mesh of several axes Megatron's layout is data parallel's improved one axis at a
    time (`textbook`'s `layout`)."""
    began = cpu_s()
    out: dict[str, Solution] = {}
    several_axes = sum(n > 1 for n in mesh_shape) > 1
    for k, name in enumerate(names):
        left_s = max(0.0, time_limit_s - (cpu_s() - began))
        dp = out.get("data_parallel")
        layout = Assignment(dp.assignment.choice, *(((False,) * len(dp.assignment.choice),) * 2)) \
            if name == "megatron" and several_axes and dp is not None else None
        try:
            out[name] = textbook(traced, built, name, left_s / (len(names) - k), backend, mesh_shape, layout)
        except SearchTimeoutError:
            continue
    return out


def allows(restrictions: Restrictions, a: Assignment) -> bool:
    """Whether `a`'s options are all ones `restrictions` allow."""
    return all(c in restrictions.allowed.get(v, (c,)) for v, c in enumerate(a.choice))


def held(choice: tuple[int, ...], restrictions: Restrictions) -> Restrictions:
    """`restrictions` with every node held to its option in `choice` (recompute, ZeRO and tier left to decide)."""
    return replace(restrictions, allowed={v: frozenset({c}) for v, c in enumerate(choice)})


def all_on(problem: Problem, a: Assignment, restrictions: Restrictions = Restrictions(), recompute: bool = True) -> Assignment:
    """`a`'s options with every parameter ZeRO-sharded that the restrictions let be (forced where they say so), and
    with `recompute` every node recomputed that may be, as the ILP pairs recompute: a node recomputed only with
    the node that keeps its output (`Problem.recompute_with`), never together with a reader in another region
    (`Problem.region_inputs`: the producer stays kept)."""
    zero = tuple(restrictions.zero != "never" and restrictions.zero_nodes.get(v) is not False
                 and (o := node.options[c]).zero is not None and o.zero.factor > 1
                 for v, (node, c) in enumerate(zip(problem.nodes, a.choice)))
    if not recompute or restrictions.recompute == "never":
        return Assignment(a.choice, (False,) * len(a.choice), zero)
    may = recomputable_options(problem)
    on = {v for v, c in enumerate(a.choice) if c in may[v]}
    on -= {u for u, v in problem.region_inputs if v in on}
    while dropped := {u for u, v in problem.recompute_with if u in on and v not in on}:
        on -= dropped
    return Assignment(a.choice, tuple(v in on for v in range(len(a.choice))), zero)


def leanest_start(problem: Problem, zero3: Solution, restrictions: Restrictions = Restrictions()) -> Assignment:
    """The leanest plan by construction: ZeRO-3's sharding (parameters used whole, the batch split over every
    axis it divides), with every parameter ZeRO-sharded over every axis and every layer recomputed, as far as
    `restrictions` (the search's) allow; and with the host tier free, every parameter's optimizer state on the host
    where the host budget holds it."""
    lean = all_on(problem, zero3.assignment, restrictions)
    if restrictions.offload == "never" or problem.host_budget_bytes is None:
        return lean
    # and every parameter on the host tier, where the host budget holds them all
    offload = tuple(node.options[c].host is not None for node, c in zip(problem.nodes, lean.choice))
    on_host = replace(lean, offload=offload)
    return on_host if evaluate(problem, on_host)[0].host_bytes <= problem.host_budget_bytes else lean


def baseline_plan(
    traced: TracedGraph,
    profile: GraphProfile | ConcreteProfile,
    mesh: Mesh,
    name: str,
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 30.0,
    sizes: Mapping[str, int] | None = None,
    built: BuiltProblem | None = None,
) -> Plan:
    """Textbook `name` on `mesh` as a Plan (`textbook`; over the budget when nothing of it fits). `built`: the
    problem for this mesh and budget, when the caller has it."""
    built = built or build_for(traced, profile, mesh, budget_of(mesh, memory_budget_bytes), sizes)
    return to_plan(traced, mesh, built, textbook(traced, built, name, time_limit_s, mesh_shape=mesh.shape))


def baseline_plans(
    traced: TracedGraph,
    profile: GraphProfile | ConcreteProfile,
    mesh: Mesh,
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 30.0,
    sizes: Mapping[str, int] | None = None,
    built: BuiltProblem | None = None,
) -> tuple[BaselineResult, ...]:
    """Pure data parallel, ZeRO-3/FSDP and Megatron TP+DP priced by the same model; for an optimizer that
    reads whole parameters (Adafactor, Muon) pure data parallel alone, the one of them it can step."""
    built = built or build_for(traced, profile, mesh, budget_of(mesh, memory_budget_bytes), sizes)
    names = ("data_parallel",) if optimizer_cost(profile.optimizer).whole_params else BASELINES
    return baseline_results(built.problem, textbooks(traced, built, names, time_limit_s, mesh_shape=mesh.shape))


def baseline_results(problem: Problem, books: Mapping[str, Solution]) -> tuple[BaselineResult, ...]:
    return tuple(BaselineResult(name, b.time, b.memory, fits(problem, b)) for name, b in books.items())
