"""A forward that changes its inputs in place changes the caller's tensors, as eager does.

`labels[labels == pad] = -100` or `features.clamp_(-3, 3)` inside a forward are traced as functional ops
whose results export reports as input mutations. The graph computed with the new values, but the
caller's tensors kept the old ones: a loop that reads its labels after the step (an accuracy over the
kept tokens) saw other values than with the eager model. Codegen now writes each new value back into
the tensor the rank fed, in the layout it was fed.
"""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.codegen.harness import check_cases, local_sample, parallel_module, random_plan_cases, trace_model
from tests.codegen.plans import cpu_mesh, random_plan
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.strategies import enumerate_strategies


class ChangesItsInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.proj, self.head = nn.Embedding(10, 8), nn.Linear(4, 8), nn.Linear(8, 10)

    def forward(self, ids, features, labels):
        labels[labels == 3] = -100  # a token class the loss ignores
        features.clamp_(-0.5, 0.5)
        return F.cross_entropy(self.head(self.emb(ids) + self.proj(features)).flatten(0, 1), labels.flatten())


def _sample() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 10, (4, 6), generator=g), torch.randn(4, 6, 4, generator=g),
            torch.randint(0, 10, (4, 6), generator=g))


def _model() -> ChangesItsInputs:
    torch.manual_seed(0)
    return ChangesItsInputs()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh_shape, plans", [((2,), 6), ((2, 2), 3)], ids=["2", "2x2"])
def test_random_plans_of_a_forward_changing_its_inputs_match_one_device(mesh_shape, plans):
    model, sample = _model(), _sample()
    traced = trace_model(model, copy.deepcopy(sample))
    assert sorted(traced.input_mutations.values()) == ["features", "labels"]
    check_cases(mesh_shape, random_plan_cases(model, sample, traced, mesh_shape, plans, seed=4))


def _fed_inputs_after_forward(rank: int, world: int, mesh_shape: tuple[int, ...], count: int) -> list[bool]:
    """Under `count` random plans: whether the tensors this rank fed hold what eager's forward left in its inputs."""
    model, sample = _model(), _sample()
    traced = trace_model(model, copy.deepcopy(sample))
    changed = copy.deepcopy(sample)
    copy.deepcopy(model)(*changed)
    mesh, rng = cpu_mesh(mesh_shape), random.Random(9)
    strategies = enumerate_strategies(traced, mesh)
    same = []
    for _ in range(count):
        pm = parallel_module(model, sample, traced, random_plan(traced, mesh, rng, strategies), ProcessMesh(mesh_shape))
        fed, _ = local_sample(copy.deepcopy(sample), pm)
        want, _ = local_sample(changed, pm)
        pm(*fed).backward()
        same.append(all(torch.equal(f, w) for f, w in zip(fed, want, strict=True)))
    return same


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_the_callers_tensors_hold_the_forwards_changes(mesh_shape):
    for same in run_ranks(_fed_inputs_after_forward, math.prod(mesh_shape), mesh_shape, 4):
        assert same == [True] * 4
