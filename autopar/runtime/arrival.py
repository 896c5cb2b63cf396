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

`all_ranks_make(what)` meets the other ranks through the process group's key-value store
(torch's `TCPStore`, which `init_process_group` made: no collective, so nothing is
mismatched while waiting), before the call runs any collective:
- the first rank to arrive leaves what it calls (a compare-and-set), and each rank after it
  compares its call with that one as it arrives: a rank making another call (rank 0 a state
  dict, rank 1 an evaluation) raises `CallMismatchError`, naming both;
- every rank whose call matches counts itself in, and the last to arrive marks the call complete
  (rank 0 then waits for the others to leave: its process may serve the store);
- a rank still waiting after `WARN_AFTER_S` logs the ranks that have not arrived, what the
  call is and how to make it on every rank; after `TIMEOUT_S` (NCCL's default collective
  timeout) it raises that.

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
from datetime import timedelta

import torch.distributed as dist

from autopar.errors import CallMismatchError

log = logging.getLogger(__name__)

WARN_AFTER_S = 30.0
TIMEOUT_S = 600.0
_PREFIX = "autopar/calls"
_numbers = itertools.count()  # this process's checked calls, in order


def all_ranks_make(what: str) -> None:
    """Return once every rank has made call `what` (its number in this process's checked calls the same);
    raise `CallMismatchError` if another rank made another call, or none within `TIMEOUT_S`.

    When the call then ends without a collective (an error every rank raises), rank 0 may be done, and its
    process ends, before the others have heard that every rank came: rank 0 serves the store (unless torchrun's
    agent does), so it leaves last, once the others have left, and they read nothing after the wait."""
    store = _store()
    if store is None:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    number = next(_numbers)
    key = f"{_PREFIX}/{number}"
    entry = f"{rank}\t{what}"
    first_rank, first = store.compare_set(f"{key}/first", "", entry).decode().split("\t", 1)  # the first arrival's
    store.append(f"{key}/who", entry + "\n")
    if first != what:
        raise CallMismatchError(f"the ranks made different collective calls of the parallel module at once:\n"
                                f"  rank {first_rank}: {first}\n  rank {rank}: {what}\neach is a collective, which "
                                f"every rank makes in the same order. {ADVICE}")
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/all", "")
        # every rank is done with the previous call: it arrived at this one after
        for old in ("first", "who", "arrived", "all", "left", "gone"):
            store.delete_key(f"{_PREFIX}/{number - 1}/{old}")
    _wait(store, key, what, rank, world)
    if rank != 0:
        if store.add(f"{key}/left", 1) == world - 1:
            store.set(f"{key}/gone", "")
    else:
        store.wait([f"{key}/gone"], timedelta(seconds=TIMEOUT_S))


ADVICE = ("Make it on every rank and keep the result on one: `sd = pm.state_dict()` on every rank, then "
          "`if rank == 0: torch.save(sd, path)`; evaluate on every rank, each on its slice of the batch (the loss "
          "returned is the whole batch's, on every rank). A DDP loop's `if rank == 0: evaluate(); save()` makes "
          "these calls on rank 0 alone")


def _store() -> dist.Store | None:
    """The default process group's store, when there are other ranks to wait for."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    # torch keeps the store `init_process_group` made (or was given) here; there is no public accessor
    return dist.distributed_c10d._get_default_store()


def _wait(store: dist.Store, key: str, what: str, rank: int, world: int) -> None:
    start = time.monotonic()
    warned = False
    while True:
        waited = time.monotonic() - start
        limit = (WARN_AFTER_S if not warned else TIMEOUT_S) - waited
        try:
            store.wait([f"{key}/all"], timedelta(seconds=max(limit, 0.001)))
            return
        except dist.DistStoreError:
            missing = sorted(set(range(world)) - set(_calls(store, key)))
            message = (f"rank {rank} has waited {time.monotonic() - start:.0f} s in {what} for ranks {missing}, which "
                       f"have not made it: it is a collective, which every rank makes. {ADVICE}")
            if warned:
                raise CallMismatchError(message) from None
            log.warning("%s (raising after %.0f s)", message, TIMEOUT_S)
            warned = True


def _calls(store: dist.Store, key: str) -> dict[int, str]:
    """rank -> what it called, of the ranks that arrived at call `key`."""
    lines = store.get(f"{key}/who").decode().splitlines()
    return {int(r): c for r, c in (line.split("\t", 1) for line in lines)}
