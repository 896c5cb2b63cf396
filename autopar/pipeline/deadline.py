"""The pipeline search's time limit: CPU seconds for the whole search, checked before each new trace and solve.

The search's work grows with the pp degree: its exact round solves every stage of its best few configurations,
lowering their budgets up to six times, and at 175B parameters on 1,024 devices each solve takes tens of seconds.
A `Deadline` bounds the whole search, as `solve`'s `time_limit_s` bounds one solve; it counts the process' CPU time
(`autopar.solver.clock`), so the same limit gives the same work whatever else runs on the machine. It is checked
between solves, never inside one: a search may run past its limit by one solve's own limit and one trace.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from autopar.solver.clock import cpu_s


class SearchTimeUp(Exception):
    """The pipeline search's time limit ran out (raised inside the search; `solve_pipeline` answers with its best)."""


@dataclass(frozen=True)
class Deadline:
    limit_s: float | None  # None: no limit
    began_s: float = field(default_factory=cpu_s)

    def spent_s(self) -> float:
        return cpu_s() - self.began_s

    def check(self) -> None:
        """Raises `SearchTimeUp` once the limit is spent."""
        if self.limit_s is not None and self.spent_s() >= self.limit_s:
            raise SearchTimeUp(f"its time limit of {self.limit_s:g} CPU s ran out after {self.spent_s():.1f} CPU s")


NO_LIMIT = Deadline(None, 0.0)
