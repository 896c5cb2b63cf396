"""Sharding vocabulary: placements, specs and strategies as plain frozen data.

We use DTensor's words (Replicate, Shard(dim), Partial) but our own types, so
that plans are plain data (JSON) and nothing past `strategies/dtensor_adapter.py`
touches DTensor classes.

Conventions
- A `Spec` has one placement per mesh axis, in mesh-axis order.
- `str(spec)` is compact, DTensor style: `S(0)R` means "sharded on dim 0 over
  mesh axis 0, replicated over mesh axis 1".
- Every strategy emitted for the solver is *even*: a sharded dim is divisible
  by the product of the mesh axes that shard it. Uneven shapes are excluded,
  never handled approximately.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence, Union


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Partial:
    """Each rank holds a term; the full value is the sum over the axis."""

    def __str__(self) -> str:
        return "P"


Placement = Union[Replicate, Shard, Partial]

_PLACEMENT_RE = re.compile(r"R|P|S\((\d+)\)")


def parse_placements(text: str) -> tuple[Placement, ...]:
    """Inverse of `str(Spec)`: 'S(0)R' -> (Shard(0), Replicate())."""
    out: list[Placement] = []
    pos = 0
    while pos < len(text):
        m = _PLACEMENT_RE.match(text, pos)
        if m is None:
            raise ValueError(f"cannot parse placement string {text!r} at position {pos}; expected R, P or S(dim)")
        token = m.group(0)
        out.append(Replicate() if token == "R" else Partial() if token == "P" else Shard(int(m.group(1))))
        pos = m.end()
    return tuple(out)


@dataclass(frozen=True)
class Spec:
    """Placement of one tensor on the mesh: one placement per mesh axis."""

    placements: tuple[Placement, ...]

    def __str__(self) -> str:
        return "".join(str(p) for p in self.placements)

    @staticmethod
    def parse(text: str) -> "Spec":
        return Spec(parse_placements(text))

    @staticmethod
    def replicate(ndim_mesh: int) -> "Spec":
        return Spec((Replicate(),) * ndim_mesh)

    def is_replicate(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def on_mesh(self, mesh_shape: Sequence[int]) -> "Spec":
        """The same layout with Replicate on each mesh axis of one device, where a Shard is the whole tensor
        and a Partial sums one term: no collective or sharded kernel is needed to run it."""
        if all(n > 1 for n in mesh_shape):
            return self
        return Spec(tuple(p if n > 1 else Replicate() for p, n in zip(self.placements, mesh_shape)))

    def shard_factor(self, mesh_shape: Sequence[int]) -> int:
        """How many pieces the tensor is cut into (Partial does not cut)."""
        return math.prod(n for p, n in zip(self.placements, mesh_shape) if isinstance(p, Shard))

    def local_shape(self, global_shape: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of one rank's shard (even sharding only)."""
        shape = list(global_shape)
        for p, n in zip(self.placements, mesh_shape):
            if isinstance(p, Shard):
                if shape[p.dim] % n:
                    raise ValueError(f"dim {p.dim} of size {shape[p.dim]} does not divide evenly over a mesh axis of {n}")
                shape[p.dim] //= n
        return tuple(shape)


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: what it needs from its inputs and what it produces.

    `input_specs` has one entry per *tensor* argument of the node, in the order
    `autopar.solver.strategies.tensor_args(node)` lists them (None for an
    argument that is not a tensor in the graph). `output_specs` has one entry per
    tensor output (a single entry for single-output ops).
    """

    input_specs: tuple[Spec, ...]
    output_specs: tuple[Spec, ...]

    def on_mesh(self, mesh_shape: Sequence[int]) -> "Strategy":
        """`Spec.on_mesh` of every input and output spec."""
        return Strategy(tuple(s if s is None else s.on_mesh(mesh_shape) for s in self.input_specs),
                        tuple(s.on_mesh(mesh_shape) for s in self.output_specs))

    def __str__(self) -> str:
        ins = ", ".join(str(s) for s in self.input_specs)
        outs = ", ".join(str(s) for s in self.output_specs)
        return f"({ins}) -> {outs}"
