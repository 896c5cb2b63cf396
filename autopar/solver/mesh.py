"""The logical device mesh and the hardware numbers the cost model uses.

A `Mesh` is plain data: axis names and sizes, per-axis alpha-beta link model
(optionally measured per collective kind: on gloo a reduce-scatter is not half
an all-reduce), per-device compute rate, memory bandwidth, memory capacity and
the fixed host cost of launching one op. It validates itself on construction. Presets for real hardware live in `PRESETS`;
`autopar.runtime.calibrate` measures a mesh on a live process group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class LinkCost:
    """Alpha-beta numbers of one collective kind, measured on its own (see `MeshAxis.link`)."""

    kind: str  # one of COLLECTIVE_KINDS
    alpha_s: float  # latency of one ring step of this collective
    beta_bytes_per_s: float  # bandwidth this collective reaches per link


@dataclass(frozen=True)
class MeshAxis:
    name: str
    size: int
    alpha_s: float  # latency of one collective step over this axis
    beta_bytes_per_s: float  # per-link bandwidth over this axis
    # Kinds measured separately (calibrate() fills all four); a kind not listed uses alpha_s/beta above.
    # Presets leave it empty: NCCL's ring collectives follow the one model closely.
    per_kind: tuple[LinkCost, ...] = ()
    # Latency per ring step of an all-reduce of one element (a loss sum, a token count), when measured:
    # with fewer elements than ranks most ring chunks are empty and gloo skips them, so it costs a
    # fraction of the all_reduce alpha (measured over 4 CPU ranks: ~1-2 ms against ~6 ms from 256 B up).
    scalar_alpha_s: float | None = None

    def __post_init__(self) -> None:
        kinds = [c.kind for c in self.per_kind]
        bad = [k for k in kinds if k not in COLLECTIVE_KINDS]
        if bad or len(set(kinds)) != len(kinds):
            raise ValueError(f"mesh axis {self.name!r}: per_kind kinds {kinds} must be distinct, from {COLLECTIVE_KINDS}")

    def link(self, kind: str) -> tuple[float, float]:
        """(alpha_s, beta_bytes_per_s) for collective `kind` on this axis."""
        for c in self.per_kind:
            if c.kind == kind:
                return c.alpha_s, c.beta_bytes_per_s
        return self.alpha_s, self.beta_bytes_per_s


@dataclass(frozen=True)
class AxisGroup:
    """One process group spanning several mesh axes, measured as a whole (see `Mesh.groups`)."""

    axes: tuple[int, ...]  # the mesh axes it spans, ascending
    link: MeshAxis  # its numbers, as one axis of size prod(sizes of those axes)


@dataclass(frozen=True)
class Mesh:
    axes: tuple[MeshAxis, ...]
    flops_per_s: float  # sustained matmul rate of one device (at the training dtype)
    mem_bandwidth_bytes_per_s: float  # device memory bandwidth (roofline for memory-bound ops)
    memory_bytes: float  # memory capacity of one device
    hardware: str = "custom"
    # Fixed host cost of one op (dispatch, autograd bookkeeping, kernel launch), charged per forward op and
    # per backward op on top of the roofline: it dominates small ops on CPU (tens of us per op under
    # contention, see benchmarks/calibration_accuracy.py). 0 in the GPU presets: launches there are
    # asynchronous and hide behind the kernels of any model worth sharding.
    op_overhead_s: float = 0.0
    # Host cost activation checkpointing adds per recomputed op on top of running it again (`cost.recompute_time_s`).
    # 0 in the GPU presets (it hides behind the kernels there, as op_overhead_s does).
    recompute_op_overhead_s: float = 0.0
    # Groups spanning several axes (the bucketed gradient sync of a parameter replicated over dp and tp
    # runs on one such group), measured by calibrate(): a ring over 4 ranks is not a ring over 2 with
    # the same per-step latency (on a CPU host with fewer cores than ranks every step waits for a peer
    # to be scheduled: a 16 KB all-reduce took ~6 ms over 4 ranks, ~1 ms over 2, i.e. 2-3x per ring
    # step). Unmeasured groups use the slowest axis' link.
    groups: tuple[AxisGroup, ...] = ()
    # Fixed host cost of one checkpoint region (`runtime.checkpoint`: its call in forward, the rebuild and the
    # nested backward in backward), charged per region codegen makes (`Problem.region_s`, `ilp.checkpoint_regions`).
    # Measured on CPU: ~0.1 ms a region on one idle core, against ~2 us per op recomputed in it.
    recompute_region_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.axes:
            raise ValueError("a Mesh needs at least one axis; use a single axis of size 1 for one device")
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be unique, got {names}")
        for a in self.axes:
            if a.size < 1:
                raise ValueError(f"mesh axis {a.name!r} has size {a.size}; sizes must be >= 1")
        if min(self.op_overhead_s, self.recompute_op_overhead_s, self.recompute_region_s) < 0:
            raise ValueError(f"op_overhead_s, recompute_op_overhead_s and recompute_region_s must be >= 0 seconds, "
                             f"got {self.op_overhead_s}, {self.recompute_op_overhead_s} and {self.recompute_region_s}")
        for g in self.groups:
            if len(g.axes) < 2 or list(g.axes) != sorted(set(g.axes)) or g.axes[-1] >= len(self.axes):
                raise ValueError(f"mesh group over axes {g.axes}: needs two or more distinct ascending axes of {names}")
            if g.link.size != math.prod(self.axes[a].size for a in g.axes):
                raise ValueError(f"mesh group over axes {g.axes} has size {g.link.size}, "
                                 f"not the product of those axes' sizes {[self.axes[a].size for a in g.axes]}")

    def group(self, axes: tuple[int, ...]) -> MeshAxis | None:
        """The measured group spanning exactly `axes` (ascending), if calibrate() measured one."""
        return next((g.link for g in self.groups if g.axes == axes), None)

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

    def to_json(self) -> dict:
        """Plain dict for plan files (`Mesh.from_json` inverts it)."""
        return mesh_to_json(self)

    @staticmethod
    def from_json(data: dict) -> "Mesh":
        return mesh_from_json(data)

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
            axes.append(replace(src, name=name, size=size))
        groups = self.groups if tuple(shape) == self.shape else ()  # measured for this layout only
        return replace(self, axes=tuple(axes), groups=groups)


def default_axis_names(ndim: int) -> tuple[str, ...]:
    return {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "sp", "tp")}.get(ndim, tuple(f"ax{i}" for i in range(ndim)))


# ---------------------------------------------------------------- presets
# Numbers are per device and per direction, at the training dtype the preset names
# (fp32 training on tensor cores uses TF32). `flops_per_s` is a sustained rate,
# ~70% of the datasheet dense peak, which is what large matmuls reach in practice.
def _axis(name: str, alpha_s: float, beta: float) -> MeshAxis:
    return MeshAxis(name, 1, alpha_s, beta)


PRESETS: dict[str, Mesh] = {
    # 8x H100 SXM, NVLink 4: 450 GB/s per direction per GPU; bf16 dense 989 TFLOP/s (datasheet) -> 0.7x;
    # HBM3 3.35 TB/s; 80 GB.
    "h100": Mesh((_axis("dp", 5e-6, 450e9),), flops_per_s=0.7 * 989e12,
                 mem_bandwidth_bytes_per_s=3.35e12, memory_bytes=80e9, hardware="h100"),
    # 8x A100 SXM 80GB, NVLink 3: 300 GB/s per direction; bf16 dense 312 TFLOP/s -> 0.7x; HBM2e 2.0 TB/s.
    "a100": Mesh((_axis("dp", 5e-6, 300e9),), flops_per_s=0.7 * 312e12,
                 mem_bandwidth_bytes_per_s=2.0e12, memory_bytes=80e9, hardware="a100"),
    # N nodes x 8 H100: outer axis over InfiniBand NDR (400 Gb/s = 50 GB/s per GPU), inner axis NVLink.
    "h100-ib": Mesh((_axis("node", 2e-5, 50e9), _axis("gpu", 5e-6, 450e9)), flops_per_s=0.7 * 989e12,
                    mem_bandwidth_bytes_per_s=3.35e12, memory_bytes=80e9, hardware="h100-ib"),
    # This kind of machine: gloo over loopback between CPU processes (rough; `calibrate()` measures it).
    "cpu": Mesh((_axis("dp", 5e-5, 2e9),), flops_per_s=5e10, mem_bandwidth_bytes_per_s=1e10,
                memory_bytes=16e9, hardware="cpu"),
}


def make_mesh(num_devices: int, shape: tuple[int, ...] | None = None, hardware: str = "h100",
              names: tuple[str, ...] | None = None) -> Mesh:
    """A preset's hardware laid out as `shape` (default: one axis of all devices).

    Multi-level presets ("h100-ib") map the LAST preset axis (the fast link) to
    the last mesh axis and the first to all outer axes."""
    if hardware not in PRESETS:
        raise ValueError(f"unknown hardware {hardware!r}; choose one of {sorted(PRESETS)} or calibrate a mesh")
    shape = tuple(shape) if shape is not None else (num_devices,)
    if math.prod(shape) != num_devices:
        dims = " * ".join(str(n) for n in shape)
        raise ValueError(f"mesh shape {dims} = {math.prod(shape)} != num_devices ({num_devices})")
    names = tuple(names) if names is not None else default_axis_names(len(shape))
    if len(names) != len(shape):
        raise ValueError(f"{len(names)} axis names {names} for a {len(shape)}-axis shape {shape}")
    preset = PRESETS[hardware]
    axes = []
    for i, (name, size) in enumerate(zip(names, shape)):
        src = preset.axes[-1] if i == len(shape) - 1 else preset.axes[0]
        axes.append(replace(src, name=name, size=size))
    return replace(preset, axes=tuple(axes))


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """'2x4' -> (2, 4), '8' -> (8,): the one way a mesh shape is written, on the CLI and in examples/train.py."""
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"cannot read mesh shape {text!r}; write sizes joined by x, e.g. 8 or 2x4") from None
    if any(n < 1 for n in shape):
        raise ValueError(f"mesh shape {text!r} needs positive sizes, e.g. 2x4")
    return shape


def candidate_shapes(n: int) -> list[tuple[int, ...]]:
    """Logical shapes worth trying for n devices: (n,) and every 2-D factorisation a x b with a, b > 1."""
    if n < 1:
        raise ValueError(f"number of devices must be >= 1, got {n}")
    return [(n,)] + [(a, n // a) for a in range(2, n) if n % a == 0]


def axis_to_json(a: MeshAxis) -> dict:
    out = {"name": a.name, "size": a.size, "alpha_s": a.alpha_s, "beta_bytes_per_s": a.beta_bytes_per_s}
    if a.per_kind:
        out["per_kind"] = [{"kind": c.kind, "alpha_s": c.alpha_s, "beta_bytes_per_s": c.beta_bytes_per_s} for c in a.per_kind]
    if a.scalar_alpha_s is not None:
        out["scalar_alpha_s"] = a.scalar_alpha_s
    return out


def _axis_from_json(a: dict) -> MeshAxis:
    return MeshAxis(a["name"], int(a["size"]), float(a["alpha_s"]), float(a["beta_bytes_per_s"]),
                    tuple(LinkCost(str(c["kind"]), float(c["alpha_s"]), float(c["beta_bytes_per_s"]))
                          for c in a.get("per_kind", ())),
                    None if a.get("scalar_alpha_s") is None else float(a["scalar_alpha_s"]))


def mesh_to_json(mesh: Mesh) -> dict:
    return {
        "axes": [axis_to_json(a) for a in mesh.axes],
        "flops_per_s": mesh.flops_per_s,
        "mem_bandwidth_bytes_per_s": mesh.mem_bandwidth_bytes_per_s,
        "memory_bytes": mesh.memory_bytes,
        "hardware": mesh.hardware,
        "op_overhead_s": mesh.op_overhead_s,
        "recompute_op_overhead_s": mesh.recompute_op_overhead_s,
        "recompute_region_s": mesh.recompute_region_s,
        "groups": [{"axes": list(g.axes), **axis_to_json(g.link)} for g in mesh.groups],
    }


def mesh_from_json(data: dict) -> Mesh:
    """Inverse of `mesh_to_json`; files written before `per_kind`, the overheads or `groups` existed load
    with their defaults."""
    try:
        axes = tuple(_axis_from_json(a) for a in data["axes"])
        groups = tuple(AxisGroup(tuple(int(i) for i in g["axes"]), _axis_from_json(g)) for g in data.get("groups", ()))
        return Mesh(axes, float(data["flops_per_s"]), float(data["mem_bandwidth_bytes_per_s"]),
                    float(data["memory_bytes"]), str(data.get("hardware", "custom")),
                    float(data.get("op_overhead_s", 0.0)), float(data.get("recompute_op_overhead_s", 0.0)), groups,
                    float(data.get("recompute_region_s", 0.0)))
    except (KeyError, TypeError) as err:
        raise ValueError(f"not a mesh description (missing or bad field {err}): {data!r}") from err
