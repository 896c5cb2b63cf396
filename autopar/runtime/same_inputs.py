"""Ranks agreeing that they feed inputs of one signature, for plans that exchange activations.

Under a plan that moves activations between ranks (tensor or sequence parallel, a batch
gathered, a vocabulary-parallel loss), every rank's collectives have the sizes of its own
inputs. Ranks that feed different shapes in one step (per-rank padding to the longest
sequence, an uneven last batch) send and expect different byte counts: gloo aborts the
process ("Received data size doesn't match expected size"), and NCCL, which checks no
sizes, would hang or read the wrong bytes. Data-parallel plans only move gradients and
scalars, whose sizes do not depend on the inputs, and need no agreement.

`agree` is one all-reduce of two integers (a checksum of the signature and its negation,
maxed: equal on every rank only when every rank's checksum is the same) on a CPU (gloo)
group, so a GPU step does not wait for the device. Only when they differ does a second
collective gather each rank's signature, for an error that names them all; every rank
raises it.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from autopar.errors import CallMismatchError, InputsDifferError
from autopar.runtime.arrival import ADVICE
from autopar.runtime.comm import wait_for


def agree(signature: str, group: dist.ProcessGroup | None, mode: str = "") -> None:
    """Return when every rank of `group` passed the same `signature` and `mode`; else raise on every rank, naming
    each one's: `CallMismatchError` when the modes differ (rank 0 evaluating alone meets the others' training
    forward here), else `InputsDifferError`."""
    if dist.get_backend(group) == "fake":
        return  # torch's fake process group simulates one rank (`benchmarks/simulate_memory.py`): no other to differ
    checksum = zlib.crc32(f"{mode}; {signature}".encode())
    extremes = torch.tensor([checksum, -checksum], dtype=torch.int64)
    wait_for(dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group, async_op=True), "the inputs' agreement check", group)
    if extremes[0].item() == checksum and -extremes[1].item() == checksum:
        return
    calls: list[tuple[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(calls, (mode, signature), group=group)
    if len({m for m, _ in calls}) > 1:
        rows = "\n".join(f"  rank {rank}: a forward in {m}" for rank, (m, _) in enumerate(calls))
        raise CallMismatchError(f"the ranks ran forwards of different modes at once:\n{rows}\nthis module's plan "
                                f"exchanges activations between ranks, so each forward is a collective, which every rank makes. {ADVICE}")
    rows = "\n".join(f"  rank {rank}: {text}" for rank, (_, text) in enumerate(calls))
    raise InputsDifferError(
        f"ranks fed inputs of different shapes in one step:\n{rows}\nthis module's plan exchanges activations between "
        "ranks, so every rank must feed the same shapes: pad every rank's batch to one length (padding='max_length' "
        "in a tokenizer or collator) and drop an uneven last batch (drop_last=True); a data-parallel plan, which "
        "only moves gradients, takes different shapes per rank")
