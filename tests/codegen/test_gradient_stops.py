"""Gradient stops in the forward (`.detach()`, `torch.no_grad()` blocks) stop gradients in the parallel module.

Export writes `detach` as an `alias` once decomposed and inlines a no_grad block as ordinary ops
(`autopar.tracer.no_grad`): the graph differentiated through both, and every plan, one device's
included, trained with wrong gradients. The model here has one of each common use: a stop-gradient
target computed under no_grad (BYOL), a vector quantiser's commitment terms and its straight-through
estimator (VQ-VAE).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.codegen.harness import check_cases, random_plan_cases, trace_model
from tests.tracer.test_trace import assert_eager_gradients


class StopGradients(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.predictor = nn.Linear(16, 16)
        self.codebook = nn.Parameter(torch.randn(4, 16))

    def forward(self, x, y):
        z = self.encoder(x)
        with torch.no_grad():
            target = F.normalize(z * 2 + 1, dim=-1)  # a target the encoder must not chase
        byol = (2 - 2 * (F.normalize(self.predictor(z), dim=-1) * target).sum(-1)).mean()
        distances = (z[:, None, :] - self.codebook[None]).square().sum(-1)
        q = self.codebook[distances.argmin(-1)]
        commitment = (z - q.detach()).square().mean() + 0.25 * (z.detach() - q).square().mean()
        straight_through = z + (q - z).detach()
        return byol + commitment + (straight_through - y).square().mean()


def _sample(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 16, generator=g)


def _model() -> StopGradients:
    torch.manual_seed(0)
    return StopGradients()


def test_the_traced_graph_stops_gradients_where_the_model_does():
    model, sample = _model(), _sample()
    traced = trace_model(model, sample)
    # q.detach(), (q - z).detach(), and z's: z.detach() and the no_grad block's input, one op after CSE
    assert sum(n.target is torch.ops.aten.detach.default for n in traced.graph.nodes) == 3
    assert_eager_gradients(traced, model, sample)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh_shape, plans", [((2,), 8), ((2, 2), 4)], ids=["2", "2x2"])
def test_random_plans_with_gradient_stops_match_one_device(mesh_shape, plans):
    model, sample = _model(), _sample()
    check_cases(mesh_shape, random_plan_cases(model, sample, trace_model(model, sample), mesh_shape, plans, seed=11))
