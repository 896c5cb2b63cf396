"""Numeric arguments checked where they enter (`parallelize`, the CLI): a NaN budget compares false with
everything, so it would pass every memory check the solver makes; an infinite time limit never stops.

    budget = positive("memory_budget", memory_budget, "bytes per device, e.g. 80e9")
"""
from __future__ import annotations

import math
from typing import Any

from autopar.errors import InvalidValueError


def positive(name: str, value: Any, example: str) -> float:
    """`value` as a float when it is a finite number above zero; else an `InvalidValueError` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidValueError(f"{name}={value!r} is not a number; pass {example}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidValueError(f"{name}={value!r} must be a finite number above zero; pass {example}")
    return float(value)


def mesh_shape(name: str, shape: Any) -> tuple[int, ...]:
    """`shape` as a tuple of whole numbers of at least 1; else an `InvalidValueError` naming it."""
    sizes = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise InvalidValueError(f"{name}={shape!r}: a mesh shape is a tuple of whole numbers of at least 1, one per "
                                "axis, whose product is the number of ranks, e.g. (4,) or (2, 2)")
    return sizes
