"""Where a mixed-precision gradient sync lands: the float32 `.grad` of the compute copies' masters.

Under `autopar.MixedPrecision` autograd accumulates the step's gradients into the compute copies
(`runtime.compute_copies`), in the compute dtype; `GradSync` packs them into its buckets in the reduce dtype
(`kernels.pack`: cast and copy in one pass) and frees them. Once a bucket is summed, `unpack_into` casts it
into the masters' gradients (`kernels.unpack`), adding it to a sum the last sync wrote there: that sum is the
same on every rank, so nothing of it goes over the wire again (no keeper is needed, unlike the gradients a
plain sync writes), and only this backward's terms are reduced. A master gradient the sync did not write (a
`no_sync()` term, or one the caller set) is this rank's term and is reduced whole: `add_unsummed` adds it into
the bucket before the sum. A `no_sync()` backward moves the copies' gradients into their masters when it
ends (`move_from_copies`), so micro-batches are summed in float32, not in the compute dtype; a synced sum it
adds to is kept by its group's keeper only, for the next sync to reduce it once.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch

from kernels import bucket_offsets, unpack


class MasterGrads:
    """The masters' gradients a gradient sync wrote (each a sum over ranks), by master."""

    def __init__(self) -> None:
        self._sums: dict[int, weakref.ref] = {}  # id(master) -> the gradient the last sync wrote into it

    def _summed(self, master: torch.Tensor) -> bool:
        mark = self._sums.get(id(master))
        return master.grad is not None and mark is not None and mark() is master.grad

    def add_unsummed(self, buffer: torch.Tensor, masters: Sequence[torch.Tensor]) -> None:
        """Add into a bucket of the copies' gradients (`buffer`, laid out as `masters`) the master gradients no sync
        wrote; the sum replaces them."""
        for m, offset in zip(masters, bucket_offsets(masters)):
            if m.grad is not None and not self._summed(m):
                buffer[offset:offset + m.numel()].add_(m.grad.reshape(-1).to(device=buffer.device, dtype=buffer.dtype))
                m.grad = None

    def unpack_into(self, buffer: torch.Tensor, masters: Sequence[torch.Tensor], scale: float | torch.Tensor = 1.0) -> None:
        """A summed bucket times `scale` (a mean's 1 / global count, a 0-d tensor the host does not read) cast into
        the masters' gradients (`kernels.unpack`: one pass), added to the sums already there."""
        grads = [m.grad for m in masters]
        accumulate = any(g is not None for g in grads)
        grads = [g if g is not None else torch.zeros_like(m) if accumulate else torch.empty_like(m)
                 for g, m in zip(grads, masters)]
        unpack(buffer, grads, scale=scale, accumulate=accumulate)
        for m, grad in zip(masters, grads):
            m.grad = grad
            self._sums[id(m)] = weakref.ref(grad)

    @torch.no_grad()
    def move_from_copies(self, copies: Sequence[torch.Tensor], masters: Sequence[torch.Tensor], summed_over_ranks: bool,
                         keeper: bool) -> None:
        """At the end of a `no_sync()` backward: each copy's gradient added to its master's in float32 and dropped.
        `summed_over_ranks`: the master's gradient is reduced by a later sync (a rank's term then, and a sum the
        last sync wrote is kept by the `keeper` only); else it is whole already, a sum as a sync writes one."""
        for c, m in zip(copies, masters):
            if c.grad is None:
                continue
            if summed_over_ranks and self._summed(m) and not keeper:
                m.grad = None
            grad = c.grad.to(device=m.device, dtype=m.dtype)  # (a master on the host tier: to the host)
            m.grad = grad if m.grad is None else m.grad.add_(grad)
            c.grad = None
            if summed_over_ranks:
                self._sums.pop(id(m), None)
            else:
                self._sums[id(m)] = weakref.ref(m.grad)

    def kept_for(self, old: MasterGrads, masters: Sequence[torch.Tensor]) -> None:
        """Take over `old`'s marks of the sums it wrote into `masters` (a sync rebuilt over them)."""
        ids = {id(m) for m in masters}
        self._sums = {k: ref for k, ref in old._sums.items() if k in ids}
