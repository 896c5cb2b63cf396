"""Stage 3: strategies, the joint ILP and the Plan.

    from autopar.solver import solve, solve_for_devices, fixed_plan, baseline_plans

The entry points live in `search.py`, `pinned.py` and `textbook.py`; they are loaded on first use so that
importing a leaf module (`autopar.solver.spec`, `.mesh`) stays light and free of
import cycles with `strategies`.
"""
from __future__ import annotations

import importlib
from typing import Any

_HOME = {  # entry point -> the module that defines it
    "solve": "search", "solve_for_devices": "search", "ShapeResult": "search",
    "solve_keeping_params": "pinned", "fixed_plan": "pinned",
    "baseline_plan": "textbook", "baseline_plans": "textbook", "BASELINES": "textbook",
}
__all__ = list(_HOME)


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"autopar.solver.{_HOME[name]}"), name)
    raise AttributeError(f"module 'autopar.solver' has no attribute {name!r}")
