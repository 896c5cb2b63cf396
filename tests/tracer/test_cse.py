"""Common-subexpression elimination in the tracer: repeats merge, random draws and values do not change."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.tracer import trace
from autopar.tracer.cse import eliminate_common_subexpressions
from tests.tracer.test_trace import placeholder_values


def _count(traced, op) -> int:
    return sum(1 for n in traced.graph.nodes if n.target is op)


class IgnoredLabelsLoss(nn.Module):
    """Cross-entropy with ignored labels: decomposed, it tests `labels != -100` three times."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 5)

    def forward(self, x, labels):
        return F.cross_entropy(self.head(x), labels, ignore_index=-100)


def test_repeated_pure_ops_merge_and_the_loss_is_unchanged():
    torch.manual_seed(0)
    model = IgnoredLabelsLoss()
    x, labels = torch.randn(6, 8), torch.tensor([0, 4, -100, 2, -100, 1])
    traced = trace(model, (x, labels))
    assert _count(traced, torch.ops.aten.ne.Scalar) == 1  # the three tests of the mask are one node
    got = traced.gm(*placeholder_values(traced, model, (x, labels)))[0]
    torch.testing.assert_close(got, model(x, labels), rtol=0, atol=0)


class TwoDraws(nn.Module):
    def forward(self, x):
        return torch.rand_like(x) + torch.rand_like(x) + F.dropout(x, 0.5) + F.dropout(x, 0.5)


def test_random_draws_never_merge():
    x = torch.ones(4, 4)
    traced = trace(TwoDraws(), (x,))
    gm = traced.gm
    before = sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    assert eliminate_common_subexpressions(gm) == 0
    assert sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function") == before
    draws = [n for n in gm.graph.nodes if n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert len(draws) >= 4  # two rand_like and a mask per dropout
