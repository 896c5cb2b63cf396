"""Stage 3: strategies, the joint ILP and the Plan.

    from autopar.solver import solve, solve_for_devices, fixed_plan, baseline_plans

The entry points live in `search.py`; they are loaded on first use so that
importing a leaf module (`autopar.solver.spec`, `.mesh`) stays light and free of
import cycles with `strategies`.
"""
from __future__ import annotations

from typing import Any

__all__ = ["solve", "solve_for_devices", "solve_keeping_params", "fixed_plan", "baseline_plan", "baseline_plans", "ShapeResult", "BASELINES"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from autopar.solver import search

        return getattr(search, name)
    raise AttributeError(f"module 'autopar.solver' has no attribute {name!r}")
