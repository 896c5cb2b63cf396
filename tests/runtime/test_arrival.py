"""A DDP loop's `if rank == 0: evaluate(); save()` under a parallel module: refused, naming the call.

Before `runtime.arrival`, rank 0's evaluation all-reduced its loss with the other ranks' next training
step (gloo then aborted the process), and its `state_dict()` hung every rank. Each case runs on 2 gloo
ranks with the wait shortened to seconds.
"""
from __future__ import annotations

import re

import pytest
import torch

from tests.codegen.harness import Classifier, LogRecords, classifier_case, local_sample, parallel_module, step

from autopar.errors import CallMismatchError
from autopar.runtime import arrival
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
    arrival.WARN_AFTER_S, arrival.TIMEOUT_S = 0.5, 1.5
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)), retrace=True)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    step(pm, opt, sample)
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
    assert re.search(r"rank 0 raised CallMismatchError: rank 0 has waited \d s in pm\.state_dict\(\) for ranks \[1\]", error)
    assert "sd = pm.state_dict()` on every rank" in error and "rank 0 has waited" in error.split("[warned:")[1]

    # data parallel: the evaluation's loss all-reduce would meet rank 1's next training step
    error = _error_of(model, sample, traced, data_parallel, lambda pm, opt: _evaluate(pm, sample))
    assert "in pm(...) in eval mode with gradients off for ranks [1]" in error and "evaluate on every rank" in error

    # a plan that exchanges activations: both forwards' input checks meet, and both ranks raise at once
    error = _error_of(model, sample, traced, tensor_parallel, lambda pm, opt: _evaluate(pm, sample))
    assert "the ranks ran forwards of different modes at once" in error
    assert "rank 0: a forward in eval mode with gradients off" in error and "rank 1: a forward in training mode with gradients on" in error

    # two different collective calls at once: the later to arrive raises, naming both
    error = _error_of(model, sample, traced, split_weight, lambda pm, opt: pm.state_dict(),
                      lambda pm, opt: pm.optimizer_state_dict(opt))
    assert "rank 0: pm.state_dict()" in error and "rank 1: pm.optimizer_state_dict(optimizer)" in error


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
