"""The logical device mesh and the hardware numbers the cost model uses.

A `Mesh` is plain data: axis names and sizes, per-axis alpha-beta link model
(optionally measured per collective kind: on gloo a reduce-scatter is not half
an all-reduce), per-device compute rate, memory bandwidth, memory capacity and
the fixed host cost of launching one op. It validates itself on construction. Presets for real hardware live in `PRESETS`;
`autopar.runtime.calibrate` measures a mesh on a live process group.

A GPU preset keeps its matmul rate for each math mode (`ComputeRates`: fp32, TF32, bf16) and
the memory a training process holds whatever the plan (`FixedOverheads`); `Mesh.at_precision`
picks a rate, `preset_for_device` a preset by the name CUDA gives the device.

    mesh = make_mesh(8, (2, 4), preset_for_device("NVIDIA H100 80GB HBM3"), precision="tf32")
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Literal


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


Precision = Literal["fp32", "tf32", "bf16"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "tf32", "bf16")


@dataclass(frozen=True)
class ComputeRates:
    """Sustained dense matmul rates of one device per math mode: fp32 (torch's default for float32 matmuls,
    `torch.set_float32_matmul_precision("highest")`), TF32 (float32 with "high") and bf16 (bf16 or fp16 operands,
    fp32 accumulation)."""

    fp32_flops_per_s: float
    tf32_flops_per_s: float
    bf16_flops_per_s: float

    def at(self, precision: Precision) -> float:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
        return getattr(self, f"{precision}_flops_per_s")

    def scaled(self, factor: float) -> "ComputeRates":
        return ComputeRates(*(factor * r for r in (self.fp32_flops_per_s, self.tf32_flops_per_s, self.bf16_flops_per_s)))


@dataclass(frozen=True)
class FixedOverheads:
    """Device memory a training process holds whatever the plan: no tensor of the step, so no per-node number
    of the memory model, but off the device's capacity (the memory report's "device overheads" line)."""

    cuda_context_bytes: float = 0.0  # the CUDA context and the kernels loaded into it (outside torch's allocator)
    cublas_workspace_bytes: float = 0.0  # cuBLAS and cuBLASLt workspaces (from torch's caching allocator)
    nccl_bytes_per_group: float = 0.0  # NCCL's buffers for one communicator (outside torch's allocator)

    def total_bytes(self, num_groups: int) -> float:
        """For a process that talks over `num_groups` NCCL communicators (0 on one device)."""
        return self.cuda_context_bytes + self.cublas_workspace_bytes + num_groups * self.nccl_bytes_per_group


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
    # nested backward in backward), charged per region codegen makes (`Problem.region_s`, `evaluate.checkpoint_regions`).
    # Measured on CPU: ~0.1 ms a region on one idle core, against ~2 us per op recomputed in it.
    recompute_region_s: float = 0.0
    # The rate of each math mode (GPU presets), and the mode `flops_per_s` is for; None and "": one rate
    # (a calibrated or hand-made mesh)
    rates: ComputeRates | None = None
    precision: str = ""
    overheads: FixedOverheads = FixedOverheads()
    # torch's optimizers step every parameter at once (`foreach`: CUDA's default, one state-sized scratch
    # buffer for all parameters) or one after another (CPU's default: one parameter's scratch at a time)
    optimizer_foreach: bool = False
    # Forward and backward passes a training step runs for one gradient sync and one optimizer step (a pipeline
    # stage's micro-batches): a plan is priced per pass, so the bucketed sync and the step are charged 1/microbatches
    # of theirs (`cost.bucketed_all_reduce_s`, `cost.sync_latency_s`, `cost.optimizer_step_s`), while whatever runs
    # in the graph (tensor parallelism's collectives, resharding, ZeRO's gathers) is paid every pass
    microbatches: int = 1

    def __post_init__(self) -> None:
        if not self.axes:
            raise ValueError("a Mesh needs at least one axis; use a single axis of size 1 for one device")
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be unique, got {names}")
        if self.microbatches < 1:
            raise ValueError(f"a mesh's microbatches (passes a step) must be >= 1, got {self.microbatches}")
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

    def at_precision(self, precision: Precision) -> "Mesh":
        """The same devices priced at another math mode's matmul rate."""
        if self.rates is None:
            raise ValueError(f"mesh {self} has one measured compute rate, not one per precision: calibrate it "
                             f"running the training dtype, or use a preset ({', '.join(sorted(PRESETS))})")
        return replace(self, flops_per_s=self.rates.at(precision), precision=precision)

    def flops_per_s_for(self, dtype: str) -> float:
        """The matmul rate of an op whose math runs in `dtype` (a torch dtype's name, "bfloat16"; "" unknown): the
        bf16 rate for bf16 and fp16 operands, TF32's for float32 ones only when `precision` is "tf32"
        (`torch.backends.cuda.matmul.allow_tf32`, `--precision tf32`), else fp32's; a mesh with one rate
        (calibrated, hand-made) and an op of unknown dtype get `flops_per_s`."""
        if self.rates is None or not dtype:
            return self.flops_per_s
        if dtype in ("bfloat16", "float16"):
            return self.rates.bf16_flops_per_s
        return self.rates.tf32_flops_per_s if self.precision == "tf32" else self.rates.fp32_flops_per_s

    @property
    def host_link_bytes_per_s(self) -> float:
        """Host-device copy bandwidth per direction (pinned memory over PCIe: `HOST_LINKS` by preset name); a CPU
        mesh or a hand-made one copies at its memory bandwidth (host and device are the same memory there)."""
        return HOST_LINKS.get(self.hardware, self.mem_bandwidth_bytes_per_s)

    def overhead_bytes(self) -> float:
        """`overheads` for this layout: one NCCL communicator per axis of more than one device, and one for the
        whole world where several axes are (the bucketed gradient sync over several axes)."""
        split = sum(1 for a in self.axes if a.size > 1)
        return self.overheads.total_bytes(split + (1 if split > 1 else 0))

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
# Numbers are per device and per direction. Compute: the datasheet's dense (not sparse) peak per math mode
# times SUSTAINED, what large matmuls reach in practice. A preset's `flops_per_s` is its bf16 rate unless
# `make_mesh(..., precision=...)` picks another.
SUSTAINED = 0.7
_MIB, _GIB = 2**20, 2**30


def _axis(name: str, alpha_s: float, beta: float) -> MeshAxis:
    return MeshAxis(name, 1, alpha_s, beta)


def _gpu(name: str, peak: ComputeRates, mem_bandwidth_bytes_per_s: float, memory_bytes: float,
         links: tuple[MeshAxis, ...], cublas_workspace_bytes: float) -> Mesh:
    rates = peak.scaled(SUSTAINED)
    # CUDA context: ~0.5 GiB with lazy module loading (CUDA 12+); NCCL: NCCL_BUFFSIZE (4 MiB) per channel and
    # peer, ~0.25 GiB a communicator on NVLink hosts. Both are estimates, for `benchmarks/gpu_check.py` to measure.
    overheads = FixedOverheads(cuda_context_bytes=512 * _MIB, cublas_workspace_bytes=cublas_workspace_bytes,
                               nccl_bytes_per_group=256 * _MIB)
    return Mesh(links, flops_per_s=rates.bf16_flops_per_s, mem_bandwidth_bytes_per_s=mem_bandwidth_bytes_per_s,
                memory_bytes=memory_bytes, hardware=name, rates=rates, precision="bf16", overheads=overheads,
                optimizer_foreach=True)


# torch's cuBLAS workspace: 4 MiB x 8 on Hopper (sm90), 4 MiB x 2 + 16 KiB x 8 elsewhere (CUBLAS_WORKSPACE_CONFIG)
_HOPPER_WORKSPACE, _WORKSPACE = 32 * _MIB, 8 * _MIB + 128 * 1024
_NVLINK3, _NVLINK4 = _axis("dp", 5e-6, 300e9), _axis("dp", 5e-6, 450e9)
_PCIE4, _PCIE5 = _axis("dp", 1e-5, 25e9), _axis("dp", 1e-5, 50e9)  # through the host: ~80% of the link
_H100_SXM = ComputeRates(67e12, 494.7e12, 989.4e12)

PRESETS: dict[str, Mesh] = {
    # 8x H100 SXM, NVLink 4 (450 GB/s per direction); HBM3 3.35 TB/s; 80 GB (79.1 GiB as CUDA reports it)
    "h100": _gpu("h100", _H100_SXM, 3.35e12, 79.1 * _GIB, (_NVLINK4,), _HOPPER_WORKSPACE),
    # H100 PCIe: fp32 51, TF32 378, bf16 756 TFLOP/s; HBM2e 2.0 TB/s; PCIe 5
    "h100-pcie": _gpu("h100-pcie", ComputeRates(51e12, 378e12, 756e12), 2.0e12, 79.1 * _GIB, (_PCIE5,),
                      _HOPPER_WORKSPACE),
    # H200 SXM: H100's compute; HBM3e 4.8 TB/s; 141 GB (140.4 GiB); NVLink 4
    "h200": _gpu("h200", _H100_SXM, 4.8e12, 140.4 * _GIB, (_NVLINK4,), _HOPPER_WORKSPACE),
    # A100 SXM: fp32 19.5, TF32 156, bf16 312 TFLOP/s; NVLink 3 (300 GB/s per direction); 80 GB: HBM2e 2.0 TB/s
    "a100": _gpu("a100", ComputeRates(19.5e12, 156e12, 312e12), 2.0e12, 79.2 * _GIB, (_NVLINK3,), _WORKSPACE),
    # A100 40 GB: HBM2 1.555 TB/s
    "a100-40gb": _gpu("a100-40gb", ComputeRates(19.5e12, 156e12, 312e12), 1.555e12, 39.4 * _GIB, (_NVLINK3,),
                      _WORKSPACE),
    # L4: fp32 30.3, TF32 60, bf16 121 TFLOP/s; GDDR6 300 GB/s; 24 GB; PCIe 4, no NVLink
    "l4": _gpu("l4", ComputeRates(30.3e12, 60e12, 121e12), 300e9, 22.0 * _GIB, (_PCIE4,), _WORKSPACE),
    # RTX 4090: fp32 82.6, TF32 82.6, bf16 165.2 TFLOP/s (fp32 accumulation); GDDR6X 1.0 TB/s; 24 GB; PCIe 4 with
    # no peer-to-peer: every collective goes through host memory
    "rtx4090": _gpu("rtx4090", ComputeRates(82.6e12, 82.6e12, 165.2e12), 1.008e12, 23.6 * _GIB,
                    (_axis("dp", 2e-5, 12e9),), _WORKSPACE),
    # V100 SXM2 32 GB: fp32 15.7 TFLOP/s and no TF32; its half-precision rate (fp16 tensor cores, 125 TFLOP/s)
    # stands in the bf16 slot: it has no bf16, and a bf16 plan moves and stores fp16's bytes. HBM2 900 GB/s;
    # NVLink 2 (150 GB/s per direction); 32 GB (31.7 GiB as CUDA reports it)
    "v100": _gpu("v100", ComputeRates(15.7e12, 15.7e12, 125e12), 900e9, 31.7 * _GIB, (_axis("dp", 5e-6, 150e9),),
                 _WORKSPACE),
    # N nodes x 8 H100: outer axis over InfiniBand NDR (400 Gb/s = 50 GB/s per GPU), inner axis NVLink.
    "h100-ib": _gpu("h100-ib", _H100_SXM, 3.35e12, 79.1 * _GIB, (_axis("node", 2e-5, 50e9), _axis("gpu", 5e-6, 450e9)),
                    _HOPPER_WORKSPACE),
    # This kind of machine: gloo over loopback between CPU processes (rough; `calibrate()` measures it).
    "cpu": Mesh((_axis("dp", 5e-5, 2e9),), flops_per_s=5e10, mem_bandwidth_bytes_per_s=1e10,
                memory_bytes=16e9, hardware="cpu"),
}

# Host-device copies of pinned memory per direction, by preset: PCIe 4.0 x16 is 32 GB/s and PCIe 5.0 x16 64 GB/s
# raw; cudaMemcpyAsync reaches ~80% of that (~25 and ~50 GB/s). SXM boards (H100, H200, A100) sit behind
# their host's PCIe switch: PCIe 5 for Hopper, PCIe 4 for the A100s.
HOST_LINKS: dict[str, float] = {
    "h100": 50e9, "h100-pcie": 50e9, "h200": 50e9, "h100-ib": 50e9,
    "a100": 25e9, "a100-40gb": 25e9, "l4": 25e9, "rtx4090": 25e9,
    "v100": 12e9,  # PCIe 3.0 x16: 16 GB/s raw, ~12 GB/s measured in practice
}

# Patterns of `torch.cuda.get_device_name()` (lower case), in order: the first that matches names the preset.
# The A100s are told apart by memory, the only part of some of their names that differs.
DEVICE_NAMES: tuple[tuple[str, str], ...] = (
    (r"h200", "h200"),
    (r"h100.*(pcie|nvl)", "h100-pcie"),
    (r"h100", "h100"),
    (r"a100.*(80\s*gb|-80g)", "a100"),
    (r"a100", "a100-40gb"),
    (r"\bl4\b", "l4"),
    (r"rtx 4090", "rtx4090"),
    (r"v100", "v100"),
)


def preset_for_device(device_name: str, memory_bytes: float | None = None) -> str:
    """The preset of a GPU by the name CUDA gives it (`torch.cuda.get_device_name()`); `memory_bytes` (its
    total memory) tells an A100 of 80 GB from one of 40 GB whose name does not say."""
    name = device_name.lower()
    for pattern, preset in DEVICE_NAMES:
        if re.search(pattern, name):
            if preset == "a100-40gb" and memory_bytes is not None and memory_bytes > 60 * _GIB:
                return "a100"
            return preset
    raise ValueError(f"no preset for the GPU {device_name!r} (presets: {', '.join(sorted(PRESETS))}): measure it with "
                     "`autopar calibrate --save mesh.json` and plan with --hardware mesh.json (parallelize(..., "
                     "hardware=calibrate(...))), or name the preset closest to it")


def make_mesh(num_devices: int, shape: tuple[int, ...] | None = None, hardware: str = "h100",
              names: tuple[str, ...] | None = None, precision: Precision | None = None) -> Mesh:
    """A preset's hardware laid out as `shape` (default: one axis of all devices), priced at `precision`'s matmul
    rate (default: the preset's, bf16 on GPUs).

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
    mesh = replace(preset, axes=tuple(axes))
    return mesh if precision is None or preset.rates is None else mesh.at_precision(precision)


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
        "rates": None if mesh.rates is None else {p: mesh.rates.at(p) for p in PRECISIONS},
        "precision": mesh.precision,
        "overheads": vars(mesh.overheads),
        "optimizer_foreach": mesh.optimizer_foreach,
        "microbatches": mesh.microbatches,
    }


def mesh_from_json(data: dict) -> Mesh:
    """Inverse of `mesh_to_json`; files written before `per_kind`, the overheads, `groups` or the rates existed
    load with their defaults."""
    try:
        axes = tuple(_axis_from_json(a) for a in data["axes"])
        groups = tuple(AxisGroup(tuple(int(i) for i in g["axes"]), _axis_from_json(g)) for g in data.get("groups", ()))
        return Mesh(axes, float(data["flops_per_s"]), float(data["mem_bandwidth_bytes_per_s"]),
                    float(data["memory_bytes"]), str(data.get("hardware", "custom")),
                    float(data.get("op_overhead_s", 0.0)), float(data.get("recompute_op_overhead_s", 0.0)), groups,
                    float(data.get("recompute_region_s", 0.0)), **device_fields_from_json(data))
    except (KeyError, TypeError) as err:
        raise ValueError(f"not a mesh description (missing or bad field {err}): {data!r}") from err


def device_fields_from_json(data: dict) -> dict:
    """The `Mesh` fields of a GPU preset (`rates`, `precision`, `overheads`, `optimizer_foreach`) and its passes a step
    (`microbatches`) from a mesh's JSON, as keyword arguments; a file written before they existed gets the defaults
    (one rate, no overheads, one pass)."""
    rates = data.get("rates")
    return {"rates": None if rates is None else ComputeRates(*(float(rates[p]) for p in PRECISIONS)),
            "precision": str(data.get("precision", "")),
            "overheads": FixedOverheads(**{k: float(v) for k, v in (data.get("overheads") or {}).items()}),
            "optimizer_foreach": bool(data.get("optimizer_foreach", False)),
            "microbatches": int(data.get("microbatches", 1))}
