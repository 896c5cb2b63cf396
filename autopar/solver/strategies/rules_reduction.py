"""Reductions DTensor gets wrong or leaves out.

sum: `sum(x, [])` / `sum(x, None)` reduce over ALL dims.

DTensor's `sum.dim_IntList` rule treats an empty dim list as "no reduction" and
keeps `Shard(d)` on the scalar output. The decomposed cross-entropy ends in
exactly this op (`sum(where(...), [])`, `sum(ne(labels, -100), [])`), so a
sharded loss input must give a `Partial` scalar: every shard sums its part and
the parts add up (exact for sum, unlike DTensor's mean -> Partial(avg), which is
wrong when ignore_index labels are spread unevenly).

mean: DTensor only offers Partial(avg) when a reduced dim is sharded, which
our vocabulary (Partial = sum) drops, so a data-parallel MSE loss had to
all-gather its input. A reduced dim sharded over some mesh axes gives a Partial
(sum) output instead: each rank computes its local mean divided by the number
of shards (`localize.mean_of_shards`), i.e. its local sum over the GLOBAL count,
exact for even shards. A Partial input stays Partial (the mean is linear); a
kept dim stays sharded (renumbered when keepdim=False).
"""
from __future__ import annotations

import torch

from autopar.solver.spec import Partial, Replicate, Shard
from autopar.solver.strategies.expand import AxisRule, Rule, expand_over_mesh
from autopar.solver.strategies.localize import reduced_dims
from autopar.tracer.nodes import differentiable

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


def mean_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    x = args[0]
    if x.dim() == 0 or not differentiable(x):
        return None  # a 0-d mean is a copy; integer means need a dtype: leave both to DTensor
    dims = reduced_dims(op, args, kwargs, x.dim())
    keepdim = op is aten.mean.dim and bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    one_axis: list[AxisRule] = [(Replicate(), Replicate()), (Partial(), Partial())]
    for d in range(x.dim()):
        if d in dims:
            one_axis.append((Partial(), Shard(d)))
        else:  # a kept dim: renumbered past the dropped dims before it
            one_axis.append((Shard(d if keepdim else d - sum(1 for r in dims if r < d)), Shard(d)))
    return expand_over_mesh(one_axis, 1, len(mesh_shape))


RULES = {
    aten.mean.default: mean_rules,
    aten.mean.dim: mean_rules,
    aten.sum.dim_IntList: sum_all_rules,
    aten.sum.default: sum_all_rules,
}
