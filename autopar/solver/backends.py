"""The ILP backends: HiGHS (through highspy) by default, CBC as the fallback.

pulp drives both; this module only adds what pulp 3.3 lacks for HiGHS: a bulk model transfer, a MIP start,
and a solver that prints nothing.
"""
from __future__ import annotations

import logging
import math
from typing import Literal

import numpy as np
import pulp

from autopar.solver.clock import cpu_s

try:
    import highspy
except ImportError:  # CBC is the fallback (see `make_solver`)
    highspy = None

log = logging.getLogger(__name__)

# HiGHS 1.16 names it resetThreadScheduler; older releases within `highspy>=1.7` have resetGlobalScheduler
_reset_scheduler = None if highspy is None else (
    getattr(highspy.Highs, "resetThreadScheduler", None) or highspy.Highs.resetGlobalScheduler)
# the points at which HiGHS asks whether to stop: inside simplex, interior point and branch and bound
_INTERRUPTS = () if highspy is None else tuple(getattr(highspy.cb.HighsCallbackType, name) for name in (
    "kCallbackSimplexInterrupt", "kCallbackIpmInterrupt", "kCallbackMipInterrupt"))
_MIP_INTERRUPT = None if highspy is None else highspy.cb.HighsCallbackType.kCallbackMipInterrupt
# HiGHS' own limit, in wall seconds, a safety beside the CPU limit should the callback not be reached: this many
# times it, and this much more (the 2-core test machines have run a solve at 1/16 of a core)
_WALL_PER_CPU = 30.0
_WALL_EXTRA_S = 60.0

Backend = Literal["highs", "cbc"]

if highspy is not None:
    class _SilentFromBirth(highspy.Highs.__base__):
        """Turns HiGHS' output off right after its C++ object exists. `highspy.Highs.__init__` then registers
        its callback with a HiGHS call, which (output still on, HiGHS' default) printed the version banner
        to stdout on every solve: inside `autopar plan`'s report and once per rank per `parallelize`."""

        def __init__(self) -> None:
            super().__init__()
            self.setOptionValue("output_flag", False)

    class _QuietHighs(highspy.Highs, _SilentFromBirth):
        """`highspy.Highs`, whose `super().__init__()` now runs `_SilentFromBirth`'s first (the MRO puts it
        between `Highs` and the C++ base)."""


class BulkHighs(pulp.HiGHS):
    """pulp's HiGHS class, silent, handing the model over in bulk, a MIP start when `warm_start` is set (the
    variables given an initial value, `LpVariable.setInitialValue`, which HiGHS completes: pulp 3.3 has no MIP
    start for HiGHS), and a limit in CPU seconds (`cpu_limit_s`, the solver's clock: `clock.py`), which HiGHS'
    own limit, in wall seconds, is not: a callback interrupts it (HiGHS calls it between simplex iterations and
    MIP nodes: seen 1-1.6 s late on a model of 65k columns). `stop_at_bound`: the same callback stops the search
    once its proven bound reaches this objective (the caller's choice no longer depends on a better plan)."""

    def __init__(self, *args, warm_start: bool = False, cpu_limit_s: float | None = None,
                 stop_at_bound: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.warm_start = warm_start
        self.cpu_limit_s = cpu_limit_s
        self.stop_at_bound = stop_at_bound

    def createAndConfigureSolver(self, lp: pulp.LpProblem) -> None:
        """pulp's, on a `_QuietHighs` (pulp makes a plain `highspy.Highs`, which prints its banner), with the
        options `make_solver` passes."""
        lp.solverModel = _QuietHighs()
        options = {"mip_rel_gap": self.gapRel, "mip_abs_gap": self.gapAbs, "threads": self.threads,
                   "time_limit": None if self.timeLimit is None else float(self.timeLimit), **self.optionsDict}
        for name, value in options.items():
            if value is not None:
                lp.solverModel.setOptionValue(name, value)

    def callSolver(self, lp: pulp.LpProblem) -> None:
        # HiGHS keeps one thread scheduler per process, made by the first solve with that solve's thread count:
        # after any HiGHS run with another count in this process (pulp's own HiGHS class defaults to the cores),
        # a solve asking for one thread refused to start ("the scheduler has already been initialized") and the
        # caller saw "no plan in time". Made again for this solve's count (cheap: one thread has no workers).
        _reset_scheduler(True)
        if self.cpu_limit_s is not None:
            deadline_s = cpu_s() + self.cpu_limit_s
            stop_at = math.inf if self.stop_at_bound is None else self.stop_at_bound

            def interrupt(kind, message, data_out, data_in, user_data) -> None:
                bound_reached = kind == _MIP_INTERRUPT and data_out.mip_dual_bound >= stop_at
                if bound_reached or cpu_s() > deadline_s:
                    data_in.user_interrupt = True

            lp.solverModel.setCallback(interrupt, None)
            for kind in _INTERRUPTS:
                lp.solverModel.startCallback(kind)
        super().callSolver(lp)

    def buildSolverModel(self, lp: pulp.LpProblem) -> None:
        """pulp's model transfer in three bulk calls instead of one call per column and row (0.2 s of a 2 s
        solve at 35k columns); sets the same `index` attributes pulp's solution readback uses."""
        h, inf = lp.solverModel, highspy.kHighsInf
        variables = lp.variables()
        for i, var in enumerate(variables):
            var.index = i
        n = len(variables)
        cost = np.fromiter((lp.objective.get(var, 0.0) for var in variables), dtype=np.float64, count=n)
        lower = np.fromiter((-inf if var.lowBound is None else var.lowBound for var in variables), dtype=np.float64, count=n)
        upper = np.fromiter((inf if var.upBound is None else var.upBound for var in variables), dtype=np.float64, count=n)
        none_i, none_f = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float64)
        h.addCols(n, cost, lower, upper, 0, none_i, none_i, none_f)
        integer = np.array([var.index for var in variables if var.cat == pulp.LpInteger], dtype=np.int32)
        if len(integer):
            kinds = np.full(len(integer), int(highspy.HighsVarType.kInteger), dtype=np.uint8)
            h.changeColsIntegrality(len(integer), integer, kinds)
        starts, indices, values, row_lower, row_upper = [], [], [], [], []
        for i, constraint in enumerate(lp._constraints.values()):
            constraint.index = i
            starts.append(len(indices))
            for var, coef in constraint.items():
                if coef != 0:
                    indices.append(var.index)
                    values.append(coef)
            lb, ub = constraint.getLb(), constraint.getUb()
            row_lower.append(-inf if lb is None else lb)
            row_upper.append(inf if ub is None else ub)
        h.addRows(len(starts), np.array(row_lower, dtype=np.float64), np.array(row_upper, dtype=np.float64), len(indices),
                  np.array(starts, dtype=np.int32), np.array(indices, dtype=np.int32), np.array(values, dtype=np.float64))
        if self.warm_start:
            given = [var for var in variables if var.varValue is not None]
            h.setSolution(len(given), np.array([var.index for var in given], dtype=np.int32),
                          np.array([var.varValue for var in given], dtype=np.float64))


def make_solver(backend: Backend, time_limit_s: float, presolve: bool, mip_rel_gap: float,
                warm_start: bool = False, relaxation: bool = False, stop_at_bound: float | None = None
                ) -> tuple[pulp.LpSolver, str]:
    """`time_limit_s`: CPU seconds (`clock.py`; CBC, a process of its own, counts its own); `warm_start`: start
    from the variables' initial values (`LpVariable.setInitialValue`); `relaxation`: the LP relaxation (HiGHS only);
    `stop_at_bound`: stop once the proven bound reaches this objective (HiGHS only: CBC searches on)."""
    if backend == "highs":
        # One thread: deterministic. Presolve is on only once the memory row is in: without it,
        # presolve removes <1% of rows yet took 60-70% of the solve (GPT-2 small on 2x2: 0.47 ->
        # 0.16 s), while with memory binding it (and the restarts it enables) is what closes the
        # gap (Llama tiny on 2x2 at 2 MB: 18 s -> 1.8 s; GPT-2 small 2x2 at 45% of its need 3.2 -> 1.6 s).
        # With the memory row in, more primal heuristics (effort 0.3, default 0.05) find the good plans that
        # let reduced-cost fixing shrink the model sooner: Llama tiny 2x2 at 2 MB 4.1 -> 3.0 s, GPT-2 small
        # 2x2 at 30% of its need 1.6 -> 1.1 s, other budgets within noise.
        options = {"presolve": "on", "mip_heuristic_effort": 0.3} if presolve else {"presolve": "off"}
        if relaxation:
            options["solve_relaxation"] = True
        highs = BulkHighs(msg=False, timeLimit=_WALL_PER_CPU * time_limit_s + _WALL_EXTRA_S, threads=1, random_seed=0,
                          gapRel=mip_rel_gap, warm_start=warm_start, cpu_limit_s=time_limit_s,
                          stop_at_bound=stop_at_bound, **options)
        if highspy is not None and highs.available():
            return highs, "highs"
        log.warning("solver: highspy is not importable; falling back to CBC (pip install highspy)")
    elif backend != "cbc":
        raise ValueError(f"unknown ILP backend {backend!r}; use 'highs' or 'cbc'")
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=1, gapRel=mip_rel_gap, warmStart=warm_start), "cbc"
