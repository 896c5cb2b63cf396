"""`autopar::check_all(condition, message)`: an input check each rank runs on its own part (`tracer.checks`).

"Every element is true" holds for the whole tensor exactly when it holds for every part, so the
condition may arrive split on any dim or whole, and no rank waits for another. A partial sum is no
boolean (no rule offers one: `_finalize` drops Partial for bool tensors anyway).
"""
from __future__ import annotations

import torch

from autopar.solver.spec import Replicate, Shard
from autopar.solver.strategies.expand import AxisRule, Rule, expand_over_mesh
from autopar.tracer import checks  # noqa: F401  (registers the op)


def check_all_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule]:
    condition = args[0]
    one_axis: list[AxisRule] = [(Replicate(),)] + [(Shard(d),) for d in range(condition.dim())]
    return expand_over_mesh(one_axis, 0, len(mesh_shape))


RULES = {torch.ops.autopar.check_all.default: check_all_rules}
