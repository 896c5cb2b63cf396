"""Codegen at scale: a plan for 64 devices (8x8) lowers and trains, shape-wise, on any rank.

No 64 processes: torch's "fake" process group (`FakeStore`) gives one process the
identity of rank r of a 64-rank world, and `FakeTensorMode` runs the lowered
module's forward and backward on fake tensors, so every local shape, view size,
collective and gradient is checked without data. The plan is a random valid one
(a fixed seed): a strategy per node, recompute spans and ZeRO storage, mixing
tensor parallelism and ZeRO over both axes; the solver's plans at depth are
tests/solver/test_search_starts.py's subject.
Values are proven on 2-4 real gloo ranks elsewhere (tests/test_equivalence.py).
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.codegen.plans import cpu_mesh, load_zoo, random_plan

from autopar.api import capture_copy
from autopar.codegen import ParallelModule, lower
from autopar.runtime.mesh import ProcessMesh
from autopar.tracer import trace

MESH = (8, 8)


pytestmark = pytest.mark.xdist_group("scale")  # one worker traces the model and enumerates its strategies once


@pytest.fixture(scope="module")
def planned():
    zoo = load_zoo("gpt2")
    torch.manual_seed(0)
    model = zoo.GPT(zoo.GPTConfig(n_layer=2, n_head=8, n_embd=256, vocab_size=512, block_size=64)).train()
    sample = {"input_ids": torch.randint(0, 512, (64, 64)), "labels": torch.randint(0, 512, (64, 64))}
    traced = trace(*capture_copy(model, sample, "cpu"))
    plan = random_plan(traced, cpu_mesh(MESH), random.Random(1))
    return model, sample, traced, plan


@pytest.mark.long
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 27, 63])
def test_64_device_plan_lowers_and_runs_on_any_rank(planned, rank):
    model, sample, traced, plan = planned
    storage = {p.fqn: p.storage for p in plan.params}
    assert any(not p.use.is_replicate() for p in plan.params)  # tensor parallelism
    assert any(p.zero for p in plan.params) and plan.recomputed()  # and ZeRO, and recompute
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=64)
    try:
        mesh = ProcessMesh(MESH)
        pm = ParallelModule(lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False))),
                            traced, mesh, plan)
        assert mesh.coordinate == divmod(rank, 8)
        full = dict(model.named_parameters())
        with FakeTensorMode(allow_non_fake_inputs=True):
            loss = pm(**pm.local_batch(sample))
            loss.backward()
        assert loss.shape == ()
        for fqn, p in pm.named_parameters():
            want = storage[fqn].local_shape(tuple(full[fqn].shape), MESH)
            assert tuple(p.shape) == want and p.grad is not None and tuple(p.grad.shape) == want, fqn
    finally:
        dist.destroy_process_group()
