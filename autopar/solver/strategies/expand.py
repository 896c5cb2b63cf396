"""Expand single-mesh-axis rules over a whole mesh (shared by the DTensor adapter and our rules)."""
from __future__ import annotations

import itertools
from typing import Sequence

from autopar.solver.spec import Placement, Spec

# One rule over one mesh axis: placements of (outputs..., inputs...) in DTensor's order.
AxisRule = tuple[Placement, ...]
# A rule over the whole mesh: (input specs, output specs).
Rule = tuple[tuple[Spec, ...], tuple[Spec, ...]]


def expand_over_mesh(one_axis: Sequence[AxisRule], num_outputs: int, mesh_ndim: int) -> list[Rule]:
    """Every combination of one per-axis rule per mesh axis (DTensor's expansion:
    a placement valid on each axis independently is valid on the whole mesh)."""
    rules: list[Rule] = []
    for combo in itertools.product(one_axis, repeat=mesh_ndim):
        width = len(combo[0])
        specs = [Spec(tuple(r[i] for r in combo)) for i in range(width)]
        rules.append((tuple(specs[num_outputs:]), tuple(specs[:num_outputs])))
    return rules
