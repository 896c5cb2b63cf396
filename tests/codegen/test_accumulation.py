"""Gradient accumulation: two backward calls before `optimizer.step()` give the single-device grads of the summed losses."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.codegen.harness import local_sample, loss_of, retracer, trace_model
from tests.codegen.plans import cpu_mesh, greedy_plan, load_zoo

from autopar.codegen import ParallelModule, lower
from autopar.codegen.shapes import local_block
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh


def _micro_batches(sample):
    return [{k: v[i * 4:(i + 1) * 4] for k, v in sample.items()} for i in range(2)]


def _accumulate(rank, world, model, sample, traced, plan, want):
    mesh = ProcessMesh((2,))
    pm = ParallelModule(lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False))), traced, mesh, plan)
    for micro in _micro_batches(sample):
        args, kwargs = local_sample(micro, pm)
        loss_of(pm(*args, **kwargs)).backward()  # no no_sync(): each backward syncs only its own term
    synced = [fqn for fqn, axes in pm.info.grad_sync_axes.items() if axes]
    for fqn, p in pm.named_parameters():
        ref = local_block(want[fqn], pm.info.param_storage[fqn], mesh.shape, mesh.coordinate)
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"accumulated grad of {fqn}: {m}")
    return len(synced)


@pytest.mark.timeout(120)
def test_two_micro_batches_accumulate_like_one_device():
    model, sample = load_zoo("gpt2").build(batch_size=8, seq_len=8, size="tiny", device="cpu")
    traced = trace_model(model, _micro_batches(sample)[0])
    mesh = cpu_mesh((2,))
    # batch-sharded activations with the MLP weights ZeRO-free: most grads go through the bucketed sync
    plan = greedy_plan(traced, mesh, {name: "S(0)" for name in traced.input_names})
    ref = copy.deepcopy(model)
    for micro in _micro_batches(sample):
        loss_of(ref(**micro)).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    results = run_ranks(_accumulate, 2, model, sample, traced, plan, want, timeout_s=100)
    assert all(n > 0 for n in results)  # the accumulated grads really went through GradSync


def _accumulate_without_sync(rank, world, model, sample, traced, plan, micro_batches, want):
    mesh = ProcessMesh((2,))
    pm = ParallelModule(lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False))), traced, mesh,
                        plan, retracer(model, sample))
    *first, last = micro_batches
    with pm.no_sync():  # DDP's idiom: the micro-batches before the last one keep their gradients local
        for micro in first:
            loss_of(pm(**local_sample(micro, pm)[1])).backward()
    loss_of(pm(**local_sample(last, pm)[1])).backward()
    for fqn, p in pm.named_parameters():
        ref = local_block(want[fqn], pm.info.param_storage[fqn], mesh.shape, mesh.coordinate)
        torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"accumulated grad of {fqn}: {m}")


@pytest.mark.timeout(120)
def test_no_sync_accumulates_like_one_device():
    """`pm.no_sync()` around all but the last micro-batch, one of them of another size (a graph of its own, lowered
    inside the context): the grads are one device's of the summed losses."""
    model, sample = load_zoo("gpt2").build(batch_size=8, seq_len=8, size="tiny", device="cpu")
    halves = _micro_batches(sample)
    micro_batches = [halves[0], {k: v[:2] for k, v in sample.items()}, halves[1]]
    traced = trace_model(model, micro_batches[0])
    plan = greedy_plan(traced, cpu_mesh((2,)), {name: "S(0)" for name in traced.input_names})
    ref = copy.deepcopy(model)
    for micro in micro_batches:
        loss_of(ref(**micro)).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    run_ranks(_accumulate_without_sync, 2, model, micro_batches[0], traced, plan, micro_batches, want, timeout_s=100)
