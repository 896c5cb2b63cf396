"""Steps every rank takes together, whose failure on any rank is raised on every rank.

    traced = on_every_rank(lambda: trace(model, sample))   # each rank traces; an error anywhere, everywhere
    plan = from_rank0(lambda: solve(...), to_text, from_text)   # rank 0 solves; its plan or its error, everywhere

`parallelize` runs on every rank and then meets the others in collectives. A rank that
raised on its own (rank 0's solver found no plan within the budget) left the others
blocked in the next collective until gloo saw rank 0's process end ("Connection closed
by peer"), and a loop that caught the error and called `parallelize` again with a larger
budget handed rank 1 the plan of rank 0's retry while rank 1 was still in its first call.
Here the outcome of the step, a result or an error, is exchanged by every rank: each then
raises the same error (the lowest failing rank's: its class, message and attributes, so
`InfeasibleError.min_memory_bytes` is there too), and a retry starts on every rank at once.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from autopar.errors import AutoparError

T = TypeVar("T")


def on_every_rank(step: Callable[[], T]) -> T:
    """`step()` on this rank; raises on every rank if it raised on any (a collective: every rank calls it)."""
    result, own = None, None
    try:
        result = step()
    except Exception as err:  # noqa: BLE001 -- every rank re-raises it below
        own = err
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if own is None else _portable(own))
    first = next((rank for rank, failure in enumerate(failures) if failure is not None), None)
    if first is not None:
        raise own if first == dist.get_rank() else _rebuilt(failures[first])
    return result  # type: ignore[return-value]


def from_rank0(step: Callable[[], T], to_text: Callable[[T], str], from_text: Callable[[str], T]) -> T:
    """`step()`'s result on rank 0, on every rank, sent as the text `to_text` makes of it (a plan as JSON: no
    pickle of it crosses); raises on every rank what it raised on rank 0 (a collective: every rank calls it)."""
    outcome: list[Any] = [None]
    own = None
    if dist.get_rank() == 0:
        try:
            outcome = [("result", to_text(step()))]
        except Exception as err:  # noqa: BLE001 -- every rank re-raises it below
            own, outcome = err, [("error", _portable(err))]
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        raise own if own is not None else _rebuilt(value)
    return from_text(value)


def _portable(err: Exception) -> tuple[type, tuple, dict]:
    """What re-raises `err` on another rank: its class, arguments and attributes (an exception's pickle keeps only
    the arguments: `InfeasibleError(message)` would lose its `min_memory_bytes`). One that does not pickle (a
    class local to a function, an attribute holding a lock) goes as an `AutoparError` with its text."""
    state = (type(err), err.args, dict(vars(err)))
    try:
        pickle.dumps(state)
    except Exception:  # noqa: BLE001 -- anything pickle refuses
        return AutoparError, (f"{type(err).__name__}: {err}",), {}
    return state


def _rebuilt(failure: tuple[type, tuple, dict]) -> Exception:
    cls, args, attributes = failure
    err = cls.__new__(cls)
    err.args = args
    vars(err).update(attributes)
    return err
