"""The host tier's price (`solver.offload`) against a hand count, and what it changes in a solved plan."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.profiler import profile
from autopar.solver import solve
from autopar.solver.mesh import make_mesh
from autopar.solver.offload import HOST_ADAMW_PARAMS_PER_S, offloaded_profile, tier_cost, with_offload
from autopar.tracer import trace


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(512, 1024), nn.Linear(1024, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).square().mean()


@pytest.fixture(scope="module")
def case():
    with torch.device("meta"):
        traced = trace(Wide(), torch.randn(4, 512, device="meta"))
    return traced, profile(traced, optimizer="adamw")


def test_tier_cost_is_the_hand_count(case):
    _, prof = case
    weight = prof.params["fc1.weight"]
    n = 512 * 1024
    mesh = make_mesh(2, hardware="l4")
    cost = tier_cost(weight, shard=2, mesh=mesh)
    assert mesh.host_link_bytes_per_s == 25e9  # PCIe 4
    assert cost.device_bytes_saved == (8 * n + 4) / 2  # AdamW's two float32 moments and its step, of half the rows
    assert (cost.host_params_bytes, cost.host_grads_bytes, cost.host_optimizer_bytes) == (2 * n, 2 * n, (8 * n + 4) / 2)
    assert cost.transfer_s == pytest.approx(4 * n / 25e9)  # half the gradient down, half the parameter up
    assert cost.host_step_s == pytest.approx(n / 2 / HOST_ADAMW_PARAMS_PER_S)
    assert cost.step_s == pytest.approx(cost.transfer_s + cost.host_step_s)
    assert make_mesh(1, hardware="h100").host_link_bytes_per_s == 50e9  # PCIe 5


def test_offload_makes_a_budget_feasible_and_counts_the_host(case):
    traced, prof = case
    mesh = make_mesh(1, hardware="cpu")
    state = sum(p.param_bytes + p.grad_bytes + p.optimizer_bytes for p in prof.params.values())
    names = frozenset(prof.params)
    budget = solve(traced, offloaded_profile(prof, names), mesh, time_limit_s=5).memory.total_bytes
    with pytest.raises(AutoparError, match="no plan fits"):  # the optimizer state does not fit
        solve(traced, prof, mesh, memory_budget_bytes=budget, time_limit_s=5)
    plan = with_offload(solve(traced, offloaded_profile(prof, names), mesh, memory_budget_bytes=budget, time_limit_s=5), names)
    assert plan.memory.optimizer_bytes == 0 and plan.memory.total_bytes <= budget
    assert plan.memory.host_bytes == state  # one device: every master, gradient and moment on the host
    assert set(plan.offloaded()) == names
    assert plan.time.offload_s == pytest.approx(sum(tier_cost(p, 1, mesh).step_s for p in prof.params.values()))
