"""Writes through a boolean mask (`x[mask] = value`) split like elementwise ops under every plan.

They export as `index_put(x, [mask], value)`, whose sharding rules (torch DTensor's) take the indices for
positions along dim 0: a plan could split x along a dim the mask covers and keep the mask whole, and the
step failed with a shape mismatch. The tracer writes them as `where(mask, value, x)`
(`autopar.tracer.masked_writes`). An update through a mask (`x[mask] *= 2`) gathers the selected elements,
whose number only the data gives, and was refused; it is `where(mask, f(x), x)` when f is elementwise (a
function defined on part of the line, `sqrt`, reading a point of its domain where the mask is not set).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.codegen.harness import check_cases, random_plan_cases, trace_model
from tests.tracer.test_trace import assert_eager_gradients

from autopar.errors import TraceError


class MaskedWrites(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.fill = nn.Parameter(torch.randn(8))

    def forward(self, x, keep, y):
        scores = self.q(x) @ self.k(x).transpose(1, 2)
        scores[~keep[:, None, :].expand_as(scores)] = float("-inf")  # a mask over every dim, a scalar value
        h = scores.softmax(-1) @ self.v(x)
        h[~keep] = self.fill  # a mask over the leading dims, one row for every selected position
        h[h.abs() > 2.5] = 0  # a mask computed from the values
        h[h > 0] *= 2.0  # updates through a mask: the selected elements gathered, changed, written back
        h[~keep] += self.fill[0]
        h[h.abs() > 1] = torch.tanh(h[h.abs() > 1]) / 2
        h[h > 0.1] = h[h > 0.1].log1p().sqrt()  # functions of part of the line
        h[h < -0.5] = 0.25 / h[h < -0.5]  # a division by the selected elements
        return F.mse_loss(h, y)


def _sample() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    keep = torch.rand(4, 6, generator=g) > 0.3
    keep[:, 0] = True  # every row attends somewhere
    return torch.randn(4, 6, 8, generator=g), keep, torch.randn(4, 6, 8, generator=g)


def _model() -> MaskedWrites:
    torch.manual_seed(0)
    return MaskedWrites()


def test_masked_writes_trace_as_where_with_eagers_gradients():
    model, sample = _model(), _sample()
    traced = trace_model(model, sample)
    assert not [n for n in traced.graph.nodes if n.target in (torch.ops.aten.index_put.default, torch.ops.aten.index.Tensor)]
    # one where per write, and one before each function of part of the line (log1p, sqrt, the division)
    assert sum(n.target is torch.ops.aten.where.self for n in traced.graph.nodes) == 11
    assert_eager_gradients(traced, model, sample)


class UpdateOfPositives(nn.Module):
    """`h[h > 0] = f(h[h > 0])`."""

    def __init__(self, f):
        super().__init__()
        self.a, self.f = nn.Linear(8, 8), f

    def forward(self, x, keep, y):
        h = self.a(x)
        h[h > 0] = self.f(h[h > 0])
        return F.mse_loss(h, y)


def test_an_update_by_a_function_of_part_of_the_line_has_eagers_gradients():
    """`x[x > 0] = x[x > 0].sqrt()` was refused (as `where(mask, sqrt(x), x)` its gradient would be NaN at the
    negative x). sqrt reads 1 where the mask is not set: eager's gradients, all finite."""
    torch.manual_seed(0)
    model, sample = UpdateOfPositives(torch.sqrt), _sample()
    traced = trace_model(model, sample)
    assert not [n for n in traced.graph.nodes if n.target in (torch.ops.aten.index_put.default, torch.ops.aten.index.Tensor)]
    assert_eager_gradients(traced, model, sample)


def test_an_update_that_is_not_elementwise_is_refused():
    """A cumulative sum of the selected elements: each written value reads other selected elements."""
    with pytest.raises(TraceError, match=r"depends on tensor values \(`aten.index.Tensor`\)"):
        trace_model(UpdateOfPositives(lambda selected: selected.cumsum(0)), _sample())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh_shape, plans", [((2,), 8), ((2, 2), 4)], ids=["2", "2x2"])
def test_random_plans_with_masked_writes_match_one_device(mesh_shape, plans):
    model, sample = _model(), _sample()
    check_cases(mesh_shape, random_plan_cases(model, sample, trace_model(model, sample), mesh_shape, plans, seed=5))
