"""Every rank making the same collective call, checked before the call's collectives start.

A DDP loop habitually does on rank 0 alone what is a collective here:

    if rank == 0:
        evaluate(model)                              # DDP: a local forward
        torch.save(model.module.state_dict(), path)  # DDP: local tensors

Under a parallel module the evaluation's loss is all-reduced and the state dict gathers the
parameters' shards, so rank 0's collectives meet whatever the other ranks run next: gloo
aborts the process ("Is there a distributed collective mismatch in your code?") after the
ranks exchanged each other's loss terms, and NCCL, which checks no sizes, can hang or
read the wrong bytes. (Measured: gpt2-tiny on 2 ranks, rank 0 evaluating after its first
step: its loss summed its eval term with rank 1's second training step's, then gloo
aborted; a `state_dict()` on rank 0 alone hung both ranks.)

`all_ranks_make(what, timeout_s)` meets the other ranks through the process group's key-value
store (torch's `TCPStore`, which `init_process_group` made: no collective, so nothing is
mismatched while waiting), before the call runs any collective:
- each rank notes the call it is in (`runtime.peers`: what a failing rank's error names);
- the first rank to arrive leaves what it calls (a compare-and-set), and each rank after it
  compares its call with that one as it arrives: a rank making another call (rank 0 a state
  dict, rank 1 an evaluation) sets the call's outcome to the mismatch and raises
  `CallMismatchError`, naming both, and so does every rank waiting there;
- every rank whose call matches counts itself in, and the last to arrive marks the call complete
  (rank 0 then waits for the others to leave: its process may serve the store; so it does after a timeout, for
  the ranks that arrived);
- a rank still waiting after half its timeout logs the ranks that have not arrived and the call
  each was last in; after `timeout_s` (`TIMEOUT_S` unless the module says otherwise) it raises
  that. The wait polls the store between short sleeps, so a signal's Python handler (SIGTERM's
  in a job that saves on preemption) runs at once rather than after the wait.

Calls are numbered in the order a process makes them, so every rank must make its
checked calls in one order, as it must its collectives. Each check costs a few store
round trips (tens of microseconds on one host): it guards the calls that are rare in a
loop (state dicts, checkpoints, the first forward and each change between training and
evaluation), never each training step.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Callable

import torch.distributed as dist

from autopar.errors import CallMismatchError
from autopar.runtime import peers

log = logging.getLogger(__name__)

# Far below NCCL's default collective timeout (600 s): a rank that died or took another path is named within a
# minute. A job whose ranks legitimately drift further apart at a checked call (one rank loading data for
# minutes first) raises it: `parallelize(..., call_timeout_s=...)` or `pm.call_timeout_s`.
TIMEOUT_S = 60.0
_PREFIX = "autopar/calls"
_POLL_S = (0.0005, 0.05)  # the store is asked first after the shorter, then ever less often up to the longer
_numbers = itertools.count()  # this process's checked calls, in order


def all_ranks_make(what: str, timeout_s: float | None = None) -> None:
    """Return once every rank has made call `what` (its number in this process's checked calls the same);
    raise `CallMismatchError` on every rank if one made another call, or when some made none within
    `timeout_s` (default `TIMEOUT_S`).

    When the call then ends without a collective (an error every rank raises), rank 0 may be done, and its
    process ends, before the others have heard how the call went: rank 0 serves the store (unless torchrun's
    agent does), so it leaves last, once the others have read the outcome."""
    store = peers.store()
    if store is None:
        return
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    rank, world = dist.get_rank(), dist.get_world_size()
    number = next(_numbers)
    key = f"{_PREFIX}/{number}"
    peers.note_call(store, number, what)
    entry = f"{rank}\t{what}"
    first_rank, first = store.compare_set(f"{key}/first", "", entry).decode().split("\t", 1)  # the first arrival's
    store.append(f"{key}/who", entry + "\n")
    if first != what:
        message = (f"the ranks made different collective calls of the parallel module at once:\n"
                   f"  rank {first_rank}: {first}\n  rank {rank}: {what}\neach is a collective, which "
                   f"every rank makes in the same order. {ADVICE}")
        store.compare_set(f"{key}/outcome", "", "mismatch\t" + message)
    elif store.add(f"{key}/arrived", 1) == world:
        store.compare_set(f"{key}/outcome", "", "all")
        # every rank is done with the previous call: it arrived at this one after
        for old in ("first", "who", "arrived", "outcome", "left"):
            store.delete_key(f"{_PREFIX}/{number - 1}/{old}")
    try:
        outcome = _wait(store, key, what, rank, world, timeout_s)
    except CallMismatchError as err:  # timed out: so do the other ranks that arrived, each by its own clock
        peers.note_failure(f"CallMismatchError: {err}")
        _leave(store, key, rank, lambda: len(_calls(store, key)), timeout_s)
        raise
    _leave(store, key, rank, lambda: world, timeout_s)
    if outcome.startswith("mismatch\t"):
        raise CallMismatchError(outcome.split("\t", 1)[1])


ADVICE = ("Make it on every rank and keep the result on one: `sd = pm.state_dict()` on every rank, then "
          "`if rank == 0: torch.save(sd, path)`; evaluate on every rank, each on its slice of the batch (the loss "
          "returned is the whole batch's, on every rank). A DDP loop's `if rank == 0: evaluate(); save()` makes "
          "these calls on rank 0 alone")


def _leave(store: dist.Store, key: str, rank: int, ranks_in: Callable[[], int], timeout_s: float) -> None:
    """Count this rank out of call `key`. Rank 0, whose process may serve the store, goes on (or ends) only once
    the `ranks_in()` ranks in the call have left: a rank still polling the store would see it closed, a network
    error instead of the call's outcome."""
    left = store.add(f"{key}/left", 1)
    if rank == 0:
        _poll(lambda: left >= ranks_in() or int(store.get(f"{key}/left")) >= ranks_in(), timeout_s)


def _poll(done: Callable[[], bool], timeout_s: float) -> bool:
    """Ask `done()` (store reads) between sleeps until it holds (True) or `timeout_s` passes (False). Python runs
    signal handlers during the sleeps; a store wait would hold them off until it returned."""
    deadline = time.monotonic() + timeout_s
    pause = _POLL_S[0]
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, _POLL_S[1])
    return True


def _wait(store: dist.Store, key: str, what: str, rank: int, world: int, timeout_s: float) -> str:
    """The call's outcome ("all", or "mismatch\t" and the message) once some rank has set it; raises after `timeout_s`."""
    start = time.monotonic()
    has_outcome = lambda: store.check([f"{key}/outcome"])  # noqa: E731
    if not _poll(has_outcome, timeout_s / 2):
        log.warning("%s (raising after %.0f s)", _missing(store, key, what, rank, world, timeout_s / 2), timeout_s)
        if not _poll(has_outcome, timeout_s - (time.monotonic() - start)):
            raise CallMismatchError(_missing(store, key, what, rank, world, time.monotonic() - start))
    return store.get(f"{key}/outcome").decode()


def _missing(store: dist.Store, key: str, what: str, rank: int, world: int, waited_s: float) -> str:
    missing = sorted(set(range(world)) - set(_calls(store, key)))
    number = key.rsplit("/", 1)[1]
    return (f"rank {rank} has waited {waited_s:.0f} s in {what} (checked call {number}) for ranks {missing}, which have "
            f"not made it: it is a collective, which every rank makes. Where each rank was last:\n"
            f"{peers.describe_ranks(store, world, missing)}\n"
            f"A rank that died or raised makes no more calls: look for its error first. {ADVICE}")


def _calls(store: dist.Store, key: str) -> dict[int, str]:
    """rank -> what it called, of the ranks that arrived at call `key`."""
    lines = store.get(f"{key}/who").decode().splitlines()
    return {int(r): c for r, c in (line.split("\t", 1) for line in lines)}
