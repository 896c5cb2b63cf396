"""The logical device mesh and the hardware numbers the cost model uses.

A `Mesh` is plain data: axis names and sizes, per-axis alpha-beta link model,
and per-device compute rate, memory bandwidth and memory capacity. It validates
itself on construction. Presets for real hardware live in `PRESETS`;
`autopar.runtime.calibrate` measures a mesh on a live process group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int
    alpha_s: float  # latency of one collective step over this axis
    beta_bytes_per_s: float  # per-link bandwidth over this axis


@dataclass(frozen=True)
class Mesh:
    axes: tuple[MeshAxis, ...]
    flops_per_s: float  # sustained matmul rate of one device (at the training dtype)
    mem_bandwidth_bytes_per_s: float  # device memory bandwidth (roofline for memory-bound ops)
    memory_bytes: float  # memory capacity of one device
    hardware: str = "custom"

    def __post_init__(self) -> None:
        if not self.axes:
            raise ValueError("a Mesh needs at least one axis; use a single axis of size 1 for one device")
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be unique, got {names}")
        for a in self.axes:
            if a.size < 1:
                raise ValueError(f"mesh axis {a.name!r} has size {a.size}; sizes must be >= 1")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.size for a in self.axes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        dims = " x ".join(f"{a.name}={a.size}" for a in self.axes)
        return f"{dims} ({self.hardware})"

    def with_shape(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> "Mesh":
        """The same hardware laid out as another logical shape.

        Axis link numbers are taken from the existing axes in order (the first
        axis is the fastest/innermost unless the preset says otherwise); extra
        axes reuse the slowest axis' numbers.
        """
        names = names or default_axis_names(len(shape))
        axes = []
        for i, (name, size) in enumerate(zip(names, shape)):
            src = self.axes[min(i, len(self.axes) - 1)]
            axes.append(MeshAxis(name, size, src.alpha_s, src.beta_bytes_per_s))
        return replace(self, axes=tuple(axes))


def default_axis_names(ndim: int) -> tuple[str, ...]:
    return {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "sp", "tp")}.get(ndim, tuple(f"ax{i}" for i in range(ndim)))
