"""`parallelize(..., batch_dim=...)`: a model whose batch is not dim 0 takes each rank's inputs as a DDP loop
feeds them.

A sequence-first model (inputs `(seq, batch)`: nn.LSTM's, nn.GRU's and nn.Transformer's default) fed by a DDP
loop gets each rank's batch columns. With `batch_dim=1` (or one dim per input: `(1, 0)` for `(x, labels)` with
labels `(batch,)`) those are the ranks' slices of the global batch, in rank order, and the module trains like
one device on that batch. Non-loss outputs come back as each rank's columns.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import autopar
from autopar.api import capture_copy
from autopar.codegen.shapes import LoweringError
from autopar.runtime.batch import batch_slice, global_like
from autopar.runtime.launch import run_ranks
from autopar.solver.problem import _Pricer
from autopar.solver.reshard import reshard_cost
from autopar.solver.spec import Spec
from autopar.solver.strategies import enumerate_strategies
from autopar.profiler import profile
from autopar.tracer import trace
from autopar.tracer.batch_dims import BatchDimError, batch_dims
from tests.codegen.harness import EPS, LR, check_cases, reference
from tests.codegen.plans import cpu_mesh, random_plan

SEQ, BATCH, VOCAB = 6, 8, 32


class SequenceFirstLM(nn.Module):
    """Token ids and labels `(seq, batch)`, a sequence-first transformer layer; returns the loss and the logits."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)  # batch_first=False
        self.out = nn.Linear(16, VOCAB)

    def forward(self, ids, labels):
        logits = self.out(self.layer(self.emb(ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


class SequenceFirstClassifier(nn.Module):
    """Features `(seq, batch, 4)` through a sequence-first LSTM, one label per sequence `(batch,)`."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 8), nn.Linear(8, 3)

    def forward(self, x, labels):
        hidden, _ = self.rnn(x)
        return nn.functional.cross_entropy(self.head(hidden.mean(0)), labels)


def _lm_batch(seed: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (seq, BATCH), generator=g), torch.randint(0, VOCAB, (seq, BATCH), generator=g)


def _classifier_batch(seed: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(seq, BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _columns(batch: tuple, dims: tuple, rank: int, world: int) -> tuple:
    """What a DDP loop feeds rank `rank`: its contiguous part of every input along that input's batch dim."""
    return tuple(t.narrow(d, rank * t.shape[d] // world, t.shape[d] // world).contiguous() for t, d in zip(batch, dims))


def test_batch_dims_are_read_per_input():
    """An int is every tensor's batch dim where its size there is the batch's; a structure gives each input's;
    a structure that does not fit, a dim an input lacks or batches of two sizes are refused, naming the input."""
    ids, x, labels = torch.zeros(SEQ, BATCH), torch.zeros(SEQ, BATCH, 4), torch.zeros(BATCH)
    assert batch_dims((ids, ids), {}, 0) == (0, 0)
    assert batch_dims((ids, ids), {}, 1) == (1, 1)
    assert batch_dims((x, labels), {}, 1) == (1, None)  # (batch,) has no dim 1: fed whole unless said otherwise
    assert batch_dims((x, labels), {}, (1, 0)) == (1, 0)
    assert batch_dims((), {"x": x, "labels": labels, "temperature": 2.0}, {"x": 1, "labels": 0}) == (1, 0, None)
    assert batch_dims((x, labels), {}, (1, None)) == (1, None)
    assert batch_dims((torch.tensor(2.0), 3), {}, 0) == (None, None)  # only scalars: nothing batched, as before
    refused = {
        (1, 1): "positional input 1 batch dim 1, but its shape is (8,)",
        (1,): "shape batch_dim as the sample input",
        5: "no input has 6 dims",
        (2, 0): "batches of different sizes",
    }
    for batch_dim, message in refused.items():
        with pytest.raises(BatchDimError, match=message.replace("(", r"\(").replace(")", r"\)")):
            batch_dims((x, labels), {}, batch_dim)
    with pytest.raises(BatchDimError, match=r"no batch dim for \['labels'\]"):
        batch_dims((), {"x": x, "labels": labels}, {"x": 1})


def test_a_rank_slice_and_its_global_batch_follow_the_batch_dims():
    """`batch_slice` cuts each input along its own batch dim, in rank order; `global_like` gives the shapes back."""
    x, labels = _classifier_batch(0)
    for rank in range(4):
        got = batch_slice((x, labels), rank, 4, batch_dim=(1, 0))
        for t, want in zip(got, _columns((x, labels), (1, 0), rank, 4)):
            assert torch.equal(t, want)
        assert [tuple(t.shape) for t in global_like(list(got), (1, 0), 4)] == [tuple(x.shape), tuple(labels.shape)]
    ids, ids_labels = _lm_batch(0)
    got = batch_slice({"ids": ids, "labels": ids_labels}, 1, 2, batch_dim=1)
    assert torch.equal(got["ids"], ids[:, BATCH // 2:]) and torch.equal(got["labels"], ids_labels[:, BATCH // 2:])


def test_the_solver_prices_the_inputs_from_the_layout_they_are_fed_in():
    """Fed along dim 1, the token ids cost nothing to take split on dim 1 and an exchange to take split on dim 0
    (the other way round under the default dim 0)."""
    model, sample = SequenceFirstLM(), _lm_batch(0)
    mesh = cpu_mesh((2,))
    for batch_dim, free, moved in ((1, "S(1)", "S(0)"), (0, "S(0)", "S(1)")):
        traced = trace(*capture_copy(model, sample, "cpu"), batch_dim=batch_dim)
        strategies = enumerate_strategies(traced, mesh)
        pricer = _Pricer(traced, profile(traced).evaluate(), mesh, strategies)
        ids = traced.input_names[0]
        specs = [str(s.output_specs[0]) for s in strategies[ids]]
        fed = Spec.parse(free)
        assert pricer.option(ids, specs.index(free)).comm_s == 0.0
        want = reshard_cost(fed, Spec.parse(moved), (SEQ, BATCH), 8, mesh, with_backward=False)
        assert want > 0 and pricer.option(ids, specs.index(moved)).comm_s == pytest.approx(want)


def _train(module: nn.Module, batches: list[tuple]) -> tuple[list[float], list[torch.Tensor | None]]:
    """AdamW steps of `module`, one per batch: the losses, and the logits where the model returns them.
    (eps as the harness's: attention's key bias gets zero gradients, up to rounding, which eps=1e-8 amplifies.)"""
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    losses, logits = [], []
    for batch in batches:
        opt.zero_grad()
        out = module(*batch)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        opt.step()
        losses.append(loss.item())
        logits.append(out[1].detach() if isinstance(out, tuple) else None)
    return losses, logits


def _ddp_fed_steps(rank, world, model, batches, longer, batch_dim, dims):
    """AdamW steps of the parallel module, each rank fed its columns as a DDP loop feeds them, then the loss of
    a batch of longer sequences (a graph of its own, traced for the global batch the columns make up)."""
    pm = autopar.parallelize(copy.deepcopy(model), batches[0], (world,), batch_dim=batch_dim)
    fed = [_columns(batch, dims, rank, world) for batch in batches]
    assert all(torch.equal(a, b) for batch, local in zip(batches, fed) for a, b in zip(pm.local_batch(batch), local))
    losses, outputs = _train(pm, fed)
    with torch.no_grad():
        out = pm(*_columns(longer, dims, rank, world))
    losses.append((out[0] if isinstance(out, tuple) else out).item())
    rows = tuple(t.narrow(0, rank * t.shape[0] // world, t.shape[0] // world) for t in batches[0])
    with pytest.raises(LoweringError) as refused:  # rows, where the module takes columns
        pm(*rows)
    return losses, outputs, {k: v.clone() for k, v in pm.state_dict().items()}, str(refused.value)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["lm", "classifier"])
def test_sequence_first_models_train_like_one_device_fed_as_ddp_feeds_them(case):
    """The solver's plan, two ranks each fed its batch columns: losses, the logits' columns and the parameters
    after two AdamW steps match one device, and so does the loss of longer sequences fed after; rows are
    refused, naming the batch dim the module takes."""
    torch.manual_seed(0)
    if case == "lm":
        model, make, batch_dim, dims = SequenceFirstLM(), _lm_batch, 1, (1, 1)
    else:
        model, make, batch_dim, dims = SequenceFirstClassifier(), _classifier_batch, (1, 0), (1, 0)
    batches, longer = [make(1), make(2)], make(3, seq=SEQ + 2)
    single = copy.deepcopy(model)
    want_losses, want_logits = _train(single, batches)
    with torch.no_grad():
        out = single(*longer)
    want_losses.append((out[0] if isinstance(out, tuple) else out).item())
    for rank, (losses, outputs, state, refused) in enumerate(run_ranks(_ddp_fed_steps, 2, model, batches, longer, batch_dim, dims, timeout_s=200)):
        assert losses == pytest.approx(want_losses, rel=1e-5)
        for got, want in zip(outputs, want_logits):
            if want is not None:
                torch.testing.assert_close(got, want.narrow(1, rank * BATCH // 2, BATCH // 2), rtol=1e-4, atol=1e-5)
        for name, value in single.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert "cut along dim 0" in refused and "batch dim" in refused, refused


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_random_plans_with_the_batch_along_dim_1_match_one_device(mesh_shape):
    """Every plan, not only the solver's: random plans of the sequence-first LM, each rank fed its columns
    (`pm.local_batch`), train like one device."""
    torch.manual_seed(0)
    model, sample = SequenceFirstLM(), _lm_batch(3)
    traced = trace(*capture_copy(model, sample, "cpu"), batch_dim=1)
    mesh, rng = cpu_mesh(mesh_shape), random.Random(5)
    strategies, ref = enumerate_strategies(traced, mesh), reference(model, sample, 2)
    cases = [(f"plan {i} on {mesh_shape}", model, sample, traced, random_plan(traced, mesh, rng, strategies), ref, 2)
             for i in range(4 if len(mesh_shape) == 1 else 2)]
    check_cases(mesh_shape, cases)
