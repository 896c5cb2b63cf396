"""Cutting a traced graph into stages: where it can be cut, what crosses, and why a model cannot be.

The stages' graphs, run one after another on one process with the model's tensors, compute the
model's loss (as total / divisor, `loss.split_loss`): what each stage sends is what the next reads.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from autopar.pipeline.cut import CutError, cut, find_layers
from autopar.pipeline.loss import LossError, split_loss
from autopar.tracer import split_sample_input
from tests.codegen.harness import call, loss_of, trace_model
from tests.pipeline.harness import micro_trace, zoo_model


def _run_stages(model: nn.Module, sample, traced, stages) -> torch.Tensor:
    """The model's loss from its stages' graphs run in order, eagerly."""
    flat, _ = pytree.tree_flatten(split_sample_input(sample))
    inputs = dict(zip(traced.input_names, flat))
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers()), **traced.constants}
    sent: dict[str, torch.Tensor] = {}
    for stage in stages:
        g = stage.traced
        state = {**g.param_fqns, **g.buffer_fqns}
        values = [tensors[state[ph.name]] if ph.name in state else inputs.get(ph.name, sent.get(ph.name))
                  for ph in g.graph.nodes if ph.op == "placeholder"]
        outs = g.gm(*values)
        sent = dict(zip(stage.sent, outs))
    return outs[0] / outs[1] if stages[-1].loss.kind == "count" else outs[0]


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_stages_in_sequence_compute_the_models_loss(name):
    model, sample, _ = zoo_model(name)
    traced = micro_trace(name, 1)
    layers = find_layers(traced)
    assert len(layers.names) == 2 and layers.cut_points(), layers
    want = loss_of(call(model, sample)).item()
    for starts in [(p,) for p in layers.cut_points()] + [layers.cut_points()]:
        stages = cut(traced, starts, layers)
        assert stages[0].user_inputs and stages[-1].is_last and not stages[-1].sent
        for before, after in zip(stages, stages[1:]):
            assert before.sent == after.received and before.sends_grad == after.receives_grad
        got = _run_stages(model, sample, traced, stages).item()
        assert abs(got - want) <= 1e-5 * abs(want), (starts, got, want)


def test_labels_go_straight_to_the_last_stage_and_tied_weights_to_both_ends():
    traced = micro_trace("gpt2", 1)
    first, last = cut(traced, (find_layers(traced).cut_points()[1],))
    assert first.user_inputs == ("input_ids",) and last.user_inputs == ("labels",)
    assert "transformer.wte.weight" in first.traced.param_fqns.values()
    assert "transformer.wte.weight" in last.traced.param_fqns.values()  # the LM head reads it
    assert split_loss(traced).kind == "count" and last.traced.output_names == ("sum_2", "_to_copy")


class _Flat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x)).pow(2).mean()


class _Twice(nn.Module):
    """Its layers run twice, one pass after the other: each layer's ops span both passes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for _ in range(2):
            for layer in self.layers:
                x = torch.relu(layer(x))
        return x.pow(2).mean()


class _PlusMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.mean() + x.max()


def test_models_that_cannot_be_cut_say_why():
    x = torch.randn(4, 8)
    with pytest.raises(CutError, match="no numbered layers"):
        cut(trace_model(_Flat(), (x,)), ())
    with pytest.raises(CutError, match="do not run one after another"):
        cut(trace_model(_Twice(), (x,)), ())
    with pytest.raises(LossError, match="does not add up over micro-batches"):
        split_loss(trace_model(_PlusMax(), (x,)))
    traced = micro_trace("gpt2", 1)
    with pytest.raises(CutError, match="must be one of"):
        cut(traced, (find_layers(traced).cut_points()[0] + 1,))


def test_loss_forms_that_add_up():
    x, y = torch.randn(4, 8), torch.randint(0, 8, (4,))

    class Losses(nn.Module):
        def __init__(self, reduce):
            super().__init__()
            self.layers, self.reduce = nn.ModuleList(nn.Linear(8, 8) for _ in range(2)), reduce

        def forward(self, x, y):
            for layer in self.layers:
                x = layer(x)
            return self.reduce(x, y)

    kinds = {"count": lambda x, y: F.cross_entropy(x, y), "mean": lambda x, y: F.mse_loss(x, torch.zeros_like(x)),
             "sum": lambda x, y: x.pow(2).sum()}
    for kind, reduce in kinds.items():
        assert split_loss(trace_model(Losses(reduce), (x, y))).kind == kind


def test_batch_norm_is_found():
    assert find_layers(micro_trace("resnet", 1)).batch_statistics
    assert not find_layers(micro_trace("gpt2", 1)).batch_statistics
