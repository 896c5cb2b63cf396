"""Mesh presets, shapes, JSON, and calibrate() on 2 real gloo ranks."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
import torch

from autopar.solver.mesh import PRESETS, Mesh, candidate_shapes, make_mesh


def test_candidate_shapes():
    assert candidate_shapes(8) == [(8,), (2, 4), (4, 2)]
    assert candidate_shapes(6) == [(6,), (2, 3), (3, 2)]
    assert candidate_shapes(1) == [(1,)]


def test_make_mesh_and_json_round_trip():
    m = make_mesh(32, (4, 8), "h100-ib")
    assert m.shape == (4, 8) and m.num_devices == 32
    assert m.axes[0].beta_bytes_per_s == PRESETS["h100-ib"].axes[0].beta_bytes_per_s  # outer axis: InfiniBand
    assert m.axes[1].beta_bytes_per_s > 5 * m.axes[0].beta_bytes_per_s  # inner axis: NVLink
    assert Mesh.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match=r"4 \* 4 = 16 != num_devices \(8\)"):
        make_mesh(8, (4, 4))
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        make_mesh(8, hardware="tpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from autopar.runtime.calibrate import calibrate

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out.put((rank, calibrate(mesh_shape=(2,)).to_json()))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_calibrate_on_two_gloo_ranks():
    ctx = mp.get_context("fork")
    port, out = _free_port(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=50) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    assert results[0] == results[1]  # every rank returns the same (MAX/MIN-reduced) numbers
    mesh = Mesh.from_json(results[0])
    ax = mesh.axes[0]
    assert ax.size == 2 and mesh.hardware == "calibrated"
    # loopback gloo on this machine: latency between 1 us and 10 ms, bandwidth between 10 MB/s and 100 GB/s
    assert 1e-7 <= ax.alpha_s < 1e-2 and 1e7 < ax.beta_bytes_per_s < 1e11
    assert 1e8 < mesh.flops_per_s < 1e13 and 1e8 < mesh.mem_bandwidth_bytes_per_s < 1e12
