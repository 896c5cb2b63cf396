"""`copy(self, src)`: the functional form of `self.copy_(src)`, which export writes for a slice
assignment (`shifted[:, 1:] = ids[:, :-1]`: T5's and BART's `shift_tokens_right`).

DTensor has rules for the in-place `copy_` only. The output is `src` broadcast to `self`'s shape
and dtype; `self` gives nothing else. The rules of `add(self, src)` are sound for it: they align both
inputs with the output dim by dim (a broadcast dim replicated) and keep a Partial only where both
inputs are Partial, which the copy, linear in `src` and blind to `self`'s values, preserves.
"""
from __future__ import annotations

import torch

from autopar.solver.strategies.dtensor_adapter import dtensor_rules
from autopar.solver.strategies.expand import Rule

aten = torch.ops.aten


def copy_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    return dtensor_rules(aten.add.Tensor, tuple(args[:2]), {}, mesh_shape)


RULES = {aten.copy.default: copy_rules}
