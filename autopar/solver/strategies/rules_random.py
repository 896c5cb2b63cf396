"""`bernoulli(x, p)`: the mask `nn.Dropout2d`/`Dropout3d` and stochastic depth draw, one per channel or sample.

DTensor has rules for `bernoulli(x)` (probabilities in `x`) but not for this overload, where `x`
gives only the shape and dtype of a mask drawn with one probability `p`: without a rule it ran
replicated, its input gathered (MobileViT's dropout). Its tensor argument is the same one as
`bernoulli(x)`'s, and so are its rules: the mask split as `x` is (each rank draws its part, the
runtime's RNG tracker keeping replicas equal and shards independent: `codegen/random.py`), or whole.
"""
from __future__ import annotations

import torch

from autopar.solver.strategies.dtensor_adapter import dtensor_rules
from autopar.solver.strategies.expand import Rule

aten = torch.ops.aten


def bernoulli_p_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> list[Rule] | None:
    return dtensor_rules(aten.bernoulli.default, (args[0],), {}, mesh_shape)


RULES = {aten.bernoulli.p: bernoulli_p_rules}
