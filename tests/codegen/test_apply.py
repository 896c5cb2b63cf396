"""`pm.apply(fn)`: each module whole, as one device's `model.apply(fn)` sees it.

Weights initialised after `parallelize` (a model built on meta, then `pm.to_empty`) go through
`apply`. On a rank's blocks alone, every rank drew its block from the same random numbers: a split
weight's blocks were copies of one another, and ranks seeded apart disagreed on replicated weights.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch

from tests.codegen.harness import classifier_case, parallel_module, step, trace_model
from tests.codegen.plans import cpu_mesh, load_zoo, random_plan

from autopar.codegen.module_tree import dress_like
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh


def _initialised(rank, world, model, sample, traced, plan, init):
    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    dress_like(pm, model)  # as `parallelize` does: the init function picks modules by class
    torch.manual_seed(100 + rank)  # ranks seeded apart, as DDP loops seed data augmentation
    pm.apply(init)
    untouched = pm.apply(lambda module: None)  # changes nothing, sends nothing
    return pm.state_dict(), untouched is pm


@pytest.mark.timeout(120)
def test_apply_initialises_as_one_device_from_rank_0s_seed():
    gpt = load_zoo("gpt2")
    model, sample = gpt.build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    plans = [random_plan(traced, cpu_mesh((2,)), random.Random(seed)) for seed in (3, 4)]
    reference = copy.deepcopy(model)
    torch.manual_seed(100)
    reference.apply(gpt.GPT._init_weights)  # one device, rank 0's seed
    want = reference.state_dict()
    assert not torch.equal(want["transformer.wte.weight"], model.state_dict()["transformer.wte.weight"])
    for plan in plans:
        for state, returned_self in run_ranks(_initialised, 2, model, sample, traced, plan, gpt.GPT._init_weights, timeout_s=100):
            assert returned_self
            for fqn, value in want.items():
                torch.testing.assert_close(state[fqn], value, rtol=0, atol=0, msg=lambda m: f"{fqn}: {m}")
    assert all(any(not (p.use.is_replicate() and p.storage.is_replicate()) for p in plan.params) for plan in plans)


def _loop_initialised(rank, world, model, sample, traced, plan, through_apply):
    from autopar.runtime.optimizers import OptimizerError

    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    dress_like(pm, model)
    torch.manual_seed(0)  # every rank alike, as a loop's set_seed does
    if through_apply:
        pm.apply(lambda m: [torch.nn.init.normal_(p, std=0.02) for p in m.parameters(recurse=False) if p.dim() == 2])
    else:
        for p in pm.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in pm.parameters()]
    try:
        step(pm, opt, sample)
    except OptimizerError as err:
        return str(err), all(torch.equal(p, b) for p, b in zip(pm.parameters(), before))
    return None, False


@pytest.mark.timeout(120)
def test_an_init_loop_over_the_blocks_is_refused_at_the_first_step():
    """The loop draws each rank's block of a split weight from the same random numbers: equal blocks, the
    weight its first block repeated. Refused before the first step changes anything; the same init through
    `pm.apply` passes."""
    model, sample, traced, _, split_weight, _ = classifier_case()
    for message, untouched in run_ranks(_loop_initialised, 2, model, sample, traced, split_weight, False, timeout_s=60):
        assert message.startswith("1 split parameters hold the same values in every rank's block: fc1.weight")
        assert "pm.apply(init_fn)" in message and untouched
    for message, _ in run_ranks(_loop_initialised, 2, model, sample, traced, split_weight, True, timeout_s=60):
        assert message is None
