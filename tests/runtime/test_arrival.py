"""A DDP loop's `if rank == 0: evaluate(); save()` under a parallel module: refused, naming the call.

Unchecked, rank 0's evaluation would all-reduce its loss with the other ranks' next training step (gloo
then aborts the process), and its `state_dict()` would hang every rank. Each case runs on 2 gloo ranks
with the wait shortened to seconds.
"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from tests.codegen.harness import Classifier, LogRecords, classifier_case, local_sample, parallel_module, step
from tests.codegen.plans import cpu_mesh, greedy_plan

from autopar.errors import CallMismatchError
from autopar.runtime.launch import RankError, run_ranks
from autopar.runtime.mesh import ProcessMesh


def _evaluate(pm, sample):
    args, kwargs = local_sample(sample, pm)
    pm.eval()
    with torch.no_grad():
        loss = pm(*args, **kwargs).item()
    pm.train()
    return loss


def _one_rank_calls(rank, world, model, sample, traced, plan, call_on_rank0, call_on_rank1):
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)), retrace=True)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    step(pm, opt, sample)  # (its first forward's check waits the default: ranks lower at their own pace)
    pm.call_timeout_s = 1.5
    log = LogRecords("autopar.runtime.arrival")
    try:
        if rank == 0:
            call_on_rank0(pm, opt)
        elif call_on_rank1 is not None:
            call_on_rank1(pm, opt)
        for _ in range(3):  # the training loop goes on
            step(pm, opt, sample)
    except CallMismatchError as err:
        raise CallMismatchError(f"{err} [warned: {log.messages}]") from None


def _error_of(model, sample, traced, plan, on_rank0, on_rank1=None) -> str:
    with pytest.raises(RankError) as failed:
        run_ranks(_one_rank_calls, 2, model, sample, traced, plan, on_rank0, on_rank1, timeout_s=60)
    return f"{failed.value} {failed.value.remote_traceback}"


@pytest.mark.timeout(120)
def test_a_state_dict_and_an_evaluation_on_rank_0_alone_are_refused_naming_the_call_and_the_fix():
    model, sample, traced, data_parallel, split_weight, tensor_parallel = classifier_case()

    # the gather of fc1's shards: rank 1 trains on, rank 0 waits, warns, then raises
    error = _error_of(model, sample, traced, split_weight, lambda pm, opt: pm.state_dict())
    assert re.search(r"rank 0 raised CallMismatchError: rank 0 has waited \d s in pm\.state_dict\(\) \(checked call \d\) for ranks \[1\]", error)
    assert "sd = pm.state_dict()` on every rank" in error and "rank 0 has waited" in error.split("[warned:")[1]

    # data parallel: the evaluation's loss all-reduce would meet rank 1's next training step
    error = _error_of(model, sample, traced, data_parallel, lambda pm, opt: _evaluate(pm, sample))
    assert "in pm(...) in eval mode with gradients off (checked call 1) for ranks [1]" in error and "evaluate on every rank" in error

    # a plan that exchanges activations: both forwards' input checks meet, and both ranks raise at once
    error = _error_of(model, sample, traced, tensor_parallel, lambda pm, opt: _evaluate(pm, sample))
    assert "the ranks ran forwards of different modes at once" in error
    assert "rank 0: a forward in eval mode with gradients off" in error and "rank 1: a forward in training mode with gradients on" in error

    # two different collective calls at once: the later to arrive raises, naming both
    error = _error_of(model, sample, traced, split_weight, lambda pm, opt: pm.state_dict(),
                      lambda pm, opt: pm.optimizer_state_dict(opt))
    assert "rank 0: pm.state_dict()" in error and "rank 1: pm.optimizer_state_dict(optimizer)" in error


def _errors_of_each_rank(rank, world, model, sample, traced, plan, calls):
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    pm.call_timeout_s = 20.0  # far longer than any rank takes: each must raise on its own, not time out
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    step(pm, opt, sample)
    try:
        calls[rank](pm, opt)
    except CallMismatchError as err:
        return str(err)
    return None


@pytest.mark.timeout(120)
def test_different_calls_raise_on_every_rank_at_once():
    """Rank 0 a state dict, rank 1 the optimizer's: both raise `CallMismatchError` naming both calls, well within
    the timeout: the first to arrive does not wait it out (its error is the mismatch, not the wait's)."""
    model, sample, traced, _, split_weight, _ = classifier_case()
    calls = (lambda pm, opt: pm.state_dict(), lambda pm, opt: pm.optimizer_state_dict(opt))
    for error in run_ranks(_errors_of_each_rank, 2, model, sample, traced, split_weight, calls, timeout_s=60):
        assert error is not None and "rank 0: pm.state_dict()" in error and "rank 1: pm.optimizer_state_dict(optimizer)" in error
        assert "made different collective calls" in error and "has waited" not in error, error


def _one_rank_away(rank, world, model, sample, traced, plan, timeout_s):
    """Rank 1 trains a step and stays away (as a rank that died or hangs would); rank 0 saves a checkpoint."""
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    step(pm, opt, sample)
    pm.call_timeout_s = timeout_s
    if rank == 1:
        torch.distributed.barrier()  # met once rank 0 has raised
        return None
    with pytest.raises(CallMismatchError) as raised:
        pm.state_dict()
    torch.distributed.barrier()
    return str(raised.value)


@pytest.mark.timeout(120)
def test_a_rank_that_stays_away_is_named_with_its_last_call_within_the_timeout():
    model, sample, traced, _, split_weight, _ = classifier_case()
    error = run_ranks(_one_rank_away, 2, model, sample, traced, split_weight, 2.0, timeout_s=60)[0]
    assert "rank 0 has waited 2 s in pm.state_dict() (checked call 1) for ranks [1], which have not made it" in error
    assert "rank 1: last in pm(...) in training mode with gradients on (checked call 0)" in error


def _late_and_away(rank, world, model, sample, traced, plan, timeout_s):
    """Rank 3 stays away; ranks 1 and 2 come to rank 0's state dict a second after it, so rank 0 times out first.
    What each of the others raised (its type and message)."""
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    step(pm, opt, sample)
    pm.call_timeout_s = timeout_s
    if rank == 3:
        time.sleep(2 * timeout_s)  # away until the others have raised
        return None
    if rank > 0:
        time.sleep(timeout_s / 2)
    try:
        pm.state_dict()
    except Exception as err:  # noqa: BLE001 -- what each rank saw is the test's subject
        return type(err).__name__, str(err)
    return None


@pytest.mark.timeout(120)
def test_a_rank_timing_out_after_rank_0_hears_the_timeout_not_a_closed_store():
    """Rank 0's process serves the store: after its own timeout it waits for the ranks that came to the call to
    time out too, rather than end and leave them polling a closed store (a network error, not autopar's)."""
    model, sample, traced, *_ = classifier_case()
    split_weight = greedy_plan(traced, cpu_mesh((4,)), {**{n: "S(0)" for n in traced.input_names}, "p_fc1_weight": "S(0)"})
    results = run_ranks(_late_and_away, 4, model, sample, traced, split_weight, 2.0, timeout_s=60)
    for rank in (0, 1, 2):
        kind, message = results[rank]
        assert kind == "CallMismatchError" and "for ranks [3], which have not made it" in message, (rank, kind, message)


class _Preempted(Exception):
    pass


def _terminated_while_waiting(rank, world, model, sample, traced, plan):
    """Rank 0 waits in a checked call under a SIGTERM handler (a job that saves on preemption); rank 1 sends it
    SIGTERM instead of making the call."""
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    pm.call_timeout_s = 600.0  # past run_ranks' timeout: a wait that ignored the handler would end the test there
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    pids = [None] * world
    torch.distributed.all_gather_object(pids, os.getpid())
    step(pm, opt, sample)
    if rank == 1:
        time.sleep(1.0)  # rank 0 is waiting by now
        os.kill(pids[0], signal.SIGTERM)
        torch.distributed.barrier()
        return None
    def preempted(signum, frame):
        raise _Preempted()
    signal.signal(signal.SIGTERM, preempted)
    try:
        pm.state_dict()
    except _Preempted:
        torch.distributed.barrier()
        return "preempted"
    return None


@pytest.mark.timeout(120)
def test_a_wait_gives_way_to_a_sigterm_handler():
    model, sample, traced, _, split_weight, _ = classifier_case()
    # the handler ran inside the wait, 600 s long: run_ranks' 60 s timeout would have ended a wait that ignored it
    assert run_ranks(_terminated_while_waiting, 2, model, sample, traced, split_weight, timeout_s=60)[0] == "preempted"


_PLANS = ("data parallel", "split weight", "tensor parallel")


def _every_rank_calls(rank, world, model, sample, traced, plans):
    mesh = ProcessMesh((world,))
    data_parallel = plans[0]
    out = {}
    for name, plan in zip(_PLANS, plans):
        pm = parallel_module(model, sample, traced, plan, mesh, retrace=True)
        opt = torch.optim.SGD(pm.parameters(), lr=0.1)
        losses = [_evaluate(pm, sample)]
        step(pm, opt, sample)
        losses.append(_evaluate(pm, sample))
        out[name] = (losses, pm.state_dict())
    # a plan that splits no parameter gathers nothing: rank 0 may read its state dict alone, as under DDP
    pm = parallel_module(model, sample, traced, data_parallel, mesh)
    out["rank 0 alone"] = pm.state_dict() if rank == 0 else None
    return out


@pytest.mark.timeout(120)
def test_the_same_calls_on_every_rank_give_one_devices_values():
    model, sample, traced, *plans = classifier_case()
    results = run_ranks(_every_rank_calls, 2, model, sample, traced, plans, timeout_s=90)
    with torch.no_grad():
        before = model(*sample).item()
    reference = Classifier()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(*sample).backward()
    opt.step()
    with torch.no_grad():
        after = reference(*sample).item()
    for out in results:
        for name in _PLANS:
            losses, state = out[name]
            assert losses == pytest.approx([before, after], rel=1e-6), name
            for fqn, want in reference.state_dict().items():
                torch.testing.assert_close(state[fqn], want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name} {fqn}: {m}")
    for fqn, want in model.state_dict().items():
        torch.testing.assert_close(results[0]["rank 0 alone"][fqn], want, rtol=0, atol=0)
