"""Plans with decisions given: `fixed_plan` prices a whole assignment, `solve_keeping_params` plans another graph
of a model whose parameters are already stored as a plan says.

    plan = fixed_plan(traced, profile(traced), mesh, {name: strategy, ...}, recompute={"mm"}, zero_params={"w"})
"""
from __future__ import annotations

from typing import Mapping

from autopar.errors import AutoparError
from autopar.profiler.types import ConcreteProfile, GraphProfile
from autopar.solver.anytime import solve_problem
from autopar.solver.assemble import budget_of, build_for, to_plan
from autopar.solver.ilp import Restrictions, Solution
from autopar.solver.evaluate import evaluate
from autopar.solver.mesh import Mesh
from autopar.solver.plan import ParamDecision, Plan, SolverReport
from autopar.solver.problem import Assignment, BuiltProblem
from autopar.solver.spec import Spec, Strategy
from autopar.tracer import TracedGraph


def fixed_plan(
    traced: TracedGraph,
    profile: GraphProfile | ConcreteProfile,
    mesh: Mesh,
    choices: Mapping[str, Strategy],
    recompute: frozenset[str] = frozenset(),
    zero_params: frozenset[str] = frozenset(),
    memory_budget_bytes: float | None = None,
    sizes: Mapping[str, int] | None = None,
) -> Plan:
    """Price a given assignment (a strategy for every node; recompute node names; ZeRO param FQNs or node names)."""
    built = build_for(traced, profile, mesh, memory_budget_bytes, sizes, grouped=False)
    names = [built.problem.nodes[v].name for v in range(len(built.problem.nodes))]
    missing = [n for n in names if n not in choices]
    if missing:
        raise AutoparError(f"fixed_plan needs a strategy for every node; missing {len(missing)}: {missing[:5]}")
    choice = []
    for n in names:
        try:
            choice.append(built.strategies[n].index(choices[n]))
        except ValueError:
            raise AutoparError(f"strategy {choices[n]} is not a valid strategy of node {n!r}; pick one of enumerate_strategies()") from None
    zero_nodes = {node for node, fqn in traced.param_fqns.items() if fqn in zero_params or node in zero_params}
    a = Assignment(tuple(choice), tuple(n in recompute for n in names), tuple(n in zero_nodes for n in names))
    memory, step = evaluate(built.problem, a)
    report = SolverReport("none", "fixed", 0.0, 0, 0)
    return to_plan(traced, mesh, built, Solution(a, memory, step, report))


def solve_keeping_params(
    traced: TracedGraph,
    profile: GraphProfile | ConcreteProfile,
    mesh: Mesh,
    params: tuple[ParamDecision, ...],
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 30.0,
    buffers: Mapping[str, Spec] | None = None,
) -> Plan:
    """The fastest plan for another graph of a model whose parameters are already stored as `params` say
    (another plan's decisions): each parameter keeps its storage spec (used as that plan uses it where an
    option gathers it so, else as stored), each buffer its spec in `buffers` (by FQN; replicated if not
    there), every other node is free, nothing is recomputed. A `ParallelModule` plans so the graphs it
    traces with other ops than its plan's (eval mode, autocast, code that depends on the sizes)."""
    pins = {p.fqn: p for p in params}
    missing = sorted(set(traced.param_fqns.values()) - set(pins))
    if missing:
        raise AutoparError(f"the graph reads parameters the plan does not store: {missing[:5]}")
    held = {fqn: (buffers or {}).get(fqn, Spec.replicate(len(mesh.shape))) for fqn in traced.buffer_fqns.values()}
    budget = budget_of(mesh, memory_budget_bytes)
    built = build_for(traced, profile, mesh, budget)
    restrictions = _keeping(traced, built, pins, held)
    if isinstance(restrictions, str):  # repeated layers tied into one class are stored differently: one by one
        built = build_for(traced, profile, mesh, budget, grouped=False)
        restrictions = _keeping(traced, built, pins, held)
    if isinstance(restrictions, str):
        stored = pins[restrictions].storage if restrictions in pins else held[restrictions]
        raise AutoparError(f"no strategy of this graph reads {restrictions!r} as it is stored "
                           f"({stored}); parallelize again with a sample of these inputs")
    sol = solve_problem(built.problem, time_limit_s, restrictions=restrictions, or_leanest=True)  # over budget: the leanest
    return to_plan(traced, mesh, built, sol)


def _keeping(traced: TracedGraph, built: BuiltProblem, pins: Mapping[str, ParamDecision],
             held: Mapping[str, Spec]) -> Restrictions | str:
    """Restrictions holding every parameter of `traced` to its pinned storage and every buffer to its `held`
    spec (or the FQN of one that a problem node standing for it cannot hold so). A parameter is used as pinned
    (gathered from its ZeRO storage where it has one) when one of the node's options makes that storage, else
    it is used as stored."""
    g = built.grouping
    allowed, zero = {}, {}
    for v, node in enumerate(built.problem.nodes):
        leaders = [g.clusters[c].leader for c in g.classes[v]]
        members = [(n, pins[traced.param_fqns[n]]) for n in leaders if n in traced.param_fqns]
        buffers = [(n, held[traced.buffer_fqns[n]]) for n in leaders if n in traced.buffer_fqns]
        if not (members or buffers):
            continue

        def output_is(s: int, pinned: list[tuple[str, Spec]]) -> bool:
            return all(built.strategies[n][built.member_strategy(n, s)].output_specs[0] == spec for n, spec in pinned)

        def as_planned(s: int) -> bool:
            for n, p in members:
                k = built.member_strategy(n, s)
                if built.strategies[n][k].output_specs[0] != p.use or (p.zero and built.storage.get((n, k)) != p.storage):
                    return False
            return True

        # a buffer placeholder's output is the buffer as the module holds it
        options = [s for s in range(len(node.options)) if output_is(s, buffers)]
        planned = frozenset(filter(as_planned, options)) if len({p.zero for _, p in members}) == 1 else frozenset()
        stored = [(n, p.storage) for n, p in members]
        allowed[v], zero[v] = (planned, members[0][1].zero) if planned else (frozenset(s for s in options if output_is(s, stored)), False)
        if not allowed[v]:
            return members[0][1].fqn if members else traced.buffer_fqns[buffers[0][0]]
    return Restrictions(allowed, recompute="never", zero_nodes=zero)
