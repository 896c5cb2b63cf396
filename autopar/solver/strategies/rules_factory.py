"""Factory ops (no tensor inputs): arange, full, zeros, ones, empty, scalar_tensor, and the random ones.

DTensor has no strategy for them. The output may be replicated, or sharded on
any dim that divides evenly: each rank then builds only its own block
(`localize.local_args` rewrites the size / the arange bounds per rank), which
is cheaper than building the whole tensor and slicing it.
Random factories (rand, randn, randint, randperm) stay replicated: a sharded draw would not
equal a slice of the replicated draw.
"""
from __future__ import annotations

import torch

from autopar.solver.spec import Replicate, Shard
from autopar.solver.strategies.expand import AxisRule, Rule, expand_over_mesh

aten = torch.ops.aten


def factory_rules(op, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...], out: torch.Tensor) -> list[Rule]:
    one_axis: list[AxisRule] = [(Replicate(),)]
    if op not in RANDOM_FACTORIES:
        one_axis += [(Shard(d),) for d in range(out.dim())]
    return expand_over_mesh(one_axis, 1, len(mesh_shape))


RANDOM_FACTORIES = frozenset({aten.rand.default, aten.randn.default, aten.randint.low, aten.randint.default, aten.randperm.default})
FACTORIES = frozenset({
    aten.arange.default, aten.arange.start, aten.arange.start_step,
    aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format, aten.empty_permuted.default,
    aten.scalar_tensor.default,
}) | RANDOM_FACTORIES
