"""A peer lost mid-step: the survivor's error says what happened (died or stopped) and what each rank was last
doing, above gloo's words, within the process group's timeout. 2 gloo ranks, the runtime's small classifier."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tests.codegen.harness import classifier_case, parallel_module, step

from autopar.errors import CollectiveError
from autopar.runtime.launch import RankDied, run_ranks
from autopar.runtime.mesh import ProcessMesh

GROUP_TIMEOUT_S = 10.0  # a stopped peer is reported then; long enough for a loaded host's healthy steps


def _lose_rank_1(rank, world, model, sample, traced, plan, how):
    """Rank 1 is killed (or stopped) at the start of the second step; rank 0 takes that step."""
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    step(pm, opt, sample)
    if rank == 1:
        os.kill(os.getpid(), how)
        time.sleep(60)  # (a stopped rank resumes only to be killed)
    try:
        step(pm, opt, sample)
    except CollectiveError as err:
        if how == signal.SIGSTOP:
            os.kill(pids[1], signal.SIGKILL)  # a stopped rank would outlive the test
        return str(err)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, cause", [(signal.SIGKILL, "a peer closed its connection: it died"),
                                        (signal.SIGSTOP, "a peer sent nothing for the process group's timeout")])
def test_a_lost_peer_is_reported_in_autopars_words_within_the_group_timeout(how, cause):
    model, sample, traced, data_parallel, _, _ = classifier_case()
    results = run_ranks(_lose_rank_1, 2, model, sample, traced, data_parallel, how, timeout_s=60,
                        group_timeout_s=GROUP_TIMEOUT_S, may_die={1})
    assert isinstance(results[1], RankDied)
    error = results[0]
    assert error is not None, "rank 0's step went through without its peer"
    # within the process group's timeout: the cause names the timeout (stopped) or a closed connection (died),
    # and run_ranks' own 60 s timeout would have ended a wait past it
    assert re.match(r"rank 0: [\w' -]*all-reduce[\w() ]* over ranks \[0, 1\] failed: " + re.escape(cause), error), error
    assert "rank 1: last in pm(...) in training mode with gradients on (checked call 0)" in error
    assert "gloo said: " in error
