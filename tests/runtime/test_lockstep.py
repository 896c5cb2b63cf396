"""Errors on every rank: a step that fails on one rank (a trace, a plan check) or on rank 0 (the solver) raises
the same error on every rank, and a loop that catches it and calls `parallelize` again stays in step.
2 gloo ranks; the runtime's small classifier."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.codegen.harness import classifier_case, reference, train

import autopar
from autopar.errors import InfeasibleError
from autopar.runtime.launch import run_ranks
from autopar.runtime.lockstep import from_rank0, on_every_rank
from autopar.solver.plan_io import plan_to_json


def _fail_on(rank_to_fail: int, error: Exception):
    def step():
        if dist.get_rank() == rank_to_fail:
            raise error
        return dist.get_rank()
    return step


def _outcomes(rank, world):
    out = []
    for rank_to_fail, error in ((1, ValueError("bad shard on rank 1")),
                                (0, InfeasibleError("no plan fits 1 byte", min_memory_bytes=123.0))):
        try:
            on_every_rank(_fail_on(rank_to_fail, error))
        except Exception as err:  # noqa: BLE001 -- what each rank raised is the test's subject
            out.append((type(err).__name__, str(err).splitlines()[0], getattr(err, "min_memory_bytes", None)))
    try:
        from_rank0(_fail_on(0, InfeasibleError("rank 0's solver found none", min_memory_bytes=7.0)), str, int)
    except InfeasibleError as err:  # its first line: the fix the error adds below it names the budget
        out.append((type(err).__name__, str(err).splitlines()[0], err.min_memory_bytes))
    local = type("Local", (Exception,), {})  # pickle cannot find it: sent as its text
    try:
        on_every_rank(_fail_on(1, local("made in a function")))
    except Exception as err:  # noqa: BLE001
        out.append((type(err).__name__, str(err), None))
    out.append(from_rank0(lambda: 41 + dist.get_rank(), str, int))
    return out


def test_a_failure_on_any_rank_is_raised_on_every_rank(spmd):
    results = spmd(_outcomes, 2)
    assert results[0][:3] == results[1][:3] == [
        ("ValueError", "bad shard on rank 1", None),
        ("InfeasibleError", "no plan fits 1 byte", 123.0),
        ("InfeasibleError", "rank 0's solver found none", 7.0),
    ]
    assert results[0][3] == ("AutoparError", "Local: made in a function", None)
    assert results[1][3] == ("Local", "made in a function", None)  # the rank that raised it keeps its own
    assert results[0][4] == results[1][4] == 41  # rank 0's result on every rank


def _retry(rank, world, model, sample, ref):
    try:
        autopar.parallelize(model, sample, (world,), memory_budget=1.0, time_limit_s=5.0)
    except InfeasibleError as err:
        first = (str(err), err.min_memory_bytes)
    else:
        raise AssertionError("a budget of one byte fitted a plan")
    pm = autopar.parallelize(model, sample, (world,), time_limit_s=5.0)  # the loop tries again, budget relaxed
    return first, plan_to_json(pm.plan), train(pm, sample, 2)


@pytest.mark.timeout(200)
def test_a_caught_infeasible_plan_is_raised_on_every_rank_and_a_retry_stays_in_step():
    model, sample, *_ = classifier_case()
    ref = reference(model, sample, 2)
    (first0, plan0, losses0), (first1, plan1, losses1) = run_ranks(_retry, 2, model, sample, ref, timeout_s=180)
    assert first0 == first1 and first0[1] > 1.0  # the same message and minimum on both ranks
    assert plan0 == plan1
    torch.testing.assert_close(torch.tensor(losses0), torch.tensor(ref.losses), rtol=1e-5, atol=0)
    assert losses0 == losses1
