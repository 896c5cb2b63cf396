"""Measure the mesh numbers the cost model uses on the live process group.

    torchrun --nproc-per-node 8 -m autopar.cli calibrate --gpus 8
    mesh = calibrate(mesh_shape=(2, 4))       # inside an initialised process group

Per mesh axis: timed all-reduces of two sizes inside that axis' groups give
latency and bandwidth from the ring formula t = 2(n-1) alpha + 2(n-1)/n * bytes / beta
(two sizes, two unknowns). Per device: the matmul rate (a square fp32 mm) and
the memory bandwidth (a large copy). Every rank returns the same Mesh: times
are reduced with MAX and rates with MIN over the world (the slowest rank sets
the pace of a synchronous step).
"""
from __future__ import annotations

import logging
import math
import os
import time

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.solver.mesh import Mesh, MeshAxis, default_axis_names

log = logging.getLogger(__name__)

_SMALL_BYTES = 4 * 1024  # latency-dominated
_LARGE_BYTES = 4 * 1024 * 1024  # bandwidth-dominated (kept small: CPU/gloo runs in tests)


def calibrate(group: dist.ProcessGroup | None = None, mesh_shape: tuple[int, ...] | None = None,
              hardware_name: str = "calibrated", reps: int = 5) -> Mesh:
    if not dist.is_initialized():
        raise AutoparError("calibrate() needs an initialised process group: call torch.distributed.init_process_group first (torchrun does)")
    world = dist.get_world_size(group)
    mesh_shape = tuple(mesh_shape) if mesh_shape is not None else (world,)
    if math.prod(mesh_shape) != world:
        raise AutoparError(f"mesh shape {' * '.join(map(str, mesh_shape))} = {math.prod(mesh_shape)} != world size ({world})")
    device = _device(group)
    rank = dist.get_rank(group)
    axes = []
    for axis, name in enumerate(default_axis_names(len(mesh_shape))):
        axis_group = _axis_group(mesh_shape, axis, rank, group)
        n = mesh_shape[axis]
        if n == 1:
            axes.append(MeshAxis(name, 1, 0.0, math.inf))
            continue
        t_small = _time_all_reduce(_SMALL_BYTES, axis_group, device, reps, group)
        t_large = _time_all_reduce(_LARGE_BYTES, axis_group, device, reps, group)
        ring = 2 * (n - 1) / n
        slope = max(t_large - t_small, 1e-12) / (_LARGE_BYTES - _SMALL_BYTES)
        beta = ring / slope
        alpha = max((t_small - ring * _SMALL_BYTES / beta) / (2 * (n - 1)), 1e-7)
        axes.append(MeshAxis(name, n, alpha, beta))
    flops = _reduce(_matmul_rate(device), dist.ReduceOp.MIN, device, group)
    bandwidth = _reduce(_copy_bandwidth(device), dist.ReduceOp.MIN, device, group)
    memory = _reduce(_memory_bytes(device), dist.ReduceOp.MIN, device, group)
    mesh = Mesh(tuple(axes), flops, bandwidth, memory, hardware_name)
    log.info("calibrate: %s, %.1f GFLOP/s, %.1f GB/s memory", mesh, flops / 1e9, bandwidth / 1e9)
    return mesh


def _device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _axis_group(mesh_shape: tuple[int, ...], axis: int, rank: int, group) -> dist.ProcessGroup:
    """This rank's group along `axis` (row-major coordinates); every rank creates every group, as new_group requires."""
    ranks = torch.arange(math.prod(mesh_shape)).reshape(mesh_shape).movedim(axis, -1).reshape(-1, mesh_shape[axis])
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


def _time_all_reduce(nbytes: int, axis_group, device: torch.device, reps: int, world_group) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(x, group=axis_group)  # warm-up (connection setup)
    dist.barrier(group=world_group)
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x, group=axis_group)
    _sync(device)
    return _reduce((time.perf_counter() - start) / reps, dist.ReduceOp.MAX, device, world_group)


def _matmul_rate(device: torch.device, n: int = 512, reps: int = 3) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _copy_bandwidth(device: torch.device, nbytes: int = 32 * 1024 * 1024, reps: int = 3) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - start)  # read + write


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _reduce(value: float, op, device: torch.device, group) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())
