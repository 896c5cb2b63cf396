"""Export's functional `copy(self, src)` decomposed into ops autograd can differentiate.

A slice assignment (`out[..., :d].copy_(x)`, `shifted[:, 1:] = ids[:, :-1]`) exports as
`copy(slice, src)` followed by `slice_scatter`: the functional form of `copy_`. Its value
is `src` broadcast to `self`'s shape and cast to `self`'s dtype; `self` gives only its
shape and dtype. torch has no derivative for it ("derivative for aten::copy is not
implemented") and no decomposition of it: the graph is run with autograd by the
profiler's probes and by the generated module, and a gradient that flows through a copy
(DeepSeek-V3's attention assembles its keys from two parts this way) stopped both.

`copy_decomposition` joins the table export's `run_decompositions` applies (`capture._export`),
so export itself writes each copy as `expand` and `_to_copy` (a fresh tensor, as the copy
returns), with their derivatives, sharding rules and sizes read from the graph where they
are symbolic.
"""
from __future__ import annotations

import torch


def copy_decomposition(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return src.expand(self.shape).to(self.dtype, copy=True)
