"""Shared fixtures: `spmd` runs a function on a local world of forked gloo ranks.

    def test_x(spmd):
        results = spmd(fn, 4, arg)   # fn(rank, world_size, arg) on 4 ranks, 60 s timeout
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

from autopar.runtime.launch import run_ranks

# One intra-op thread in every test process and in every process a test starts (the CLI, torchrun, the GPU
# check's stages): the suite runs two xdist workers on two cores, where a second thread per worker only contends
# with the other worker (the zoo's traces and references take about 1.5x the CPU time with two). The ranks
# `run_ranks` forks set one thread each themselves.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

# Every multi-rank test runs under a timeout: a rank stuck in a collective must fail the test, not hang CI.
DEFAULT_RANK_TIMEOUT_S = 60.0


@pytest.fixture
def spmd():
    """`run_ranks` with the suite's default timeout (pass timeout_s= to override)."""
    return functools.partial(run_ranks, timeout_s=DEFAULT_RANK_TIMEOUT_S)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked `long` first, each group in collection order: the suite runs on two xdist workers,
    and a 50 s test handed out last would leave one worker idle while the other finishes it."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
