"""The solver's clock: this process' CPU time, which every time limit of the search counts.

Every solve runs on one thread (`backends.make_solver`), so on an idle machine CPU time is wall time. On a shared
one it is not: on the 2-core machines the tests and benchmarks run on, other work stretched a solve's wall time
5-16x. A limit in wall time then left each step of the search a fraction of its work, and the plan depended on
what else ran; a limit in CPU time gives the search the same work, and the same plan, whatever else runs.
"""
from __future__ import annotations

import time


def cpu_s() -> float:
    """Seconds of CPU this process has used: the solver's clock."""
    return time.process_time()
