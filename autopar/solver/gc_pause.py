"""Pause Python's cyclic garbage collector while a planning pass runs.

After tracing, the heap holds millions of long-lived objects (fx graph, fake
tensors, sympy expressions); every young-generation overflow during planning
then triggers collections that walk them, which measured as 60-75% of the cold
strategy pass on GPT-2 small. The passes below allocate much and free little,
so we pause collection for their duration and restore the caller's setting
after (reference counting still frees everything acyclic immediately).
"""
from __future__ import annotations

import functools
import gc
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def gc_paused(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return wrapper  # type: ignore[return-value]
