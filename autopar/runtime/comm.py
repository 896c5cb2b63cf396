"""The raw collectives on named process groups, issued through c10d (`torch.distributed`).

    summed = all_reduce(x, "3")                    # a new tensor: x summed over group "3"
    started = all_reduce(x, "3", async_op=True)    # a `Started`: the sum runs in the background...
    summed = started.wait()                        # ...and is read after its wait

Every function takes the group's c10d name (what `ProcessMesh.group_name` gives and
what codegen writes into `gm.code`), moves flat contiguous buffers and never
writes into its input. `collectives.py` builds the autograd-aware operators on
these, `deferred_loss.py` the loss that is summed in the background.

Why c10d and not torch's functional collectives (`torch.ops._c10d_functional`):
on torch 2.13 with gloo, a functional collective left in flight while this
thread goes on issuing others corrupts the heap now and then (measured: two
ranks, a started all-gather or all-reduce plus three waited collectives per
round: a segfault or `malloc(): unaligned tcache chunk` within 5,000 rounds in
about one run of three, one worker thread per group or two). The same rounds
through c10d's calls, the way DDP's reducer issues its buckets, ran 40,000
rounds clean. Both run on NCCL and gloo, and both are dispatcher ops
(`c10d.allreduce_`, ...), so torch's `LocalTensorMode` simulates either.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.compat import all_gather_single, reduce_scatter_single
from autopar.runtime import peers

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _allreduce_options(op: dist.ReduceOp) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


# Made once: c10d reads them per call and keeps no reference.
_ALLREDUCE_OPTIONS = {name: _allreduce_options(op) for name, op in _OPS.items()}


class Started:
    """A collective in flight: its result buffer and the c10d work writing into it."""

    __slots__ = ("_tensor", "_work", "_op", "_pg")

    def __init__(self, tensor: torch.Tensor, work: dist.Work | None, op: str = "a collective",
                 pg: dist.ProcessGroup | None = None):
        self._tensor, self._work, self._op, self._pg = tensor, work, op, pg

    def wait(self) -> torch.Tensor:
        """The result, blocking until the collective is complete (once; later calls return at once)."""
        if self._work is not None:
            wait_for(self._work, self._op, self._pg)
            self._work = None
        return self._tensor


def wait_for(work: dist.Work, op: str, pg: dist.ProcessGroup | None) -> None:
    """`work.wait()`; a backend's failure (a peer died, stopped or raised) becomes a `CollectiveError` that says
    so and what the other ranks were doing (`runtime.peers`), the backend's words kept as its cause."""
    try:
        work.wait()
    except RuntimeError as err:  # gloo's and NCCL's errors (torch's DistBackendError is one)
        raise peers.collective_failed(err, op, pg) from err


def group_size_rank(group: str) -> tuple[int, int]:
    """(size, this rank's index) of the group named `group`."""
    pg = _resolve_process_group(group)
    return pg.size(), pg.rank()


def all_reduce(x: torch.Tensor, group: str, op: str = "sum", async_op: bool = False) -> torch.Tensor | Started:
    """Elementwise `op` ("sum" or "max") of `x` over `group`, into a new tensor."""
    out = x.detach().clone(memory_format=torch.contiguous_format)  # one copy, dense whatever x's layout
    pg = _resolve_process_group(group)
    started = Started(out, start_all_reduce(out, pg, op), f"all-reduce ({op})", pg)
    return started if async_op else started.wait()


def start_sum(buffer: torch.Tensor, group: str) -> Started:
    """Sum the dense `buffer` over `group` in place, started now: for a buffer made for the purpose
    (`all_reduce` copies its input first)."""
    pg = _resolve_process_group(group)
    return Started(buffer, start_all_reduce(buffer, pg), "all-reduce (sum)", pg)


def start_all_reduce(buffer: torch.Tensor, pg: dist.ProcessGroup, op: str = "sum") -> dist.Work:
    """Start summing (or `op`) the dense `buffer` in place over `pg`: c10d's own call, the one
    `dist.all_reduce` ends in, without the ~20 us of Python checks it runs first on every call
    (measured on 4 gloo ranks: 47 us against 25 us to issue a scalar's). A training step issues
    up to three (the loss's count and sum, the gradient bucket), every step."""
    return pg.allreduce([buffer], _ALLREDUCE_OPTIONS[op])


def all_gather(flat: torch.Tensor, group: str, async_op: bool = False) -> torch.Tensor | Started:
    """The group's 1-D buffers back to back, rank order (size * numel elements)."""
    pg = _resolve_process_group(group)
    flat = flat.detach().contiguous()
    out = flat.new_empty(pg.size() * flat.numel())
    started = Started(out, all_gather_single(out, flat, group=pg, async_op=True), "all-gather", pg)
    return started if async_op else started.wait()


def reduce_scatter(flat: torch.Tensor, group: str) -> torch.Tensor:
    """Chunk r (of size numel / group size) of the group's summed 1-D buffers, on rank r."""
    pg = _resolve_process_group(group)
    flat = flat.detach().contiguous()
    out = flat.new_empty(flat.numel() // pg.size())
    return Started(out, reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=pg, async_op=True),
                   "reduce-scatter", pg).wait()


def all_to_all(flat: torch.Tensor, group: str) -> torch.Tensor:
    """Equal chunks of a 1-D buffer exchanged: chunk j goes to rank j, chunk i received comes from rank i."""
    flat = flat.detach().contiguous()
    out = torch.empty_like(flat)
    pg = _resolve_process_group(group)
    return Started(out, dist.all_to_all_single(out, flat, group=pg, async_op=True), "all-to-all", pg).wait()
