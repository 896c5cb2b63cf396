"""Inputs the module was not lowered for: other shapes, eval mode.

A `ParallelModule` is lowered for the shapes of the sample it was traced on. Fed an
epoch's smaller last batch or another sequence length, it traces and lowers the same plan
again over the same parameters; in eval mode it runs the training graph with dropout off
once the model's own eval trace says that is all eval mode changes. Each case is checked
against one device.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from tests.codegen.harness import check_plan, local_sample, reference_steps, retracer, trace_model
from tests.codegen.plans import cpu_mesh, greedy_plan, load_zoo, random_plan

from autopar.codegen import ParallelModule, lower
from autopar.codegen.shapes import LoweringError
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh


def _gpt2(batch: int, seq: int, dropout: float = 0.0):
    return load_zoo("gpt2").build(batch_size=batch, seq_len=seq, size="tiny", device="cpu", dropout=dropout)


def _same_weights_batch(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 256, (batch, seq), generator=g), "labels": torch.randint(0, 256, (batch, seq), generator=g)}


def _train_steps(rank, world, mesh_shape, model, sample, traced, plans, ref, samples):
    mesh = ProcessMesh(mesh_shape)
    for label, plan in plans:
        torch.manual_seed(0)
        check_plan(model, sample, traced, plan, ref, len(samples), mesh, label, samples=samples)


@pytest.mark.timeout(240)
def test_other_shapes_train_like_one_device():
    """Batch 8 x 16 traced; steps at 4 x 16 (a smaller last batch), 8 x 8 (shorter sequences) and 8 x 16
    again (the first graph, kept), under a data-parallel plan and random 2x2 plans (sequence and tensor
    splits, ZeRO, recompute): loss, gradients and AdamW-updated parameters match one device at every step."""
    model, sample = _gpt2(8, 16)
    samples = [_same_weights_batch(4, 16, 1), _same_weights_batch(8, 8, 2), _same_weights_batch(8, 16, 3)]
    traced = trace_model(model, sample)
    ref = reference_steps(model, samples)
    mesh = cpu_mesh((2, 2))
    rng = random.Random(7)
    plans = [("data parallel", greedy_plan(traced, mesh, {n: "S(0)S(0)" for n in traced.input_names}))]
    plans += [(f"random {i}", random_plan(traced, mesh, rng)) for i in range(2)]
    run_ranks(_train_steps, 4, (2, 2), model, sample, traced, plans, ref, samples, timeout_s=220)


def _eval_losses(rank, world, model, sample, traced, plan, other):
    mesh = ProcessMesh((world,))
    pm = ParallelModule(lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False))),
                        traced, mesh, plan, retrace=retracer(model))
    train_graph = pm.graph_module
    pm.eval()
    with torch.no_grad():
        got = [pm(**local_sample(s, pm)[1]).item() for s in (sample, other)]
    pm.train()
    pm(**local_sample(sample, pm)[1])
    return got, pm.graph_module is train_graph


@pytest.mark.timeout(120)
def test_eval_mode_turns_dropout_off():
    """GPT-2 with dropout 0.3 (embedding, residual, attention): in eval mode the module's loss is the
    single-device model's eval loss, at the traced shapes and at others; train mode returns to the
    training graph."""
    model, sample = _gpt2(4, 16, dropout=0.3)
    other = _same_weights_batch(2, 8, 5)
    traced = trace_model(model, sample)
    mesh = cpu_mesh((2,))
    plan = greedy_plan(traced, mesh, {n: "S(0)" for n in traced.input_names})
    single = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = [single(**s).item() for s in (sample, other)]
        assert model(**sample).item() != want[0]  # dropout really changes the training loss
    for got, back_to_training in run_ranks(_eval_losses, 2, model, sample, traced, plan, other, timeout_s=100):
        assert got == pytest.approx(want, rel=1e-5)
        assert back_to_training


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)).square().mean()


class _ShapeBranch(nn.Module):
    """Code that depends on the batch's size: traced at another size it is another graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if x.shape[0] > 4:
            y = torch.tanh(y)
        return y.square().mean()


def _errors(rank, world, cases):
    mesh = ProcessMesh((world,))
    out = []
    for model, sample, traced, plan, other, evaluate in cases:
        pm = ParallelModule(lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False))),
                            traced, mesh, plan, retrace=retracer(model))
        pm.train(not evaluate)
        try:
            pm(*local_sample(other, pm)[0])
            out.append("no error")
        except LoweringError as err:
            out.append(str(err))
    return out


@pytest.mark.timeout(120)
def test_what_cannot_run_says_why():
    """Batch norm in eval mode (running statistics: not the training graph) and code that branches on the
    batch size raise, naming the op or the shapes."""
    cases = []
    for cls, other, evaluate in ((_BatchNormNet, torch.randn(8, 8), True), (_ShapeBranch, torch.randn(4, 8), False)):
        torch.manual_seed(0)
        model, sample = cls(), torch.randn(8, 8)
        traced = trace_model(model, sample)
        plan = greedy_plan(traced, cpu_mesh((2,)), {n: "S(0)" for n in traced.input_names})
        cases.append((model, (sample,), traced, plan, (other,), evaluate))
    errors = run_ranks(_errors, 2, cases, timeout_s=100)[0]
    assert "batch_norm" in errors[0] and "eval mode" in errors[0], errors[0]
    assert "[(2, 8)]" in errors[1] and "other ops" in errors[1] and "tanh" in errors[1], errors[1]
