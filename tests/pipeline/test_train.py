"""Pipelines train like one device: zoo models on 4 gloo ranks, 3 AdamW steps, loss, gradients, parameters.

Every case draws its cut points, micro-batch count, schedule and each stage's plan (strategies, ZeRO
storage, recompute) at random, as `tests.codegen` draws whole-model plans: the runtime must be exact
for any plan the solver could emit, not only the one it picks.
"""
from __future__ import annotations

import random

import pytest

from autopar.runtime.launch import run_ranks
from tests.pipeline.harness import random_case, run_cases

from autopar.pipeline.plan import SCHEDULES  # zero bubble where this torch's schedule is exact


def _check(cases) -> None:
    results = run_ranks(run_cases, 4, cases, timeout_s=400)
    assert all([label for label, _ in r] == [c.label for c in cases] for r in results)


@pytest.mark.long
@pytest.mark.timeout(500)
def test_pp2_dp2_trains_like_one_device():
    rng = random.Random(1)
    _check([random_case(name, 2, (2,), rng, SCHEDULES) for name in ("gpt2", "llama", "resnet", "mlp")])


@pytest.mark.long
@pytest.mark.timeout(500)
def test_pp4_trains_like_one_device():
    rng = random.Random(2)
    _check([random_case(name, 4, (1,), rng, SCHEDULES) for name in ("vit", "bert", "hf_gpt2")])


@pytest.mark.long
@pytest.mark.timeout(500)
def test_pp2_tp2_trains_like_one_device():
    rng = random.Random(3)
    cases = [random_case(name, 2, (2,), rng, SCHEDULES, axis_names=("tp",), zero_p=0.0) for name in ("hf_llama", "gpt2")]
    for c in cases:  # tensor parallel: some stage uses a weight split, not only the batch
        assert any(not p.use.is_replicate() for s in c.plan.stages for p in s.plan.params), c.label
    _check(cases)
