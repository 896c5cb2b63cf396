"""Input checks in the traced graph (`F.one_hot`'s) run on each rank's part, with no collective.

`autopar.tracer.checks` writes export's "every label is in range" checks as `autopar::check_all`,
whose rule takes the labels split like the batch. Every plan trains like one device, the solver's
plan keeps the labels split, and bad labels still raise the model's own message.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.codegen.harness import check_cases, random_plan_cases, trace_model
from tests.codegen.plans import cpu_mesh

import autopar
from autopar.runtime.launch import RankError, run_ranks
from autopar.solver.strategies import enumerate_strategies

CLASSES = 6


class SmoothedClassifier(nn.Module):
    """Cross-entropy against one-hot labels smoothed by hand, as many training scripts write it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, CLASSES))

    def forward(self, x, labels):
        target = F.one_hot(labels, CLASSES).float() * 0.9 + 0.1 / CLASSES
        return -(target * self.body(x).log_softmax(-1)).sum(-1).mean()


def _sample(batch: int = 8, bad_label: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(0, CLASSES, (batch,), generator=g)
    if bad_label is not None:
        labels[1::batch // 2] = bad_label  # one bad label in every rank's half
    return torch.randn(batch, 8, generator=g), labels


def _model() -> SmoothedClassifier:
    torch.manual_seed(0)
    return SmoothedClassifier()


@pytest.mark.timeout(240)
def test_random_plans_with_rank_local_checks_match_one_device():
    model, sample = _model(), _sample()
    traced = trace_model(model, sample)
    strategies = enumerate_strategies(traced, cpu_mesh((2,)))
    checks = [n.name for n in traced.graph.nodes if n.target is torch.ops.autopar.check_all.default]
    assert len(checks) == 2 and all(len(strategies[c]) == 2 for c in checks)  # the condition whole or split
    cases = random_plan_cases(model, sample, traced, (2,), 8, seed=3)
    assert any(not c[4].node(name).strategy.input_specs[0].is_replicate() for c in cases for name in checks)
    check_cases((2,), cases)


def _solver_plan(rank: int, world: int, bad_label: int | None) -> tuple[list[str], float]:
    model, sample = _model(), _sample(bad_label=bad_label)
    pm = autopar.parallelize(model, _sample(), (world,))
    specs = [str(d.strategy.input_specs[0]) for d in pm.plan.nodes if d.op == "autopar.check_all.default"]
    return specs, pm(*pm.local_batch(sample)).item()


@pytest.mark.timeout(240)
def test_the_solver_keeps_labels_split_and_bad_labels_raise_on_every_rank():
    """The solver's plan checks each rank's labels where they are (S(0): no gather), its loss is one
    device's, and labels out of range raise one_hot's own message on every rank holding one."""
    model, sample = _model(), _sample()
    specs, loss = run_ranks(_solver_plan, 2, None)[0]
    assert specs == ["S(0)", "S(0)"], specs
    assert loss == pytest.approx(model(*sample).item(), rel=1e-6)
    with pytest.raises(RankError, match="smaller than num_classes"):
        run_ranks(_solver_plan, 2, CLASSES)
