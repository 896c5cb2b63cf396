"""Step time and peak live-tensor memory of one rank's training step, for any wrapped model.

    ms = measure_interleaved([Trainable("ddp", step, opt, live), ...], steps=10)

A step is `step()` (forward + backward + any gradient sync the system needs), then
`optimizer.step()` and `zero_grad(set_to_none=True)`. Time: warm-up steps (they also
create the optimizer state), then every rank times each step between barriers and
the step's time is the slowest rank's (a synchronous step goes at the pace of the
slowest rank); the median over steps is reported. Memory: one more step under
`PeakTracker`, which is autopar's `LiveStorageTracker` (the same reference the
profiler is checked against) taught to look through tensor subclasses, so
DTensor/FSDP2 local shards and the temporaries of their collectives are counted
as the plain tensors they are.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from autopar.profiler.measure import LiveStorageTracker


def plain_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The plain tensors holding the data of `tensors` (a DTensor's local shard, recursively)."""
    out: list[torch.Tensor] = []
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            inner = (getattr(t, n) for n in names)  # DTensor also lists its (opaque) device mesh
            out.extend(plain_tensors(x for x in inner if isinstance(x, torch.Tensor)))
        else:
            out.append(t)
    return out


class PeakTracker(LiveStorageTracker):
    """`LiveStorageTracker` that lets tensor subclasses desugar first.

    Returning NotImplemented for an op on a subclass (as FakeTensorMode does) hands it
    to the subclass' `__torch_dispatch__` with this mode still active, so the plain ops
    it runs on its local tensors, collectives' buffers included, come back here.
    """

    def __init__(self, already_live: Iterable[torch.Tensor] = ()) -> None:
        super().__init__(plain_tensors(already_live))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)


@dataclass(frozen=True)
class Trainable:
    """A system ready to train on this rank."""

    name: str
    step: Callable[[], None]  # forward + backward (+ any gradient sync the system needs) on this rank's batch slice
    optimizer: torch.optim.Optimizer
    live: Callable[[], Iterable[torch.Tensor]]  # owned and alive between steps: params, buffers, the local batch

    def train_step(self) -> None:
        self.step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class Measurement:
    step_s: float  # median over the timed steps of the slowest rank's step time
    peak_bytes: int  # max over ranks of the peak live-tensor bytes of one step
    steps_s: tuple[float, ...]  # every timed step (slowest rank), for the JSON


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def peak_bytes(system: Trainable) -> int:
    """Peak live-tensor bytes of one step of `system`, which has stepped before (its optimizer state exists)."""
    state = [t for s in system.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    dist.barrier()
    with PeakTracker([*system.live(), *state]) as tracker:
        system.train_step()
    return int(_max_over_ranks([float(tracker.peak_bytes)])[0])


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of systems 0..n-1 in which each system directly follows each other exactly once
    per cycle (n orders for an even n; for an odd n, those and their reverses: twice each).

    Williams' design for first-order carry-over effects: the first order alternates from both
    ends (0, 1, n-1, 2, n-2, ...), so its neighbours' differences mod n are all distinct;
    the others add 1, 2, ... mod n to it, which keeps those differences.
    """
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(x + shift) % n for x in first] for shift in range(n)]
    return orders if n % 2 == 0 else orders + [order[::-1] for order in orders]


def measure_interleaved(systems: Sequence[Trainable], steps: int = 10, warmup: int = 2) -> list[Measurement]:
    """Time `steps` steps of every system, interleaved, then track one step's peak memory of each.

    Interleaved (one step of each system per round) rather than one system after the
    other: on a shared machine the load drifts over minutes, and interleaving spreads
    that drift evenly over the systems being compared. A step's time also depends on
    which system ran just before it (measured in one gpt2-tiny run on 4 ranks: DDP's
    step 15.5-19.5 ms and autopar's 18.0-22.2 ms by predecessor), so the rounds follow
    `balanced_orders`: over each cycle of its orders every system directly follows
    every other equally often. (Rounds that only rotated one fixed order left each
    system always behind the same one.) Every rank of the default group must call
    this with the same systems in the same order.
    """
    for system in systems:
        for _ in range(warmup):  # also creates the optimizer state
            system.train_step()
    times: list[list[float]] = [[] for _ in systems]
    orders = balanced_orders(len(systems))
    for step in range(steps):
        for i in orders[step % len(orders)]:
            dist.barrier()
            start = time.perf_counter()
            systems[i].train_step()
            times[i].append(time.perf_counter() - start)
    flat = _max_over_ranks([t for ts in times for t in ts])
    out = []
    for i, system in enumerate(systems):
        ts = tuple(flat[i * steps:(i + 1) * steps])
        out.append(Measurement(statistics.median(ts), peak_bytes(system), ts))
    return out


def measure_training(step: Callable[[], None], optimizer: torch.optim.Optimizer,
                     live: Callable[[], Iterable[torch.Tensor]], steps: int = 10, warmup: int = 2) -> Measurement:
    """One system alone (benchmarks/step_time.py uses this form)."""
    return measure_interleaved([Trainable("system", step, optimizer, live)], steps, warmup)[0]
