"""The traced cross-entropy's sum put back as one `nll_loss_forward`: same loss, same gradients."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import fx, nn

from autopar.codegen.fused_loss import fuse_cross_entropy_sums
from autopar.tracer import trace


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 5)

    def forward(self, x, labels):
        return F.cross_entropy(self.lin(x), labels)  # mean over the rows whose label is not -100


def _targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _loss_and_grads(gm: fx.GraphModule, model: nn.Module, x: torch.Tensor, labels: torch.Tensor):
    params = [p.detach().clone().requires_grad_() for p in (model.lin.weight, model.lin.bias)]
    (loss,) = gm(*params, x, labels)  # the traced placeholders: weight, bias, x, labels
    return loss, torch.autograd.grad(loss, params)


def test_the_unfolded_cross_entropy_sum_runs_as_one_nll_loss_with_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = _Classifier()
    x = torch.randn(6, 8)
    labels = torch.tensor([0, 4, -100, 2, -100, 1])
    traced = trace(model, (x, labels)).gm
    fused = copy.deepcopy(traced)

    assert fuse_cross_entropy_sums(fused.graph) == 1
    fused.recompile()
    assert "aten.gather.default" in _targets(traced)
    assert "aten.gather.default" not in _targets(fused) and "aten.where.self" not in _targets(fused)
    assert "aten.nll_loss_forward.default" in _targets(fused)

    loss, grads = _loss_and_grads(fused, model, x, labels)
    expected_loss, expected_grads = _loss_and_grads(traced, model, x, labels)
    eager = F.cross_entropy(model.lin(x), labels)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(loss, eager)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_a_chain_whose_values_are_read_elsewhere_stays_as_traced():
    model = _Classifier()
    x, labels = torch.randn(6, 8), torch.tensor([0, 4, -100, 2, -100, 1])
    gm = trace(model, (x, labels)).gm
    gather = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.gather.default)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = ((*output.args[0], gather),)  # the picked log-probabilities are also an output

    assert fuse_cross_entropy_sums(gm.graph) == 0
    assert "aten.gather.default" in _targets(gm)
