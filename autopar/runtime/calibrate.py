"""Measure the mesh numbers the cost model uses on the live process group.

    torchrun --nproc-per-node 8 -m autopar.cli calibrate --gpus 8
    mesh = calibrate(mesh_shape=(2, 4))       # inside an initialised process group

Every number is measured with all ranks busy at once (a training step runs them
concurrently: on a CPU host they share cores, and that contention is part of
the rate a step sees), on the sizes a training step of a small model issues,
not on one large op:
- per mesh axis and per collective kind (all-reduce, all-gather, reduce-scatter,
  all-to-all, each its own `LinkCost`: gloo's reduce-scatter is not half an
  all-reduce), timed inside that axis' groups: bandwidth from the kind's ring
  formula (`autopar.solver.cost`) between two sizes, latency from the small
  size issued right after some compute, as inside a step (`_fit_links`);
- the same for every group spanning two or more axes (`Mesh.groups`: the
  bucketed gradient sync of a parameter replicated over several axes runs on
  one), since a ring's per-step latency depends on how many ranks it spans;
- per device: the fixed cost of one op (`op_overhead_s`: a chain of tiny ops
  run forward and backward, divided by the ops launched), what checkpointing
  adds per checkpoint region and per recomputed op (`recompute_region_s`,
  `recompute_op_overhead_s`: chains of two lengths with and without one
  region around them), the matmul rate over
  a mix of layer-sized matmuls (net of that overhead) and the elementwise
  "bandwidth" in the cost model's own accounting (output bytes per second of
  elementwise ops, from the slope between two activation sizes).
Every rank returns the same Mesh: times are reduced with MAX and rates with MIN
over the world (the slowest rank sets the pace of a synchronous step).
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from autopar.compat import all_gather_single, reduce_scatter_single
from autopar.errors import AutoparError
from autopar.runtime.checkpoint import checkpointed
from autopar.solver.mesh import COLLECTIVE_KINDS, AxisGroup, LinkCost, Mesh, MeshAxis, default_axis_names

log = logging.getLogger(__name__)

# Message sizes per collective (one rank's local input): small is latency-dominated, large is bandwidth-dominated
# (its bandwidth term must stand well above the latency noise of a shared CPU host: ~4 ms at 1 GB/s).
_SMALL_BYTES = 16 * 1024
_LARGE_BYTES = 4 * 1024 * 1024
# In-situ compute before a collective (see _fit_links): this matmul repeated for about _SITU_COMPUTE_S, the
# compute a step does between two blocking collectives when a plan has few (a layer's forward and backward).
# How long matters on a shared host: with 4 ranks on 2 CPU cores, a blocking all-gather of 2 ranks cost
# 0.5-0.9 ms after 1 ms of compute, 1.6-2.6 ms after 6-12 ms (its peer was further behind), then stayed.
_SITU_MATMUL = (128, 256, 256)
_SITU_COMPUTE_S = 0.005
# Layer-sized matmuls (m, k, n) of tiny-to-small transformers: a rate from one large square matmul
# overstates (GPU) or understates (contended CPU: preempted mid-op) what these reach.
_MATMULS = ((256, 64, 256), (256, 256, 256), (512, 256, 512))
_ELEMENTWISE_NUMEL = (64 * 1024, 1024 * 1024)  # 256 KB and 4 MB activations
_CHAIN_OPS = 40  # tiny ops per overhead chain (each also runs a backward op)
_SHORT_CHAIN_OPS = 10  # the shorter checkpointed chain: the region's fixed cost is where the two meet at 0 ops
_MIN_BLOCK_S = 0.02  # time a block of repetitions at least this long (spans scheduler time slices)


def calibrate(group: dist.ProcessGroup | None = None, mesh_shape: tuple[int, ...] | None = None,
              hardware_name: str | None = None, reps: int = 5) -> Mesh:
    """`reps`: timed blocks per measurement (the median block is kept). `hardware_name` defaults to
    "calibrated-<device type>" (e.g. calibrated-cpu): a plan made for it is traced as it will run
    (`api.capture_device_for`)."""
    if not dist.is_initialized():
        raise AutoparError("calibrate() needs an initialised process group: call torch.distributed.init_process_group first (torchrun does)")
    world = dist.get_world_size(group)
    mesh_shape = tuple(mesh_shape) if mesh_shape is not None else (world,)
    if math.prod(mesh_shape) != world:
        raise AutoparError(f"mesh shape {' * '.join(map(str, mesh_shape))} = {math.prod(mesh_shape)} != world size ({world})")
    device = _device(group)
    hardware_name = hardware_name or f"calibrated-{device.type}"
    rank = dist.get_rank(group)
    names = default_axis_names(len(mesh_shape))
    axes = []
    for axis, name in enumerate(names):
        n = mesh_shape[axis]
        axes.append(_measure_axis(name, mesh_shape, (axis,), rank, device, reps, group) if n > 1
                    else MeshAxis(name, 1, 0.0, math.inf))
    # every group over two or more axes of size > 1 (a size-1 axis adds no rank to a group)
    wide = [a for a, n in enumerate(mesh_shape) if n > 1]
    spans = [c for k in range(2, len(wide) + 1) for c in itertools.combinations(wide, k)]
    groups = tuple(AxisGroup(span, _measure_axis("+".join(names[a] for a in span), mesh_shape, span, rank, device, reps, group))
                   for span in spans)
    overhead, recompute_overhead, region, flops, bandwidth = _device_numbers(device, reps, group)  # times: MAX over ranks
    memory = _reduce(_memory_bytes(device), dist.ReduceOp.MIN, device, group)
    mesh = Mesh(tuple(axes), flops, bandwidth, memory, hardware_name, overhead, recompute_overhead, groups, region)
    links = "; ".join(f"{a.name} {c.kind} {c.alpha_s * 1e6:.0f} us + {c.beta_bytes_per_s / 1e6:.0f} MB/s"
                      for a in (*axes, *(g.link for g in groups)) for c in a.per_kind)
    log.info("calibrate: %s, %.1f GFLOP/s, %.1f GB/s memory, %.1f us per op, %.1f us more per recomputed op and %.0f us "
             "per checkpoint region; %s", mesh, flops / 1e9, bandwidth / 1e9, overhead * 1e6, recompute_overhead * 1e6,
             region * 1e6, links)
    return mesh


def _measure_axis(name: str, mesh_shape: tuple[int, ...], span: tuple[int, ...], rank: int, device: torch.device,
                  reps: int, group) -> MeshAxis:
    """One group over the mesh axes `span`, measured as an axis (all of its groups at once)."""
    size = math.prod(mesh_shape[a] for a in span)
    links, scalar_alpha_s = _fit_links(size, _axis_group(mesh_shape, span, rank, group), device, reps, group)
    ar = links[0]
    return MeshAxis(name, size, ar.alpha_s, ar.beta_bytes_per_s, links, scalar_alpha_s)


def _device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _axis_group(mesh_shape: tuple[int, ...], span: tuple[int, ...], rank: int, group) -> dist.ProcessGroup:
    """This rank's group along the axes `span` (row-major coordinates, the order `ProcessMesh` flattens them in);
    every rank creates every group, as new_group requires."""
    size = math.prod(mesh_shape[a] for a in span)
    tail = tuple(range(len(mesh_shape) - len(span), len(mesh_shape)))
    ranks = torch.arange(math.prod(mesh_shape)).reshape(mesh_shape).movedim(span, tail).reshape(-1, size)
    mine = None
    global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    for row in ranks.tolist():
        g = dist.new_group([global_ranks[r] for r in row])
        if rank in row:
            mine = g
    return mine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ops(fns: Sequence[Callable[[], object]], device: torch.device, reps: int, group) -> list[float]:
    """Seconds per call of each of `fns`, run on every rank at once: median over `reps` blocks, MAX over ranks.

    A block repeats one fn until it lasts _MIN_BLOCK_S (the count is agreed by all ranks so
    collectives inside stay matched). Blocks go round-robin over `fns`: on a shared machine
    the load drifts, and interleaving spreads the drift over all of them, so the differences
    calibrate() takes between two sizes stay meaningful."""
    counts = []
    for fn in fns:
        fn()  # warm-up (allocations, connection setup)
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        guess = max(time.perf_counter() - start, 1e-7)
        counts.append(float(max(1, min(1000, math.ceil(_MIN_BLOCK_S / guess)))))
    counts = _reduce_all(counts, dist.ReduceOp.MAX, device, group)
    blocks: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, count, out in zip(fns, counts, blocks):
            dist.barrier(group=group)
            _sync(device)
            start = time.perf_counter()
            for _ in range(int(count)):
                fn()
            _sync(device)
            out.append((time.perf_counter() - start) / count)
    return _reduce_all([statistics.median(b) for b in blocks], dist.ReduceOp.MAX, device, group)


def time_op(fn: Callable[[], object], device: torch.device, reps: int, group) -> float:
    """`time_ops` of one fn."""
    return time_ops([fn], device, reps, group)[0]


def collective_call(kind: str, local_bytes: int, n: int, axis_group, device: torch.device) -> Callable[[], object]:
    """A call of collective `kind` whose cost-model byte count (see `autopar.solver.cost`) is `local_bytes`
    for all_reduce / all_to_all and `local_bytes * n` (the full tensor) for all_gather / reduce_scatter."""
    numel = max(n, local_bytes // 4 // n * n)  # divisible by n for the scatter/gather kinds
    x = torch.ones(numel, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=axis_group)
    if kind == "all_gather":
        full = torch.empty(numel * n, dtype=torch.float32, device=device)
        return lambda: all_gather_single(full, x, group=axis_group)
    if kind == "reduce_scatter":
        full = torch.ones(numel * n, dtype=torch.float32, device=device)
        return lambda: reduce_scatter_single(x, full, group=axis_group)
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x, group=axis_group)


def model_bytes(kind: str, local_bytes: int, n: int) -> int:
    """The byte count the ring formula of `kind` takes for `collective_call(kind, local_bytes, n, ...)`."""
    numel = max(n, local_bytes // 4 // n * n)
    return 4 * numel * (n if kind in ("all_gather", "reduce_scatter") else 1)


def _fit_links(n: int, axis_group, device: torch.device, reps: int, world_group) -> tuple[tuple[LinkCost, ...], float]:
    """Alpha and beta of every collective kind from its ring formula t = steps * alpha + frac * bytes / beta,
    and the latency per step of a one-element all-reduce (`MeshAxis.scalar_alpha_s`), measured the same way.

    Beta: the slope between two message sizes. Alpha: from the small message issued in situ,
    right after a layer's worth of compute (what a training step does), minus that compute
    alone: ranks reach a collective out of step (another rank's core was busy, or another
    job's), and a collective waits for the last one. Timed back to back with barriers, as
    collective benchmarks do, it looks several times cheaper than it is inside a step."""
    a, b = (torch.randn(*_SITU_MATMUL[:2], device=device), torch.randn(*_SITU_MATMUL[1:], device=device))
    repeats = max(1, round(_SITU_COMPUTE_S / time_op(lambda: a @ b, device, 1, world_group)))  # same on every rank

    def compute() -> None:
        for _ in range(repeats):
            a @ b

    def in_situ(call: Callable[[], object]) -> Callable[[], object]:
        return lambda: (compute(), call())

    calls = []
    for kind in COLLECTIVE_KINDS:
        small, large = (collective_call(kind, size, n, axis_group, device) for size in (_SMALL_BYTES, _LARGE_BYTES))
        calls += [small, large, in_situ(small)]
    one = torch.ones(1, device=device)
    scalar = lambda: dist.all_reduce(one, group=axis_group)  # noqa: E731
    times = time_ops(calls + [scalar, in_situ(scalar), compute], device, reps, world_group)
    t_compute = times[-1]
    t_scalar, t_scalar_situ = times[-3:-1]
    links = []
    for i, kind in enumerate(COLLECTIVE_KINDS):
        frac = (n - 1) / n * (2 if kind == "all_reduce" else 1)
        steps = (n - 1) * (2 if kind == "all_reduce" else 1)
        small, large = (model_bytes(kind, b, n) for b in (_SMALL_BYTES, _LARGE_BYTES))
        t_small, t_large, t_situ = times[3 * i:3 * i + 3]
        if t_large > t_small:
            beta = frac * (large - small) / (t_large - t_small)
        else:  # noise swamped the difference: bound beta by putting all of the large time on the wire
            beta = frac * large / t_large
        t_latency = max(t_small, t_situ - t_compute)
        alpha = max((t_latency - frac * small / beta) / steps, 1e-7)
        links.append(LinkCost(kind, alpha, beta))
    scalar_alpha_s = max(max(t_scalar, t_scalar_situ - t_compute) / (2 * (n - 1)), 1e-7)
    return tuple(links), scalar_alpha_s


def _device_numbers(device: torch.device, reps: int, group) -> tuple[float, float, float, float, float]:
    """(op_overhead_s, recompute_op_overhead_s, recompute_region_s, matmul flops/s, elementwise bytes/s),
    timed interleaved.

    Overhead: a chain of tiny mul ops forward and backward, per op launched (one backward op each).
    Recompute: chains of tiny ops that save a tensor for backward (as most ops do), of two lengths,
    each run inside one checkpoint region (`runtime.checkpoint`, codegen's runner) and plainly. The
    difference grows with the ops by their second launch (`op_overhead_s`, which the cost model
    charges as the recompute's forward) and what checkpointing adds per op; where the line meets
    zero ops is the region's fixed cost.
    Matmuls: layer-sized ones, net of their launch. Elementwise: output bytes per second (the cost
    model's roofline accounting, see `cost.py`) from the slope between two activation sizes, so the
    launch cancels; a mix of a cheap (mul) and a transcendental (gelu) op, as activations and norms are."""
    x = torch.ones(16, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(_CHAIN_OPS - 1):
            y = y * 1.0001
        y.sum().backward()  # sum is the last forward op

    w = torch.ones(16, device=device)

    def saving_chain(ops: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(y: torch.Tensor) -> torch.Tensor:
            for _ in range(ops):
                y = y * w  # saves w for the gradient of y
            return y
        return run

    def plain(ops: int) -> Callable[[], None]:
        run = saving_chain(ops)
        return lambda: run(x).sum().backward()

    def recomputed(ops: int) -> Callable[[], None]:
        run = saving_chain(ops)  # one region called again and again, as in a step (its first call learns its outputs)
        return lambda: checkpointed(run, x).sum().backward()

    mats = [(torch.randn(m, k, device=device), torch.randn(k, n, device=device)) for m, k, n in _MATMULS]

    def matmuls() -> None:
        for a, b in mats:
            a @ b

    def elementwise(numel: int) -> Callable[[], object]:
        a = torch.ones(numel, device=device)
        b = torch.ones(numel, device=device)
        return lambda: (a * b, torch.nn.functional.gelu(a))

    small, large = _ELEMENTWISE_NUMEL
    t_chain, t_plain, t_ckpt, t_plain_short, t_ckpt_short, t_mm, t_small, t_large = time_ops(
        [chain, plain(_CHAIN_OPS), recomputed(_CHAIN_OPS), plain(_SHORT_CHAIN_OPS), recomputed(_SHORT_CHAIN_OPS),
         matmuls, elementwise(small), elementwise(large)], device, reps, group)
    overhead = t_chain / (2 * _CHAIN_OPS)
    added, added_short = t_ckpt - t_plain, t_ckpt_short - t_plain_short
    per_op = max((added - added_short) / (_CHAIN_OPS - _SHORT_CHAIN_OPS), 0.0)
    region = max(added - _CHAIN_OPS * per_op, 0.0)
    recompute_overhead = max(per_op - overhead, 0.0)
    flops = sum(2 * m * k * n for m, k, n in _MATMULS)
    rate = flops / max(t_mm - len(mats) * overhead, flops / 1e15)
    bandwidth = 2 * 4 * (large - small) / max(t_large - t_small, 1e-9)  # two ops per call
    return overhead, recompute_overhead, region, rate, bandwidth


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _reduce(value: float, op, device: torch.device, group) -> float:
    return _reduce_all([value], op, device, group)[0]


def _reduce_all(values: list[float], op, device: torch.device, group) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()
