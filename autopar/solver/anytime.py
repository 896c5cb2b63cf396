"""An anytime search on one `Problem`: a plan that fits first, faster ones while time remains.

    sol = solve_problem(problem, time_limit_s=30.0, starts=(leanest, textbook))

`time_limit_s` bounds the whole call; each step gets what is left of it:
1. The fastest plan without the memory row (fast where the edge polytope is nearly integral), from the fastest
   start: the answer when it fits and is proven optimal. With a budget it gets half the time, so that the steps
   below have some.
2. Valid starts: the caller's assignments that fit (a graph's search passes its textbook plans and the leanest
   plan it builds by construction, `search.py`), and step 1's sharding with recompute and ZeRO fitted to the
   budget (`fit_memory`: each node held to its option, a model of a few hundred binaries). Beside them the LP
   relaxation with the memory row: its bound, and its sharding rounded (each node at the option it weighs most)
   and fitted alike (`fit_memory`). When the fastest of these plans is within `mip_rel_gap` of that bound, it is the
   answer, proven: where the relaxation is tight (Qwen2- and Mixtral-tiny on 2x2 at 60% of their ample need)
   this skips step 3, whose presolve alone took seconds. Else the caller may improve the starts (`improve`).
3. The MIP with the memory row, from the fastest fitting start (a MIP start, `_Model.start_from`; the rounded LP
   plan only when nothing else fits): whatever it finds in the time left, the answer is at least as fast as that
   start and the rounded plan.
4. When no start fits, the least-memory search (`min_memory`) decides first: its plan fits (a start for step 3),
   or its bound is above the budget (`InfeasibleError`, proven), or neither: step 3 searches without a start and,
   finding nothing, raises `SearchTimeoutError` (an `InfeasibleError`) with the least need found.

With `settled_s` (a plan of that step or slower would not change the caller's choice: `search.solve` passes the
fastest fitting textbook plan's step over the robust margin, the textbook plan being chosen over any such plan),
step 2 ends once the relaxation's bound is at or above it, and step 3 once the MIP's bound is: what is left to
find would not be chosen (Hugging Face GPT-2 and BERT tiny on 2x2 at their tight budgets).

With `cutoff_s` (a plan of that step or slower is of no use to the caller: `search.solve_for_devices` passes what a
plan on a later mesh shape must beat to be chosen), the LP relaxation of the model with the memory row is solved
first: when its bound is at or above the cutoff, no plan can beat it and the search stops there (`Outpaced`).

The gap reported (`SolverReport.gap`) sets the answer's step time against the best bound any step proved: what
the plan is worth when the time limit stopped the search.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from autopar.errors import AutoparError
from autopar.gc_pause import gc_paused
from autopar.solver.clock import cpu_s
from autopar.solver.backends import Backend
from autopar.solver.ilp import DEFAULT_GAP, Outcome, Restrictions, Solution, _Model, relax, run
from autopar.solver.evaluate import evaluate
from autopar.solver.needs import infeasible_error, least_need_bytes, timeout_error
from autopar.solver.plan import SolverReport
from autopar.solver.problem import Assignment, Problem

log = logging.getLogger(__name__)

# The leanest form of a plan that does not fit its budget anyway (`solve_problem(or_leanest=True)`: a textbook
# baseline's need, a graph's plan over budget) is searched to within 1%: DeepSeek-V2-Lite's data-parallel and
# Megatron baselines on 4x2 found theirs in 11 and 22 s, 0.1-0.3% above what 30 s (the time limit) found.
PRICING_GAP = 1e-2
_MS = 1e3


class Outpaced(Exception):
    """No plan of the problem is faster than the cutoff the search was given: the LP relaxation proved it."""

    def __init__(self, bound_s: float, cutoff_s: float):
        super().__init__(f"no plan beats {cutoff_s * _MS:.1f} ms: the LP relaxation bounds the step at {bound_s * _MS:.1f} ms")
        self.bound_s = bound_s
        self.cutoff_s = cutoff_s


@dataclass(frozen=True)
class _Clock:
    """The end of the call's time limit."""

    end_s: float

    def left_s(self) -> float:
        return max(0.0, self.end_s - cpu_s())


def fits(problem: Problem, sol: Solution) -> bool:
    """Within the device budget, and the host tier within the host budget (none bounds a tier the caller forced)."""
    host_ok = problem.host_budget_bytes is None or sol.memory.host_bytes <= problem.host_budget_bytes
    return host_ok and (problem.budget_bytes is None or sol.memory.total_bytes <= problem.budget_bytes)


def priced(problem: Problem, a: Assignment, status: str = "start", backend: str = "none") -> Solution:
    """`a` priced by `evaluate`, as a Solution no solver ran for."""
    memory, step = evaluate(problem, a)
    return Solution(a, memory, step, SolverReport(backend, status, 0.0, 0, 0))


def _found(problem: Problem, model: _Model, out: Outcome, began: float) -> Solution:
    memory, step = evaluate(problem, a := model.assignment())
    report = SolverReport(out.backend, out.status, cpu_s() - began, len(model.variables),
                          len(model.prob.constraints), out.gap)
    return Solution(a, memory, step, report)


def _step_gap(step_s: float, bound_ms: float | None) -> float | None:
    """The relative gap between a plan's step and the best bound proved (None: within HiGHS' default gap; 1: no
    bound above 0 proved)."""
    if step_s <= 0:
        return None
    if bound_ms is None:
        return 1.0
    gap = min(1.0, 1.0 - bound_ms / (step_s * _MS))  # 1: the bound proves nothing (at or below 0)
    return gap if gap > DEFAULT_GAP else None


@gc_paused
def solve_problem(
    problem: Problem,
    time_limit_s: float = 30.0,
    backend: Backend = "highs",
    restrictions: Restrictions = Restrictions(),
    mip_rel_gap: float = DEFAULT_GAP,
    or_leanest: bool = False,
    starts: Sequence[Assignment] = (),
    bounded: bool = False,
    improve: Callable[[Sequence[Solution], float], Sequence[Solution]] | None = None,
    cutoff_s: float | None = None,
    settled_s: float | None = None,
) -> Solution:
    """The fastest assignment that fits the budget, found within `time_limit_s` in all (see the module docstring).
    `starts`: valid assignments the search starts from (the answer is at least as fast as the fastest that fits);
    `or_leanest`: over the budget, the leanest assignment instead of an error (how a textbook plan that does not
    fit is priced); `mip_rel_gap`: stop once the plan is provably within this fraction of the best possible step;
    `bounded`: a start that fits is given, search with the memory row at once (step 3 only: a small model's);
    `improve(fitting, seconds)`: more starts from the fitting ones, found in the seconds given, before step 3
    (a graph's search improves them one mesh axis at a time: `descent.py`); `cutoff_s`: stop with `Outpaced` when
    the LP relaxation proves no plan faster than this (see the module docstring); `settled_s`: no plan of this step
    or slower changes the caller's choice (a plan is in hand that the caller takes over any such plan): the search
    stops with its best plan, "optimal", once the relaxation or the MIP proves no plan faster than this."""
    began = cpu_s()
    clock = _Clock(began + time_limit_s)
    budget = problem.budget_bytes
    model = _Model(problem, restrictions, "time")
    relaxed = relax(model, backend, clock.left_s()) if cutoff_s is not None else None
    if relaxed is not None and relaxed.bound_s >= cutoff_s:
        raise Outpaced(relaxed.bound_s, cutoff_s)
    candidates = [priced(problem, a) for a in starts]
    bound = fastest = None
    if not (bounded and any(fits(problem, c) for c in candidates)):
        if candidates:  # the fastest start, fitting or not, is a start here too: the search may stop at its root
            model.start_from(min(candidates, key=lambda c: c.time.total_s).assignment)
        out = run(model, backend, clock.left_s() / 2 if budget is not None else clock.left_s(),
                  mip_rel_gap=mip_rel_gap, warm_start=bool(candidates))
        if out.status == "infeasible":  # not even without the budget: the restrictions leave nothing
            raise AutoparError("the restrictions leave no valid assignment at all; relax them")
        bound = out.bound
        fastest = _found(problem, model, out, began) if out.found else None
        if fastest is not None and fits(problem, fastest) and (out.status == "optimal" or budget is None):
            return _logged(fastest)
        if budget is None:  # nothing found without a budget in time
            raise timeout_error(time_limit_s, None, None, None)
    if fastest is not None:
        candidates.append(fastest)
        if not fits(problem, fastest):
            fitted = fit_memory(problem, fastest.assignment.choice, restrictions, backend, clock.left_s() / 4)
            candidates += [fitted] if fitted is not None else []
    rounded = None
    if budget is not None and not bounded:
        relaxed = relaxed or relax(model, backend, clock.left_s() / 2)
        tried = {c.assignment.choice for c in candidates if fits(problem, c)} | \
            ({fastest.assignment.choice} if fastest is not None else set())  # fitted already (`fit_memory` above)
        # the relaxation rounded: each node at the option it weighs most, recompute and ZeRO fitted to the budget
        rounded = fit_memory(problem, relaxed.choice, restrictions, backend, clock.left_s() / 4) \
            if relaxed is not None and relaxed.choice not in tried else None
        if relaxed is not None:
            bound = max(relaxed.objective, bound if bound is not None else relaxed.objective)
            best = min((c for c in [*candidates, rounded] if c is not None and fits(problem, c)),
                       key=lambda c: c.time.total_s, default=None)
            gap = _step_gap(best.time.total_s, bound) if best is not None else 1.0
            settled = settled_s is not None and relaxed.bound_s >= settled_s
            if best is not None and (gap is None or gap <= mip_rel_gap or settled):  # proven enough: no MIP with the row
                report = SolverReport(backend, "optimal", cpu_s() - began, len(model.variables),
                                      len(model.prob.constraints), gap)
                return _logged(replace(best, report=report))
    fitting = sorted((c for c in candidates if fits(problem, c)), key=lambda c: c.time.total_s)
    if improve is not None and fitting:
        candidates += [c for c in improve(fitting, clock.left_s() / 2) if fits(problem, c)]
    # the rounded plan starts the MIP only when nothing else fits: from it HiGHS went elsewhere (Llama tiny on 2x2 at
    # 60%: 67.5 ms at the time limit, against 60.1 ms proven in 12 CPU-s from the other starts); it is kept as an answer
    best = min((c for c in candidates if fits(problem, c)), key=lambda c: c.time.total_s, default=rounded)
    leanest = None
    if best is None:
        start = min((c.assignment for c in candidates), key=lambda a: evaluate(problem, a)[0].total_bytes, default=None)
        leanest = min_memory(problem, clock.left_s() / 2, backend, restrictions,
                             PRICING_GAP if or_leanest else DEFAULT_GAP, start=start)
        if fits(problem, leanest):
            best = replace(leanest, report=replace(leanest.report, status="leanest"))
        elif least_need_bytes(leanest.memory.total_bytes, leanest.report.gap) > budget:  # proven: none fits
            if or_leanest:
                return leanest
            raise infeasible_error(leanest.memory, budget, leanest.report.gap)
    model.add_memory_limit()
    if best is not None:
        model.start_from(best.assignment)
    if best is not None and clock.left_s() <= 0:
        # the time is up with a plan that fits in hand: HiGHS' presolve, which its interrupt does not reach, would
        # run seconds past the limit on a large model to take the start back (LLaMA-7B on 2x4: 3.1 s, 66k columns)
        out = Outcome("none", backend, 0.0, None)
    else:
        out = run(model, backend, clock.left_s(), presolve=True, mip_rel_gap=mip_rel_gap, warm_start=best is not None,
                  settled_s=settled_s if best is not None else None)
    if out.status == "infeasible":  # proven: no plan needs as little
        leanest = leanest or min_memory(problem, max(clock.left_s(), time_limit_s / 4), backend, restrictions,
                                        PRICING_GAP if or_leanest else DEFAULT_GAP)
        if or_leanest:
            return leanest
        raise infeasible_error(leanest.memory, budget, leanest.report.gap, proven=True)
    bound = max((b for b in (bound, out.bound) if b is not None), default=None)  # each a lower bound of the step
    found = _found(problem, model, out, began) if out.found else None
    if found is not None and fits(problem, found) and (best is None or found.time.total_s <= best.time.total_s * (1 + 1e-9)):
        best = found
    if rounded is not None and best is not None and rounded.time.total_s < best.time.total_s:
        best = rounded
    if best is None:
        if or_leanest and leanest is not None:
            return leanest
        raise timeout_error(time_limit_s, budget, leanest.memory if leanest else None, leanest.report.gap if leanest else None)
    # proven optimal (within mip_rel_gap) when the search within the budget proved its plan so: the answer is that
    # plan or the rounded LP plan, faster still
    if out.status == "optimal" and found is not None and fits(problem, found):
        status = "optimal"
    else:
        status = "leanest" if best.report.status == "leanest" else "time_limit"
        log.info("solver: in time_limit_s=%g the search found a plan within the budget (est. step %.1f ms%s) without "
                    "proving it within %.0f%% of the best; more time may find a faster one", time_limit_s,
                    best.time.total_s * 1e3, ", the leanest" if status == "leanest" else "", 100 * mip_rel_gap)
    report = SolverReport(out.backend, status, cpu_s() - began, len(model.variables), len(model.prob.constraints),
                          _step_gap(best.time.total_s, bound))
    return _logged(replace(best, report=report))


def _logged(sol: Solution) -> Solution:
    r = sol.report
    gap = f" (gap {r.gap:.2%})" if r.gap is not None else ""
    log.info("solver: %s vars, %s in %.1f s%s, est. step %.0f ms", f"{r.num_variables:,}", r.status, r.solve_s, gap,
             sol.time.total_s * 1e3)
    return sol


@gc_paused
def fit_memory(problem: Problem, choice: Sequence[int], restrictions: Restrictions = Restrictions(),
               backend: Backend = "highs", time_limit_s: float = 30.0) -> Solution | None:
    """The fastest recompute and ZeRO decisions within the budget for the options `choice` (each node held to its
    own); None when none fit, or none was found in time."""
    held = replace(restrictions, allowed={v: frozenset({c}) for v, c in enumerate(choice)})
    began = cpu_s()
    model = _Model(problem, held, "time")
    model.add_memory_limit()
    out = run(model, backend, time_limit_s, presolve=True)
    return _found(problem, model, out, began) if out.found else None


@gc_paused
def min_memory(
    problem: Problem, time_limit_s: float = 30.0, backend: Backend = "highs", restrictions: Restrictions = Restrictions(),
    mip_rel_gap: float = DEFAULT_GAP, start: Assignment | None = None,
) -> Solution:
    """The assignment with the least per-device memory (ignores the budget and the time); `mip_rel_gap`: stop
    once it is provably within this fraction of the least; `start`: a valid assignment to start from, the answer
    when nothing leaner is found in time (its gap against the bound proved)."""
    began = cpu_s()
    model = _Model(problem, restrictions, "memory")
    if start is not None:
        model.start_from(start)
    out = run(model, backend, time_limit_s, mip_rel_gap=mip_rel_gap, warm_start=start is not None)
    if out.status == "infeasible":
        raise AutoparError("the restrictions leave no valid assignment at all; relax them")
    if out.found:
        return _found(problem, model, out, began)
    if start is None:
        raise timeout_error(time_limit_s, problem.budget_bytes, None, None)
    sol = priced(problem, start, "time_limit", out.backend)
    units = sol.memory.total_bytes * model.per_byte
    gap = 1.0 if out.bound is None or units <= 0 else max(0.0, 1.0 - out.bound / units)  # 1: nothing proven
    return replace(sol, report=replace(sol.report, gap=gap, solve_s=cpu_s() - began))
