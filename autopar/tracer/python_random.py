"""Python's own random numbers drawn by the model while it is traced: named, since the graph keeps that draw.

    with python_draws_reported(model_name):
        ep = torch.export.export(...)       # a `random.random()` in the forward is logged with its line

A forward that draws with `random` or `numpy.random` (an augmentation that flips with probability
1/2, a layer skipped when `random.random() < p`) runs that Python once, while it is traced: the
graph holds the value drawn then, and the parallel module uses it at every step, where the model
draws anew. torch's random ops (`torch.rand`, dropout) are ops of the graph and are drawn at every
step. So each draw from the model's code (not torch's, autopar's or the standard library's) is
recorded with its line, and the trace warns once per line. A warning, not a refusal: a draw that
decides nothing (`random.random() < 0.0`, a layer drop of zero) is harmless, and common in
library models.
"""
from __future__ import annotations

import contextlib
import logging
import random
import sys
from typing import Any, Callable, Iterator

import numpy

from autopar.tracer.source_lines import calling_line, in_library

log = logging.getLogger(__name__)

_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample", "shuffle", "gauss",
           "normalvariate", "betavariate", "expovariate")
_NUMPY = ("rand", "randn", "random", "uniform", "randint", "choice", "normal", "permutation", "shuffle", "binomial",
          "beta")


@contextlib.contextmanager
def python_draws_reported(model_name: str) -> Iterator[None]:
    """Inside, a draw of `random` or `numpy.random` from the model's code is recorded; on the way out (after a
    trace that succeeded or not) each line is logged once, and the functions are restored."""
    lines: dict[str, str] = {}
    modules = ((random, _RANDOM), (numpy.random, _NUMPY))
    originals = [(module, name, getattr(module, name))
                 for module, names in modules for name in names if hasattr(module, name)]

    def recorded(module_name: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def draw(*args: Any, **kwargs: Any) -> Any:
            if not in_library(sys._getframe(1).f_code.co_filename):
                lines.setdefault(calling_line(), f"{module_name}.{name}")
            return fn(*args, **kwargs)
        return draw

    for module, name, fn in originals:
        setattr(module, name, recorded(module.__name__, name, fn))
    try:
        yield
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
        for line, fn in lines.items():
            log.warning("tracer: %s draws %s() at %s while it is traced: the graph keeps that one draw and the "
                        "parallel module uses it at every step, where the model would draw anew. Use torch's random "
                        "ops (torch.rand, torch.randint, torch.bernoulli), which draw at every step",
                        model_name, fn, line)
