"""The optimizer step's scratch in the plan's memory, against what torch's AdamW allocates (its foreach form,
CUDA's default, and its per-tensor form, CPU's)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from autopar.api import capture_copy
from autopar.profiler import profile
from autopar.profiler.measure import LiveStorageTracker
from autopar.solver import solve
from autopar.solver.mesh import make_mesh
from autopar.tracer import trace


def _model() -> tuple[nn.Module, torch.Tensor]:
    # weights large against one row of activations: the step's scratch is the step's largest transient
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(96, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 1)), torch.randn(1, 96)


def _measured_step_scratch(foreach: bool) -> int:
    model, x = _model()
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    model(x).sum().backward()
    opt.step()  # makes the state
    model(x).sum().backward()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    live = [*model.parameters(), *(p.grad for p in model.parameters()), *state]
    with LiveStorageTracker(live) as tracker:
        opt.step()
    return tracker.peak_bytes - sum(t.untyped_storage().nbytes() for t in live)


@pytest.mark.parametrize("foreach", [True, False])
def test_the_plans_step_scratch_is_what_adamw_allocates(foreach):
    model, x = _model()
    traced = trace(*capture_copy(model, x, "cpu"))
    mesh = replace(make_mesh(1, hardware="cpu"), optimizer_foreach=foreach)
    plan = solve(traced, profile(traced), mesh)
    measured = _measured_step_scratch(foreach)
    params = [p.numel() * 4 for p in model.parameters()]
    # foreach: the square roots of every second moment at once; per tensor: two of the largest parameter's
    assert measured == pytest.approx(sum(params) if foreach else 2 * max(params), abs=64)  # (a 4-byte step count)
    assert plan.memory.temp_bytes == pytest.approx(measured, abs=64)
