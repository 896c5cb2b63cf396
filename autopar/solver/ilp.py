"""The joint ILP: sharding strategy, ZeRO storage and recomputation under a memory budget.

Variables (per problem node v, option s; edge k from u to v; option classes a, b):
  x[v,s] in {0,1}   v runs option s
  e[k,a,b] in [0,1] u's option is in class a and v's in class b (continuous: forced
                    integral by the equalities below once x is integral)
  y[v,s] in {0,1}   v runs s and its saved activations are recomputed
  z[v,s] in {0,1}   v (a parameter) runs s and is stored ZeRO-sharded
  T >= 0            the largest transient (temporary or gathered parameter)

Constraint families (each PuLP constraint is named after its family):
  onehot_{v}          sum_s x[v,s] = 1                              (`_add_strategy_vars`)
  edge_src_{k}_{a}    sum_b e[k,a,b] = sum_{s in a} x[u,s]           (`_add_edges`: the equality
  edge_dst_{k}_{b}    sum_a e[k,a,b] = sum_{s in b} x[v,s]            form, not McCormick products)
  recompute_{v}_{s}   y[v,s] <= x[v,s]                               (`_add_recompute`)
  zero_{v}_{s}        z[v,s] <= x[v,s]  (= under restriction "always") (`_add_zero`)
  temp_{v}            T >= sum_s temp[v,s] x[v,s]                    (`_add_memory`)
  gather_{v}_{s}      T >= gathered[v,s] z[v,s]
  memory              sum_{v,s} static[v,s] x - (1 - 1/f[v,s]) static[v,s] z
                      + saved[v,s] (x - y) + T <= budget             (`_add_memory`)
Objective (time of one step):
  sum (compute + comm)[v,s] x + zero_comm[v,s] z + recompute[v,s] y + sum cost[k,a,b] e[k,a,b]
  + 1 us per GiB of the memory expression (a tie-break: equally fast plans -> the leaner one)
For the infeasible report the same model minimises the memory expression instead.

Times are entered in milliseconds and bytes in GiB so coefficients stay near 1
for the solver's tolerances; everything outside this module is seconds/bytes.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal, Mapping

import pulp

from autopar.errors import AutoparError, InfeasibleError
from autopar.gc_pause import gc_paused
from autopar.solver.plan import MemoryBreakdown, SolverReport, TimeBreakdown
from autopar.solver.problem import Assignment, Problem

log = logging.getLogger(__name__)

_MS = 1e3
_GIB = float(2**30)
# Tie-break: among equally fast plans prefer the leaner one (1 us per GiB: far below any real time difference).
_TIE_MS_PER_GIB = 1e-3
Backend = Literal["highs", "cbc"]


@dataclass(frozen=True)
class Restrictions:
    """Narrowing of the search, used for baselines (pure DP, FSDP, Megatron) and fixed plans."""

    allowed: Mapping[int, frozenset[int]] = field(default_factory=dict)  # node -> option indices it may take
    zero: Literal["free", "never", "always"] = "free"  # "always": every param with a ZeRO option uses it
    recompute: Literal["free", "never"] = "free"


@dataclass(frozen=True)
class Solution:
    assignment: Assignment
    memory: MemoryBreakdown
    time: TimeBreakdown
    report: SolverReport


def evaluate(problem: Problem, a: Assignment) -> tuple[MemoryBreakdown, TimeBreakdown]:
    """Price an assignment with the same model the ILP optimises (independent of PuLP)."""
    compute_s = comm_s = recompute_s = 0.0
    params = grads = opt = act = temp = 0.0
    for v, node in enumerate(problem.nodes):
        o = node.options[a.choice[v]]
        compute_s += o.compute_s
        comm_s += o.comm_s
        factor = 1
        if a.zero[v]:
            if o.zero is None:
                raise ValueError(f"node {node.name!r} option {o.label} cannot be ZeRO-sharded (no replicated axis divides it)")
            factor = o.zero.factor
            comm_s += o.zero.comm_s
            temp = max(temp, o.zero.gathered_bytes)
        params += o.param_bytes / factor
        grads += o.grad_bytes / factor
        opt += o.optimizer_bytes / factor
        if a.recompute[v]:
            if not node.recomputable:
                raise ValueError(f"node {node.name!r} cannot be recomputed (a placeholder, or it saves nothing)")
            recompute_s += o.recompute_s
        else:
            act += o.saved_bytes
        temp = max(temp, o.temp_bytes)
    for e in problem.edges:
        comm_s += e.cost(a.choice[e.src], a.choice[e.dst])
    return (
        MemoryBreakdown(params, grads, opt, act, temp, problem.budget_bytes),
        TimeBreakdown(compute_s, comm_s, recompute_s),
    )


def _affine(terms: list[tuple[pulp.LpVariable, float]]) -> pulp.LpAffineExpression:
    """Sum of coefficient * variable; a variable may appear several times (LpAffineExpression keeps only the last)."""
    total: dict[pulp.LpVariable, float] = {}
    for var, coef in terms:
        total[var] = total.get(var, 0.0) + coef
    return pulp.LpAffineExpression(list(total.items()))


class _Model:
    """The PuLP model of one Problem; `objective` picks time (the plan) or memory (the infeasible report)."""

    def __init__(self, problem: Problem, restrictions: Restrictions, objective: Literal["time", "memory"]):
        self.problem = problem
        self.restrictions = restrictions
        self.prob = pulp.LpProblem(f"autopar_{objective}", pulp.LpMinimize)
        self.time_terms: list[tuple[pulp.LpVariable, float]] = []
        self.memory_terms: list[tuple[pulp.LpVariable, float]] = []
        self._add_strategy_vars()
        self._add_edges()
        self._add_recompute()
        self._add_zero()
        self._add_memory(objective == "time")
        if objective == "time":
            terms = self.time_terms + [(var, c * _TIE_MS_PER_GIB) for var, c in self.memory_terms]
        else:
            terms = self.memory_terms
        self.prob += _affine(terms), "objective"

    def _add_strategy_vars(self) -> None:
        self.x = []
        for v, node in enumerate(self.problem.nodes):
            allowed = self.restrictions.allowed.get(v)
            if allowed is not None and not allowed:
                raise ValueError(f"restrictions leave node {node.name!r} no option")
            xs = []
            for s, o in enumerate(node.options):
                # LpBinary would reset the bounds: a 0/1 integer whose upper bound 0 rules the option out.
                ub = 1 if allowed is None or s in allowed else 0
                var = pulp.LpVariable(f"x_{v}_{s}", lowBound=0, upBound=ub, cat=pulp.LpInteger)
                xs.append(var)
                self.time_terms.append((var, (o.compute_s + o.comm_s) * _MS))
                self.memory_terms.append((var, (o.static_bytes + o.saved_bytes) / _GIB))
            self.prob += pulp.lpSum(xs) == 1, f"onehot_{v}"
            self.x.append(xs)

    def _add_edges(self) -> None:
        for k, e in enumerate(self.problem.edges):
            if not any(c for row in e.cost_s for c in row):
                continue  # free in every combination: no variables needed
            rows, cols = len(e.cost_s), len(e.cost_s[0])
            ev = [[pulp.LpVariable(f"e_{k}_{a}_{b}", lowBound=0, upBound=1) for b in range(cols)] for a in range(rows)]
            for a in range(rows):
                members = [self.x[e.src][s] for s, c in enumerate(e.src_class) if c == a]
                self.prob += pulp.lpSum(ev[a]) == pulp.lpSum(members), f"edge_src_{k}_{a}"
            for b in range(cols):
                members = [self.x[e.dst][s] for s, c in enumerate(e.dst_class) if c == b]
                self.prob += pulp.lpSum(ev[a][b] for a in range(rows)) == pulp.lpSum(members), f"edge_dst_{k}_{b}"
            self.time_terms.extend((ev[a][b], e.cost_s[a][b] * _MS) for a in range(rows) for b in range(cols) if e.cost_s[a][b])

    def _add_recompute(self) -> None:
        self.y: dict[tuple[int, int], pulp.LpVariable] = {}
        if self.restrictions.recompute == "never":
            return
        for v, node in enumerate(self.problem.nodes):
            if not node.recomputable:
                continue
            for s, o in enumerate(node.options):
                if o.saved_bytes <= 0:
                    continue  # recomputing frees nothing: pointless
                y = pulp.LpVariable(f"y_{v}_{s}", cat=pulp.LpBinary)
                self.prob += y <= self.x[v][s], f"recompute_{v}_{s}"
                self.y[v, s] = y
                self.time_terms.append((y, o.recompute_s * _MS))
                self.memory_terms.append((y, -o.saved_bytes / _GIB))

    def _add_zero(self) -> None:
        self.z: dict[tuple[int, int], pulp.LpVariable] = {}
        if self.restrictions.zero == "never":
            return
        for v, node in enumerate(self.problem.nodes):
            for s, o in enumerate(node.options):
                if o.zero is None or o.zero.factor <= 1:
                    continue
                z = pulp.LpVariable(f"z_{v}_{s}", cat=pulp.LpBinary)
                if self.restrictions.zero == "always":
                    self.prob += z == self.x[v][s], f"zero_{v}_{s}"
                else:
                    self.prob += z <= self.x[v][s], f"zero_{v}_{s}"
                self.z[v, s] = z
                self.time_terms.append((z, o.zero.comm_s * _MS))
                self.memory_terms.append((z, -(1 - 1 / o.zero.factor) * o.static_bytes / _GIB))

    def _add_memory(self, bounded: bool) -> None:
        self.temp = pulp.LpVariable("T", lowBound=0)
        self.memory_terms.append((self.temp, 1.0))
        for v, node in enumerate(self.problem.nodes):
            if any(o.temp_bytes > 0 for o in node.options):
                terms = [(self.x[v][s], o.temp_bytes / _GIB) for s, o in enumerate(node.options) if o.temp_bytes > 0]
                self.prob += self.temp >= pulp.LpAffineExpression(terms), f"temp_{v}"
        for (v, s), z in self.z.items():
            self.prob += self.temp >= z * (self.problem.nodes[v].options[s].zero.gathered_bytes / _GIB), f"gather_{v}_{s}"
        if bounded and self.problem.budget_bytes is not None:
            self.prob += _affine(self.memory_terms) <= self.problem.budget_bytes / _GIB, "memory"

    def assignment(self) -> Assignment:
        choice = tuple(max(range(len(xs)), key=lambda s: xs[s].varValue or 0.0) for xs in self.x)
        recompute = tuple((self.y.get((v, c)) is not None and (self.y[v, c].varValue or 0) > 0.5) for v, c in enumerate(choice))
        zero = tuple((self.z.get((v, c)) is not None and (self.z[v, c].varValue or 0) > 0.5) for v, c in enumerate(choice))
        return Assignment(choice, recompute, zero)


def _solver(backend: Backend, time_limit_s: float) -> tuple[pulp.LpSolver, str]:
    if backend == "highs":
        # One thread: deterministic. Presolve off: on our models it removes <1% of rows yet took
        # 60-70% of the solve (GPT-2 small on 2x2: 0.47 -> 0.16 s; GPT-3 175B shape on 8x8 with
        # memory binding: 2.3 -> 2.2 s, unconstrained 1.3 -> 0.9 s; same optima).
        highs = pulp.HiGHS(msg=False, timeLimit=time_limit_s, threads=1, random_seed=0, presolve="off")
        if highs.available():
            return highs, "highs"
        log.warning("solver: highspy is not importable; falling back to CBC (pip install highspy)")
    elif backend != "cbc":
        raise ValueError(f"unknown ILP backend {backend!r}; use 'highs' or 'cbc'")
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=1), "cbc"


def _run(model: _Model, backend: Backend, time_limit_s: float) -> tuple[str, str, float, float | None]:
    """Solve; returns (status, backend used, seconds, gap). Raises on no solution."""
    solver, used = _solver(backend, time_limit_s)
    start = time.perf_counter()
    model.prob.solve(solver)
    solve_s = time.perf_counter() - start
    sol = model.prob.sol_status
    if sol == pulp.LpSolutionOptimal:
        return "optimal", used, solve_s, None
    if sol == pulp.LpSolutionIntegerFeasible:  # stopped by the time limit with a plan in hand
        gap = model.prob.solverModel.getInfo().mip_gap if used == "highs" else None
        return "time_limit", used, solve_s, gap
    if sol == pulp.LpSolutionInfeasible:
        return "infeasible", used, solve_s, None
    raise AutoparError(
        f"the ILP found no plan within time_limit_s={time_limit_s:g} ({used}, status {pulp.LpStatus[model.prob.status]}); "
        "raise time_limit_s"
    )


@gc_paused
def solve_problem(
    problem: Problem,
    time_limit_s: float = 30.0,
    backend: Backend = "highs",
    restrictions: Restrictions = Restrictions(),
) -> Solution:
    """The fastest assignment that fits the budget; InfeasibleError (with the minimum) when none does."""
    model = _Model(problem, restrictions, "time")
    status, used, solve_s, gap = _run(model, backend, time_limit_s)
    if status == "infeasible":
        raise _infeasible(problem, time_limit_s, backend, restrictions)
    a = model.assignment()
    memory, step = evaluate(problem, a)
    report = SolverReport(used, status, solve_s, len(model.prob.variables()), len(model.prob.constraints), gap)
    gap_text = f" (gap {gap:.2%})" if gap is not None else ""
    log.info(
        "solver: %s vars, %s in %.1f s%s, est. step %.0f ms",
        f"{report.num_variables:,}", status, solve_s, gap_text, step.total_s * 1e3,
    )
    return Solution(a, memory, step, report)


@gc_paused
def min_memory(
    problem: Problem, time_limit_s: float = 30.0, backend: Backend = "highs", restrictions: Restrictions = Restrictions()
) -> Solution:
    """The assignment with the least per-device memory (ignores the budget and the time)."""
    model = _Model(problem, restrictions, "memory")
    status, used, solve_s, gap = _run(model, backend, time_limit_s)
    if status == "infeasible":
        raise AutoparError("the restrictions leave no valid assignment at all; relax them")
    a = model.assignment()
    memory, step = evaluate(problem, a)
    return Solution(a, memory, step, SolverReport(used, status, solve_s, len(model.prob.variables()), len(model.prob.constraints), gap))


def _gib(n: float) -> str:
    return f"{n / _GIB:.1f} GiB"


def _infeasible(problem: Problem, time_limit_s: float, backend: Backend, restrictions: Restrictions) -> InfeasibleError:
    best = min_memory(problem, time_limit_s, backend, restrictions).memory
    parts = {
        "parameters": best.params_bytes,
        "gradients": best.grads_bytes,
        "optimizer state": best.optimizer_bytes,
        "saved activations": best.activations_bytes,
        "largest temporary": best.temp_bytes,
    }
    name, size = max(parts.items(), key=lambda kv: kv[1])
    return InfeasibleError(
        f"no plan fits: needs {_gib(best.total_bytes)} per device ({name} {_gib(size)}); "
        f"budget {_gib(problem.budget_bytes or 0)}; raise --memory or use more devices",
        min_memory_bytes=best.total_bytes,
    )
