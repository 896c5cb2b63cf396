"""One step of a resharding: what codegen emits as one collective node.

`autopar.solver.reshard.reshard_steps(src, dst, ...)` returns a tuple of these;
the solver prices them and codegen lowers each to an autograd-aware collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# "partial": local R -> P on one axis (coordinate 0 keeps the value, the others hold zeros);
# needed e.g. for the bias of a row-parallel addmm, whose output is Partial.
CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "slice", "partial"]


@dataclass(frozen=True)
class CollectiveStep:
    kind: CollectiveKind
    mesh_axis: int
    src_dim: int | None = None  # tensor dim the data is sharded on before the step (all_gather, all_to_all)
    dst_dim: int | None = None  # tensor dim it is sharded on after the step (reduce_scatter, all_to_all, slice)

    def __str__(self) -> str:
        dims = "".join(f" {k}={v}" for k, v in (("from", self.src_dim), ("to", self.dst_dim)) if v is not None)
        return f"{self.kind}[axis {self.mesh_axis}{dims}]"
