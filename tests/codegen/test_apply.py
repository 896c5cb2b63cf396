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

from tests.codegen.harness import parallel_module, trace_model
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
