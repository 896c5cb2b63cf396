"""Codegen at scale: a plan for 64 devices (8x8) lowers and trains, shape-wise, on any rank.

No 64 processes: torch's "fake" process group (`FakeStore`) gives one process the
identity of rank r of a 64-rank world, and `FakeTensorMode` runs the lowered
module's forward and backward on fake tensors, so every local shape, view size,
collective and gradient is checked without data. The plan comes from the solver
under a tight budget, so it mixes tensor parallelism and ZeRO over both axes.
Values are proven on 2-4 real gloo ranks elsewhere (tests/test_equivalence.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.codegen.plans import load_zoo

from autopar.api import capture_copy
from autopar.codegen import ParallelModule, lower
from autopar.profiler import profile
from autopar.runtime.mesh import ProcessMesh
from autopar.solver import solve
from autopar.solver.mesh import make_mesh
from autopar.tracer import trace

MESH = (8, 8)


pytestmark = pytest.mark.xdist_group("scale")  # one worker builds the 64-device plan (a 20 s fixture) once


@pytest.fixture(scope="module")
def planned():
    zoo = load_zoo("gpt2")
    torch.manual_seed(0)
    model = zoo.GPT(zoo.GPTConfig(n_layer=2, n_head=8, n_embd=256, vocab_size=512, block_size=64)).train()
    sample = {"input_ids": torch.randint(0, 512, (64, 64)), "labels": torch.randint(0, 512, (64, 64))}
    traced = trace(*capture_copy(model, sample, "cpu"))
    plan = solve(traced, profile(traced), make_mesh(64, MESH, "h100"), memory_budget_bytes=4e6)
    return model, sample, traced, plan


@pytest.mark.long
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank", [0, 27, 63])
def test_64_device_plan_lowers_and_runs_on_any_rank(planned, rank):
    model, sample, traced, plan = planned
    storage = {p.fqn: p.storage for p in plan.params}
    assert any(not p.use.is_replicate() for p in plan.params)  # the budget forces tensor parallelism
    assert any(p.zero for p in plan.params)  # and ZeRO
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
