"""What a user whose budget no plan meets is told: the least need, in words they can pass back as a budget.

    raise infeasible_error(leanest.memory, budget_bytes, gap=None, proven=True)
    raise timeout_error(time_limit_s, budget_bytes, leanest.memory, gap=0.2)

Both errors carry their numbers (`InfeasibleError.min_memory_bytes`, `.lower_bound_bytes`, `.fits_bytes`); their
fix names the settings of the solver's Python entry points, and `parallelize` and the CLI re-word it
(`InfeasibleError.worded_for`).
"""
from __future__ import annotations

import math

from autopar.errors import InfeasibleError, SearchTimeoutError
from autopar.solver.ilp import MEMORY_SLACK_BYTES
from autopar.solver.plan import MemoryBreakdown

_GIB = float(2**30)


def gib(n: float, digits: int = 1, up: bool = False) -> str:
    """Bytes in the largest binary unit that keeps a digit before the point (tiny test models need MiB);
    `up`: rounded up, for a need a user may copy as the budget."""
    for unit, size in (("GiB", _GIB), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if n >= size:
            value = math.ceil(n / size * 10**digits - 1e-9) / 10**digits if up else n / size
            return f"{value:.{digits}f} {unit}"
    return f"{math.ceil(n) if up else n:.0f} B"


def budget_that_fits(need_bytes: float) -> float:
    """A budget under which a plan needing `need_bytes` is found: the memory row asks for up to
    `MEMORY_SLACK_BYTES` less than the budget (a few millionths of the memory unit, which is at most GiB and at
    most the replicated plan's need, so a small share of any need too)."""
    return need_bytes + min(MEMORY_SLACK_BYTES, 1e-3 * need_bytes)


def need_and_budget(need_bytes: float, budget_bytes: float) -> tuple[str, str]:
    """Both in the same words, the need rounded up, with as many digits as it takes to tell them apart ("needs
    2.6 MiB; budget 2.6 MiB" read as a contradiction, and 2.6 MiB as a budget would not fit)."""
    for digits in range(1, 4):
        need, budget = gib(need_bytes, digits, up=True), gib(budget_bytes, digits)
        if need != budget:
            break
    return need, budget


def _largest_part(m: MemoryBreakdown) -> str:
    parts = {
        "parameters": m.params_bytes,
        "gradients": m.grads_bytes,
        "optimizer state": m.optimizer_bytes,
        "saved activations": m.activations_bytes,
        "largest temporary": m.temp_bytes,
    }
    name, size = max(parts.items(), key=lambda kv: kv[1])
    return f"{name} {gib(size)}"


def least_need_bytes(total_bytes: float, gap: float | None) -> float:
    """What every plan needs at least, as a least-memory search that stopped `gap` above its bound proved it."""
    return total_bytes * (1.0 - gap) if gap else total_bytes


def infeasible_error(best: MemoryBreakdown, budget_bytes: float, gap: float | None, proven: bool = False) -> InfeasibleError:
    """No plan fits: the leanest plan's need and its largest part. `gap`: the relative gap the search for it
    left (None: proven least), stated with the bound it proves; `proven`: the budget itself was proven too
    small, which bounds the least need from below too."""
    bound_bytes = least_need_bytes(best.total_bytes, gap)
    if proven:
        bound_bytes = min(max(bound_bytes, budget_bytes), best.total_bytes)
    found = "" if not gap else f" (the leanest plan found; none needs less than {gib(bound_bytes)})"
    need, budget = need_and_budget(best.total_bytes, budget_bytes)
    return InfeasibleError(
        f"no plan fits: needs {need} per device ({_largest_part(best)}){found}; budget {budget}",
        min_memory_bytes=best.total_bytes, lower_bound_bytes=bound_bytes, fits_bytes=budget_that_fits(best.total_bytes))


def timeout_error(time_limit_s: float, budget_bytes: float | None, leanest: MemoryBreakdown | None,
                  gap: float | None) -> SearchTimeoutError:
    """The search used its `time_limit_s` and neither found a plan within the budget nor proved that none exists.
    `leanest`: the leanest plan it found (over the budget; `gap` above the bound the search proved, 1: none proved),
    None when it found no plan at all."""
    if leanest is None:
        within = "" if budget_bytes is None else f" within {gib(budget_bytes)}"
        return SearchTimeoutError(f"the search found no plan{within} in {time_limit_s:g} s (its time limit)", time_limit_s)
    need, asked = need_and_budget(leanest.total_bytes, budget_bytes or 0.0)
    bound = least_need_bytes(leanest.total_bytes, gap)
    proved = f", and none needs less than {gib(bound)}" if gap is None or gap < 1.0 else ""
    cause = (f"the search found no plan within {asked} in {time_limit_s:g} s (its time limit) and could not rule one "
             f"out: the leanest plan it found needs {need} per device ({_largest_part(leanest)}){proved}")
    return SearchTimeoutError(cause, time_limit_s, leanest.total_bytes, bound, budget_that_fits(leanest.total_bytes))
