"""A momentum encoder and a queue of keys updated in the forward (MoCo), under random plans.

MoCo's forward moves the key encoder toward the query encoder (`k.data = k.data * m + q.data * (1 - m)`,
or in place, under no_grad) and writes the batch's keys into a queue buffer at a pointer kept in another buffer.
One device's loss, gradients, parameters (the key encoder's moving ones included) and buffers are
the reference at each of three steps (the third writes at the queue's start again).
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.solver.strategies import enumerate_strategies
from tests.codegen.harness import check_cases, reference, trace_model
from tests.codegen.plans import cpu_mesh, random_plan


class MoCo(nn.Module):
    def __init__(self, in_place: bool = False, dim: int = 8, queue: int = 16, momentum: float = 0.9):
        super().__init__()
        self.in_place = in_place
        self.q = nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, dim))
        self.k = copy.deepcopy(self.q)
        self.k.requires_grad_(False)
        self.momentum = momentum
        self.register_buffer("queue", F.normalize(torch.randn(dim, queue), dim=0))
        self.register_buffer("ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, xq: torch.Tensor, xk: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.q(xq), dim=1)
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters()):
                if self.in_place:
                    pk.mul_(self.momentum).add_(pq.detach(), alpha=1 - self.momentum)
                else:  # the official MoCo code's form
                    pk.data = pk.data * self.momentum + pq.data * (1 - self.momentum)
            k = F.normalize(self.k(xk), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone()], 1) / 0.07
        loss = F.cross_entropy(logits, torch.zeros(q.shape[0], dtype=torch.long))
        with torch.no_grad():  # enqueue the global batch's keys at the pointer (a tensor: `int(ptr)` does not trace)
            slots = (self.ptr + torch.arange(k.shape[0])) % self.queue.shape[1]
            self.queue.index_copy_(1, slots, k.T)
            self.ptr.add_(k.shape[0]).remainder_(self.queue.shape[1])
        return loss


@pytest.mark.timeout(240)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("mesh_shape, count", [((2,), 2), ((2, 2), 3)])
def test_momentum_encoder_and_queue_train_like_one_device(mesh_shape, count, in_place):
    """Before: `k.data = ...` was no op export saw, and the key encoder never moved (the loss was off from
    the second step); the in-place form was refused; a ZeRO-stored key bias lost its update (2x2 plan 1)."""
    torch.manual_seed(0)
    model = MoCo(in_place)
    g = torch.Generator().manual_seed(0)
    sample = (torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g))
    traced = trace_model(model, sample)
    mesh, rng = cpu_mesh(mesh_shape), random.Random(1)
    strategies, ref = enumerate_strategies(traced, mesh), reference(model, sample, 3)  # the pointer wraps at step 3
    check_cases(mesh_shape, [(f"plan {i} on {mesh_shape}", model, sample, traced, random_plan(traced, mesh, rng, strategies),
                              ref, 3) for i in range(count)])
