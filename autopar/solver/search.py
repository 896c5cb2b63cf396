"""Top-level solving: one mesh (`solve`), every shape of N devices (`solve_for_devices`), fixed plans and baselines.

    plan = solve(traced, profile(traced), make_mesh(4, (2, 2)), memory_budget_bytes=40 * 2**30)
    plan, per_shape = solve_for_devices(traced, profile(traced), 8)   # tries (8,), (2, 4), (4, 2)

`fixed_plan` and the baselines price given assignments with the same cost model,
so the ILP's plan can be compared with pure data parallel, ZeRO-3/FSDP and
Megatron tensor parallel + data parallel on equal terms.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

from autopar.errors import AutoparError, InfeasibleError
from autopar.profiler.profile import optimizer_cost
from autopar.profiler.types import ConcreteProfile, GraphProfile
from autopar.solver.comm_volume import comm_bytes_by_kind
from autopar.solver.ilp import Restrictions, Solution, evaluate, solve_problem
from autopar.solver.mesh import Mesh, Precision, candidate_shapes, make_mesh
from autopar.solver.notes import plan_notes
from autopar.solver.plan import BaselineResult, NodeDecision, ParamDecision, Plan, SolverReport
from autopar.solver.problem import Assignment, BuiltProblem, build_problem
from autopar.solver.spec import Replicate, Spec, Strategy
from autopar.solver.strategies import enumerate_strategies
from autopar.solver.plan_io import fingerprint
from autopar.solver.timeline import memory_timeline
from autopar.tracer import TracedGraph, module_path, tensor_args
from autopar.tracer.param_layouts import param_layouts

log = logging.getLogger(__name__)

BASELINES = ("data_parallel", "zero3", "megatron")


@dataclass(frozen=True)
class ShapeResult:
    """What one logical mesh shape would give: its best plan's predicted step time, or why it has none."""

    shape: tuple[int, ...]
    step_s: float | None
    memory_bytes: float | None
    error: str = ""  # set when no plan fits this shape


def _concrete(profile: GraphProfile | ConcreteProfile, sizes: Mapping[str, int] | None) -> ConcreteProfile:
    return profile.evaluate(**(sizes or {})) if isinstance(profile, GraphProfile) else profile


def _build(traced, profile, mesh, budget, sizes, grouped: bool = True) -> BuiltProblem:
    strategies = enumerate_strategies(traced, mesh)
    return build_problem(traced, _concrete(profile, sizes), mesh, strategies, budget, grouped=grouped)


def _budget(mesh: Mesh, memory_budget_bytes: float | None) -> float:
    """What the step's tensors may hold: the device's memory less its fixed overheads (`Mesh.overhead_bytes`),
    unless the caller names a budget (for the tensors: what `torch.cuda.max_memory_allocated` measures)."""
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
            params.append(ParamDecision(fqn, node.name, use, storage, layouts[fqn]))
    plan = Plan(fingerprint(traced, mesh, built.problem.budget_bytes), mesh, tuple(nodes), tuple(params),
                sol.memory, sol.time, sol.report, notes=plan_notes(traced, mesh),
                memory_timeline=memory_timeline(traced, built, a, sol.memory))
    return dataclasses.replace(plan, comm_bytes_by_kind=comm_bytes_by_kind(traced, plan, built.summed_per_computed))



def solve(
    traced: TracedGraph,
    profile: GraphProfile | ConcreteProfile,
    mesh: Mesh,
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 30.0,
    backend: Literal["highs", "cbc"] = "highs",
    sizes: Mapping[str, int] | None = None,
    baselines: bool = False,
) -> Plan:
    """The fastest plan on `mesh` within the budget (default: the device memory); with `baselines`, the
    textbook plans priced on the same problem too (`Plan.baselines`)."""
    plan, built = _solve_built(traced, profile, mesh, memory_budget_bytes, time_limit_s, backend, sizes)
    return _with_baselines(plan, traced, profile, built, time_limit_s) if baselines else plan


def _solve_built(traced, profile, mesh, memory_budget_bytes, time_limit_s, backend, sizes) -> tuple[Plan, BuiltProblem]:
    """`solve`'s plan and the problem it solved (which the baselines are priced on)."""
    start = time.perf_counter()
    built = _build(traced, profile, mesh, _budget(mesh, memory_budget_bytes), sizes)
    log.debug("solver: problem built in %.2f s (%d graph nodes -> %d problem nodes)",
              time.perf_counter() - start, built.num_graph_nodes, len(built.problem.nodes))
    restrictions = Restrictions()
    if optimizer_cost(profile.optimizer).whole_params:
        # its update reads whole parameters (`OptimizerCost.whole_params`): each is used and stored whole, so
        # its gradient is summed whole on every rank; activations may still be split
        restrictions = Restrictions(_params_allowed(traced, built, Spec.is_replicate), zero="never")
    return to_plan(traced, mesh, built, solve_problem(built.problem, time_limit_s, backend, restrictions=restrictions)), built


def _with_baselines(plan: Plan, traced, profile, built: BuiltProblem, time_limit_s: float) -> Plan:
    return dataclasses.replace(plan, baselines=baseline_plans(
        traced, profile, plan.mesh, built.problem.budget_bytes, time_limit_s, built=built))


def solve_for_devices(
    traced: TracedGraph,
    profile: GraphProfile | ConcreteProfile,
    num_devices: int,
    hardware: str = "h100",
    memory_budget_bytes: float | None = None,
    time_limit_s: float = 30.0,
    backend: Literal["highs", "cbc"] = "highs",
    sizes: Mapping[str, int] | None = None,
    baselines: bool = False,
    precision: Precision | None = None,
) -> tuple[Plan, list[ShapeResult]]:
    """Try every logical shape of `num_devices` devices; keep the fastest plan (`baselines`: priced on its shape;
    `precision`: the math mode of its float32 matmuls, `make_mesh`'s)."""
    best: Plan | None = None
    best_built: BuiltProblem | None = None
    results: list[ShapeResult] = []
    smallest: InfeasibleError | None = None
    for shape in candidate_shapes(num_devices):
        mesh = make_mesh(num_devices, shape, hardware, precision=precision)
        try:
            plan, built = _solve_built(traced, profile, mesh, memory_budget_bytes, time_limit_s, backend, sizes)
        except InfeasibleError as err:
            results.append(ShapeResult(shape, None, err.min_memory_bytes, str(err)))
            if smallest is None or (err.min_memory_bytes or 0) < (smallest.min_memory_bytes or 0):
                smallest = err
            continue
        results.append(ShapeResult(shape, plan.time.total_s, plan.memory.total_bytes))
        if best is None or plan.time.total_s < best.time.total_s - 1e-12:
            best, best_built = plan, built
        del built  # a large problem's strategies and rows: one kept at a time
    for r in results:
        log.info("solver: mesh %s: %s", "x".join(map(str, r.shape)),
                 f"{r.step_s * 1e3:.1f} ms" if r.step_s is not None else "no plan fits")
    if best is None:
        assert smallest is not None
        raise smallest
    if baselines:
        best = _with_baselines(best, traced, profile, best_built, time_limit_s)
    return best, results


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
    built = _build(traced, profile, mesh, memory_budget_bytes, sizes, grouped=False)
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
    budget = _budget(mesh, memory_budget_bytes)
    built = _build(traced, profile, mesh, budget, None)
    restrictions = _keeping(traced, built, pins, held)
    if isinstance(restrictions, str):  # repeated layers tied into one class are stored differently: one by one
        built = _build(traced, profile, mesh, budget, None, grouped=False)
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


def splits_batch(strategy: Strategy) -> bool:
    """The strategy's first output is split (sharded or partial) over the data-parallel (first) mesh axis."""
    return bool(strategy.output_specs) and not isinstance(strategy.output_specs[0].placements[0], Replicate)


def _param_rule(name: str, mesh: Mesh) -> Callable[[Spec], bool]:
    """Which use specs a baseline allows for parameters."""
    if name == "megatron":  # tensor parallel on the last (fastest) axis, replicated (data parallel) on the others
        return lambda spec: all(isinstance(p, Replicate) for p in spec.placements[:-1])
    return Spec.is_replicate  # data parallel and ZeRO-3: every parameter used whole


def _params_allowed(traced: TracedGraph, built: BuiltProblem, rule: Callable[[Spec], bool]) -> dict[int, frozenset[int]]:
    """Per problem node standing for a parameter, the options whose use of it `rule` allows."""
    allowed = {}
    for v in range(len(built.problem.nodes)):
        leader = built.grouping.clusters[built.grouping.classes[v][0]].leader
        if leader in traced.param_fqns:
            allowed[v] = frozenset(i for i, s in enumerate(built.strategies[leader]) if rule(s.output_specs[0]))
    return allowed


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
    """A textbook plan: the ILP restricted to the baseline's parameter specs and ZeRO rule (recompute allowed);
    where none fits the budget, its leanest form. `built`: the problem for this mesh and budget, when the
    caller prices several baselines (building it took 2.5-3 s of LLaMA-7B's)."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {BASELINES}")
    built = built or _build(traced, profile, mesh, _budget(mesh, memory_budget_bytes), sizes)
    rule = _param_rule(name, mesh)
    # data parallel and ZeRO-3 split the batch: every tensor carrying it is split over the first (data) axis,
    # or the cheapest "data parallel" plan may gather the batch and compute it whole on every rank
    batched = batch_dependent(traced) if name in ("data_parallel", "zero3") else frozenset()
    allowed = _params_allowed(traced, built, rule)
    for v, node in enumerate(built.problem.nodes):
        leader = built.grouping.clusters[built.grouping.classes[v][0]].leader
        if leader in batched:  # (parameters never carry the batch: `batch_dependent`)
            split = frozenset(i for i in range(len(node.options))
                              if splits_batch(built.strategies[leader][built.member_strategy(leader, i)]))
            if split:  # an op with no batch-split strategy stays free (and is priced as what it can do)
                allowed[v] = split
    restrictions = Restrictions(allowed, zero="always" if name == "zero3" else "never")
    sol = solve_problem(built.problem, time_limit_s, restrictions=restrictions, or_leanest=True)  # `fits` tells
    return to_plan(traced, mesh, built, sol)


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
    reads whole parameters (Adafactor, Muon) pure data parallel alone, the one of them it can step. `built`:
    the problem for this mesh and budget when the caller has it (`solve(..., baselines=True)`)."""
    budget = _budget(mesh, memory_budget_bytes)
    built = built or _build(traced, profile, mesh, budget, sizes)
    out = []
    for name in ("data_parallel",) if optimizer_cost(profile.optimizer).whole_params else BASELINES:
        plan = baseline_plan(traced, profile, mesh, name, budget, time_limit_s, sizes, built)
        out.append(BaselineResult(name, plan.time, plan.memory, plan.memory.total_bytes <= budget * (1 + 1e-9)))
    return tuple(out)
