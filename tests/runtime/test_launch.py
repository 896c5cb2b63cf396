"""run_ranks: results by rank, remote exceptions with their traceback, timeouts that kill, a failed rendezvous
started again, each rank's stderr kept apart."""
from __future__ import annotations

import faulthandler
import logging
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.runtime.launch import RankError, init_from_env, run_ranks


def _sum_ranks(rank: int, world_size: int, scale: float) -> tuple[int, torch.Tensor, int]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, t * scale, torch.get_num_threads()


def test_results_in_rank_order(spmd):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite's processes run one thread (conftest): the ranks must set theirs to one
    try:
        results = spmd(_sum_ranks, 4, 2.0)
    finally:
        torch.set_num_threads(threads)
    # 0+1+2+3 = 6, scaled by 2 (tensors come back by value); each rank runs one intra-op thread.
    assert [(r, t.tolist(), n) for r, t, n in results] == [(r, [12.0], 1) for r in range(4)]


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("bad shard on rank 1")
    dist.barrier()  # rank 0 blocks here until it is killed


def test_exception_carries_rank_and_traceback():
    # The blocked rank 0 is killed at once: a wait for the 30 s timeout would raise the timeout's error instead.
    with pytest.raises(RankError, match="rank 1 raised ValueError: bad shard on rank 1") as info:
        run_ranks(_fail_on_rank_1, 2, timeout_s=30)
    assert info.value.rank == 1
    assert "_fail_on_rank_1" in info.value.remote_traceback


def _abort_on_rank_1(rank: int, world_size: int) -> None:
    import os
    if rank == 1:
        os.abort()  # what a gloo worker does on a broken connection: dies by a signal, without a word
    time.sleep(30)


def test_a_silent_death_is_reported_with_its_exit_code():
    with pytest.raises(RankError, match=r"rank 1 died without a result \(exit code -6\)"):
        run_ranks(_abort_on_rank_1, 2, timeout_s=30)


def _sleep_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


def test_timeout_kills_ranks():
    with pytest.raises(RankError, match=r"ranks \[0\] of 2 did not finish within timeout_s=2"):
        run_ranks(_sleep_on_rank_0, 2, timeout_s=2)  # rank 0 would sleep 60 s more: killed, not waited for


def test_init_from_env_names_the_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(AutoparError, match=r"RANK is not set; launch with `torchrun --nproc_per_node N script.py`"):
        init_from_env()


@pytest.fixture
def terminal(tmp_path):
    """A file standing for the terminal that pytest points the fault handler at, past its output capture."""
    with open(tmp_path / "terminal", "w+") as f:
        faulthandler.enable(file=f)
        try:
            yield f
        finally:
            faulthandler.enable(file=sys.__stderr__)


def test_a_deliberate_crash_keeps_its_stderr_to_itself(terminal):
    """The fault handler's dump of a rank that aborts goes to that rank's own stderr, quoted in the error,
    not to the terminal the parent's fault handler writes to."""
    with pytest.raises(RankError) as info:
        run_ranks(_abort_on_rank_1, 2, timeout_s=30)
    assert "Fatal Python error: Aborted" in str(info.value)
    terminal.seek(0)
    assert terminal.read() == ""


def _fail_rendezvous_once(marker: Path):
    init = dist.init_process_group

    def flaky(*args, **kwargs):
        if kwargs.get("rank") == 1 and not marker.exists():
            marker.touch()
            raise RuntimeError("[enforce fail at gloo/transport/tcp/pair.cc] connectFullMesh failed: Connection closed by peer")
        return init(*args, **kwargs)

    return flaky


def test_a_failed_rendezvous_starts_the_world_again(spmd, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(dist, "init_process_group", _fail_rendezvous_once(tmp_path / "failed"))
    with caplog.at_level(logging.WARNING, logger="autopar.runtime.launch"):
        results = spmd(_sum_ranks, 2, 1.0)
    assert [t.tolist() for _, t, _ in results] == [[1.0], [1.0]]
    assert (tmp_path / "failed").exists()
    assert "did not come up (rank 1: RuntimeError: [enforce fail" in caplog.text


def _rank_and_start_method(rank: int, world_size: int) -> tuple[int, str]:
    import multiprocessing as mp
    return rank, mp.get_start_method(allow_none=True) or ""


def test_spawn_runs_a_top_level_function():
    # what run_ranks does where the parent has initialised CUDA (a forked child could not use it)
    assert run_ranks(_rank_and_start_method, 2, timeout_s=120, start_method="spawn") == [(0, "spawn"), (1, "spawn")]


def test_a_parent_that_initialised_cuda_spawns_and_names_what_cannot_be_pickled(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(AutoparError, match="start by spawn.*initialised CUDA.*cannot be pickled.*module's top level"):
        run_ranks(lambda rank, world_size: rank, 2)


def test_each_rank_gets_its_own_device_when_it_first_uses_cuda(monkeypatch):
    from autopar.runtime import launch

    queued = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_lazy_call", queued.append)
    for rank in range(4):
        launch._own_device(rank, "gloo")
    assert [(call.func, call.args) for call in queued] == [(torch.cuda.set_device, (r % 2,)) for r in range(4)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(AutoparError, match="backend='nccl' needs CUDA devices"):
        launch._own_device(0, "nccl")
