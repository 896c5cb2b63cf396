"""Reductions DTensor gets wrong: `sum(x, [])` / `sum(x, None)` reduce over ALL dims.

DTensor's `sum.dim_IntList` rule treats an empty dim list as "no reduction" and
keeps `Shard(d)` on the scalar output. The decomposed cross-entropy ends in
exactly this op (`sum(where(...), [])`, `sum(ne(labels, -100), [])`), so a
sharded loss input must give a `Partial` scalar: every shard sums its part and
the parts add up (exact for sum, unlike DTensor's mean -> Partial(avg), which is
wrong when ignore_index labels are spread unevenly).
"""
from __future__ import annotations

import torch

from autopar.solver.spec import Partial, Replicate, Shard
from autopar.solver.strategies.expand import AxisRule, Rule, expand_over_mesh

aten = torch.ops.aten


def sum_all_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    """None (defer to DTensor) unless the op reduces over every dim."""
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    x = args[0]
    if op is aten.sum.dim_IntList and dims not in (None, []) and not (x.dim() == 0):
        return None
    one_axis: list[AxisRule] = [(Replicate(), Replicate()), (Partial(), Partial())]
    one_axis += [(Partial(), Shard(d)) for d in range(x.dim())]
    return expand_over_mesh(one_axis, 1, len(mesh_shape))


RULES = {
    aten.sum.dim_IntList: sum_all_rules,
    aten.sum.default: sum_all_rules,
}
