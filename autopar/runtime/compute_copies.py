"""The low-precision copies a mixed-precision step computes on (`autopar.MixedPrecision`), made once per step.

    copies = ComputeCopies([(fqn, master), ...], torch.bfloat16)
    copies.refresh()                # before each forward: one pass, only when a master changed
    graph(*copies.tensors, ...)     # forward and backward run on the copies; their grads are bf16

The masters are the module's float32 parameters (what the optimizer steps). Their copies are views of
one flat buffer of the compute dtype, so refreshing all of them is one `kernels.pack` (cast and copy in
one pass: one Triton launch per source dtype on GPUs) rather than a cast per parameter. A refresh is
skipped while no master changed since the last one (their version counters: `optimizer.step()`, a load
or an in-place write bumps them), so micro-batches of one step share one set of copies.

Each copy is a leaf that requires grad when its master does: autograd accumulates the step's gradients
into the copies in the compute dtype, and the gradient sync moves them into the masters' float32 `.grad`
(`runtime.grad_sync`: cast and pack into the reduce dtype, all-reduce, unpack and accumulate).
ZeRO-sharded parameters have no copy here: their all-gather casts the shard on the way
(`runtime.collectives.all_gather_rs`).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from kernels import bucket_offsets, pack


class ComputeCopies:
    """`dtype` copies of `masters` ((fqn, parameter) pairs, on one device), refreshed by `refresh()`."""

    def __init__(self, masters: Sequence[tuple[str, nn.Parameter]], dtype: torch.dtype):
        self.dtype = dtype
        self.names = [name for name, _ in masters]
        self.masters = [p for _, p in masters]
        devices = {p.device for p in self.masters}
        if len(devices) > 1:
            raise ValueError(f"compute copies of parameters on several devices {sorted(map(str, devices))}: "
                             "move the module to one device first")
        offsets = bucket_offsets(self.masters)
        device = self.masters[0].device if self.masters else torch.device("cpu")
        self.flat = torch.empty(offsets[-1], dtype=dtype, device=device)
        self.tensors = [self.flat[o:o + m.numel()].view(m.shape).requires_grad_(m.requires_grad)
                        for m, o in zip(self.masters, offsets)]
        self.by_name = dict(zip(self.names, self.tensors))
        self.master_of = {id(c): m for c, m in zip(self.tensors, self.masters)}
        self._versions: list[int] | None = None  # the masters' versions the copies were made from

    def refresh(self) -> bool:
        """Make the copies from the masters if any master changed since the last refresh; whether it did. Each copy
        requires grad as its master does (frozen or unfrozen since)."""
        for c, m in zip(self.tensors, self.masters):
            if c.requires_grad != m.requires_grad:
                c.requires_grad_(m.requires_grad)
        versions = [m._version for m in self.masters]
        if versions == self._versions:
            return False
        with torch.no_grad():
            pack(self.masters, out=self.flat)
        self._versions = versions
        return True
