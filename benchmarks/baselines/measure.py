"""Step time and peak live-tensor memory of one rank's training step, for any wrapped model.

    m = measure_training(step, live=[*params, *batch], optimizer=opt, steps=10)

`step()` runs forward + backward (+ any gradient sync the system needs); this
module adds `optimizer.step()` and `zero_grad(set_to_none=True)`. Time: warm-up
steps (they also create the optimizer state), then every rank times each step
between barriers and the step's time is the slowest rank's (a synchronous step
goes at the pace of the slowest rank); the median over steps is reported. Memory:
one more step under `PeakTracker`, which is autopar's `LiveStorageTracker` (the
same reference the profiler is checked against) taught to look through tensor
subclasses, so DTensor/FSDP2 local shards and the temporaries of their
collectives are counted as the plain tensors they are.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

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
class Measurement:
    step_s: float  # median over the timed steps of the slowest rank's step time
    peak_bytes: int  # this rank's peak live-tensor bytes over one step (max over ranks when reduced)
    steps_s: tuple[float, ...]  # every timed step (slowest rank), for the JSON


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure_training(
    step: Callable[[], None],
    optimizer: torch.optim.Optimizer,
    live: Callable[[], Iterable[torch.Tensor]],
    steps: int = 10,
    warmup: int = 2,
) -> Measurement:
    """Time `steps` training steps after `warmup` ones, then track one step's peak memory.

    `live()` lists what is alive between steps and owned by the system (parameters,
    persistent buffers, the local batch); the optimizer state is added here.
    Every rank of the default group must call this together.
    """
    def full_step() -> None:
        step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        full_step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        full_step()
        times.append(time.perf_counter() - start)
    times = _max_over_ranks(times)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    dist.barrier()
    with PeakTracker([*live(), *state]) as tracker:
        full_step()
    peak = int(_max_over_ranks([float(tracker.peak_bytes)])[0])
    return Measurement(statistics.median(times), peak, tuple(times))
