"""BatchNorm in parallel plans: statistics of the global batch, running statistics kept as on one device.

The tiny ResNet (examples/resnet.py: 6 BatchNorm layers, train mode) on 2 gloo ranks:
- data parallel: every BatchNorm input split by batch, so each layer synchronises its
  per-channel mean and variance (`runtime.sync_batch_norm`); without that, each rank
  would normalise by the statistics of its half of the batch and the loss would differ;
- channel split: every BatchNorm input split by channel, which needs no exchange.
Loss, every gradient block, the parameters after AdamW steps and the running
statistics and batch counts after every step must match the single-device model
(`tests.codegen.harness.check_plan` compares buffers too).
"""
from __future__ import annotations

import pytest
import torch

from tests.codegen.harness import reference, run_plans, trace_model
from tests.codegen.plans import cpu_mesh, greedy_plan, load_zoo

from autopar.codegen import lower
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.sync_batch_norm import sync_batch_norm
from autopar.solver.spec import Shard

BATCH_NORM = "aten._native_batch_norm_legit_functional.default"


def _resnet():
    model, sample = load_zoo("resnet").build(batch_size=8, size="tiny", device="cpu")
    return model, sample, trace_model(model, sample)


def _batch_norm_inputs(plan) -> list:
    return [d.strategy.input_specs[0] for d in plan.nodes if d.op == BATCH_NORM]


def _lowered(rank, world, traced, plan):
    gm = lower(traced, plan, ProcessMesh((2,)))
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return calls.count(sync_batch_norm), calls.count(torch.ops.aten.copy_.default)


@pytest.mark.timeout(240)
def test_batch_split_and_channel_split_batch_norm_train_like_one_device():
    model, sample, traced = _resnet()
    mesh = cpu_mesh((2,))
    data_parallel = greedy_plan(traced, mesh, {name: "S(0)" for name in traced.input_names})
    assert _batch_norm_inputs(data_parallel) and all(s.placements == (Shard(0),) for s in _batch_norm_inputs(data_parallel))
    # every per-channel tensor split by channel: conv weights (out, in, kh, kw), BatchNorm's weights and buffers
    per_channel = {**traced.param_fqns, **traced.buffer_fqns}
    channel = greedy_plan(traced, mesh, {ph: "S(0)" for ph, fqn in per_channel.items() if not fqn.startswith("fc.")
                                         and not fqn.endswith("num_batches_tracked")})
    assert any(s.placements == (Shard(1),) for s in _batch_norm_inputs(channel))

    synced, copies = run_ranks(_lowered, 2, traced, data_parallel, timeout_s=60)[0]
    layers = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert synced == len(_batch_norm_inputs(data_parallel)) == layers == 6
    assert copies == 3 * layers  # running mean, running var and batch count written back per layer

    steps = 2
    ref = reference(model, sample, steps)
    cases = [(label, model, sample, traced, plan, ref, steps) for label, plan in (("data parallel", data_parallel), ("channels", channel))]
    for rank_results in run_ranks(run_plans, 2, (2,), cases, timeout_s=200):
        assert [label for label, _ in rank_results] == ["data parallel", "channels"]



def _sync_batch_norm_model(rank, world, model, sample, ref):
    import copy

    import autopar
    from tests.codegen.harness import LR, EPS, check_steps

    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model))  # as DDP loops do
    pm = autopar.parallelize(converted, sample, (world,))
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    return check_steps(pm, opt, ref, range(3), "SyncBatchNorm", [sample] * 3)


@pytest.mark.timeout(120)
def test_a_model_converted_to_sync_batch_norm_trains_like_one_devices_batch_norm():
    """`convert_sync_batchnorm` before `parallelize`. Traced with a process group up, SyncBatchNorm's forward
    all-gathers, which export cannot capture (and on CPU it refuses to run): the trace stopped. It is batch norm
    over the global batch, which the plan gives batch norm: loss, gradients, parameters and running statistics
    match the unconverted model on one device, 3 AdamW steps on 2 ranks."""
    model, sample, _ = _resnet()
    ref = reference(model, sample, 3)
    for worst in run_ranks(_sync_batch_norm_model, 2, model, sample, ref, timeout_s=100):
        assert worst["loss"] < 1e-5
