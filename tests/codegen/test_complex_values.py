"""Complex values between real ones (FNet's Fourier mixing) carry gradients under every plan.

Autograd differentiates complex tensors as it does floating-point ones. Every stage that decided whether a
value carries a gradient (the profiler's requires-grad analysis, the solver's arcs, codegen's gradient
reductions at resharding edges) asked `is_floating_point()`, which is False for complex: under most plans
a layer read only through an FFT trained without that gradient, silently (a linear layer followed by
`torch.fft.fft(...).real`: 14 of 16 random plans on 2 ranks left it no gradient at all). And a recomputed
region with a complex output failed in backward: its scalar root was a plain dot product, which autograd
refuses for complex values (the gradient's product is Re(sum(conj(grad) * out))).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.codegen.harness import check_cases, random_plan_cases, trace_model


class FourierMixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.ff, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.norm = nn.LayerNorm(8)

    def forward(self, x, y):
        h = self.inp(x)
        h = self.norm(h + torch.fft.fft2(h).real)  # FNet's token mixing: FFT over the sequence and hidden dims
        spectrum = torch.fft.rfft(self.ff(h), dim=-1)  # the ff layer is read through the complex values only
        h = h + torch.fft.irfft(spectrum * 0.5, n=8, dim=-1)
        return F.mse_loss(self.out(h).squeeze(-1), y)


def _sample() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, generator=g)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh_shape, plans", [((2,), 8), ((2, 2), 4)], ids=["2", "2x2"])
def test_random_plans_through_complex_values_match_one_device(mesh_shape, plans):
    torch.manual_seed(0)
    model, sample = FourierMixer(), _sample()
    traced = trace_model(model, sample)
    assert any(n.meta["val"].is_complex() for n in traced.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))
    check_cases(mesh_shape, random_plan_cases(model, sample, traced, mesh_shape, plans, seed=2))
