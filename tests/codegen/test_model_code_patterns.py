"""Patterns of model code written elsewhere, trained under random plans against one device.

- minGPT's block reaches its MLP through a lambda stored on the module (`self.mlpf = lambda x: ...`):
  every weight behind it trains, none is held as a constant.
- XLNet reads `seg_embed` only when called with `token_type_ids`: a parameter the sample's forward does
  not read stays in `parameters()` and the state dict, gets no gradient, and trains once a later call
  reads it.
- Mamba's `A_log` has rows alike by construction: split by rows, the first step's check for blocks an
  init loop drew alike lets it through; a weight set alike after `parallelize` passes when declared.
"""
from __future__ import annotations

import copy
import functools
import math
import random

import pytest
import torch
from torch import nn

from tests.codegen.harness import check_plan, check_steps, reference_steps, step, trace_model
from tests.codegen.plans import cpu_mesh, greedy_plan, random_plan

import autopar
from autopar.codegen.shapes import LoweringError
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.runtime.optimizers import OptimizerError
from autopar.solver.plan_io import with_fingerprint


class LambdaBlock(nn.Module):
    """minGPT's pattern: the MLP reached through a lambda (and, here, a partial) closing over the submodule."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(width, 4 * width), act=nn.GELU(), c_proj=nn.Linear(4 * width, width)))
        m = self.mlp
        self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))  # noqa: E731
        self.head = functools.partial(nn.functional.linear, weight=nn.Parameter(torch.randn(3, width) / 3))
        self.head_weight = self.head.keywords["weight"]  # registered: the partial closes over a parameter

    def forward(self, x, y):
        h = x + self.mlpf(self.ln(x))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class UnreadParams(nn.Module):
    """XLNet's pattern: `seg_embed` read only with token_type_ids, `mask_emb` never in training."""

    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.seg_embed = nn.Parameter(torch.randn(2, width))
        self.mask_emb = nn.Parameter(torch.randn(1, 1, width))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, labels, token_type_ids=None):
        h = self.emb(input_ids)
        if token_type_ids is not None:
            h = h + self.seg_embed[token_type_ids]
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class SelectiveScan(nn.Module):
    """Mamba's pattern: A_log = log(1..n) in every row, by construction."""

    def __init__(self, width: int = 8, state: int = 4):
        super().__init__()
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(width, 1))
        self.proj = nn.Linear(width, width)

    def forward(self, x, y):
        decay = torch.exp(-torch.exp(self.A_log))  # (width, state)
        h = (self.proj(x).unsqueeze(-1) * decay).sum(-1)  # (batch, seq, width)
        return nn.functional.mse_loss(h, y)


def _tokens(seed: int, batch: int = 4, seq: int = 6, vocab: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab, (batch, seq), generator=g), "labels": torch.randint(0, vocab, (batch, seq), generator=g)}


def _train(rank, world, mesh_shape, cases):
    mesh = ProcessMesh(mesh_shape)
    for label, model, sample, traced, plan, ref, samples in cases:
        torch.manual_seed(0)
        check_plan(model, sample, traced, plan, ref, len(samples), mesh, label, samples=samples)


def _random_cases(model, sample, samples, mesh_shape, seeds):
    traced = trace_model(model, sample)
    ref = reference_steps(model, samples)
    mesh = cpu_mesh(mesh_shape)
    return [(f"{type(model).__name__} plan {seed} on {mesh_shape}", model, sample, traced,
             random_plan(traced, mesh, random.Random(seed)), ref, samples) for seed in seeds]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_lambdas_and_unread_parameters_train_like_one_device(mesh_shape):
    """minGPT's lambda and XLNet's unread parameters: loss, gradients (None where one device has none) and
    updated parameters match one device under random plans; the step with token_type_ids traces again and
    trains seg_embed, the steps around it leave it without a gradient."""
    torch.manual_seed(0)
    block, x = LambdaBlock(), torch.randn(4, 6, 8)
    block_sample = (x, torch.randint(0, 3, (4, 6)))
    unread = UnreadParams()
    with_segments = {**_tokens(2), "token_type_ids": torch.randint(0, 2, (4, 6), generator=torch.Generator().manual_seed(3))}
    seeds = (1, 2) if len(mesh_shape) == 1 else (3,)
    cases = [*_random_cases(block, block_sample, [block_sample] * 2, mesh_shape, seeds),
             *_random_cases(unread, _tokens(1), [_tokens(1), with_segments, _tokens(1)], mesh_shape, seeds)]
    traced = cases[0][3]
    assert not traced.constants and len(traced.param_fqns) == len(list(block.parameters())) == 7
    run_ranks(_train, math.prod(mesh_shape), mesh_shape, cases, timeout_s=180)


def _state_round_trip(rank, world, model, sample, path):
    pm = autopar.parallelize(model, sample, (world,))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    step(pm, opt, sample)
    state = pm.state_dict()
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(state)  # strict: every key of the model's
    pm.load_state_dict(model.state_dict())  # strict both ways
    back = pm.state_dict()
    pm.load_state_dict(state)
    pm.save_checkpoint(path, opt)
    other = autopar.parallelize(model, sample, (world,))
    other.load_checkpoint(path)
    return (sorted(state), back, other.state_dict(), pm.seg_embed.grad,
            pm.seg_embed.requires_grad, pm.info.grad_sync_axes)


@pytest.mark.timeout(120)
def test_unread_parameters_round_trip_through_state_dicts_and_checkpoints(tmp_path):
    torch.manual_seed(0)
    model, sample = UnreadParams(), _tokens(1)
    results = run_ranks(_state_round_trip, 2, model, sample, str(tmp_path / "ckpt"), timeout_s=100)
    for keys, back, loaded, grad, requires_grad, synced in results:
        assert keys == sorted(model.state_dict())
        for fqn, value in model.state_dict().items():
            torch.testing.assert_close(back[fqn], value, rtol=0, atol=0)
        assert not torch.equal(loaded["head.weight"], model.head.weight)  # the trained values came back
        torch.testing.assert_close(loaded["seg_embed"], model.seg_embed.detach(), rtol=0, atol=0)
        assert grad is None and requires_grad
        assert "seg_embed" not in synced and "mask_emb" not in synced  # no bucket waits for their gradients


def _scan_steps(rank, world, model, sample, plan, ref, declare):
    """Through `parallelize` with `plan`: A_log split by rows trains like one device; a weight set alike after
    parallelize is refused at the first step unless declared (and an unknown name is refused)."""
    pm = autopar.parallelize(model, sample, (world,), plan=plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    check_steps(pm, opt, ref, range(2), "A_log split by rows", [sample] * 2)
    again = autopar.parallelize(model, sample, (world,), plan=plan)
    with torch.no_grad():
        again.proj.weight.fill_(0.0).add_(torch.arange(again.proj.weight.shape[1], dtype=torch.float32))
    try:
        again.expect_equal_blocks("proj.wieght")
    except LoweringError as err:
        unknown = str(err)
    if declare:
        again.expect_equal_blocks("proj.weight")
    try:
        step(again, torch.optim.SGD(again.parameters(), lr=0.1), sample)
    except OptimizerError as err:
        return unknown, str(err)
    return unknown, None


@pytest.mark.timeout(120)
def test_parameters_alike_in_every_block_by_construction_pass_the_first_step_check():
    torch.manual_seed(0)
    model = SelectiveScan()
    sample = (torch.randn(4, 6, 8), torch.randn(4, 6, 8))
    traced = trace_model(model, sample)
    split = {ph: "S(0)" for ph, fqn in traced.param_fqns.items() if fqn in ("A_log", "proj.weight")}  # by rows
    plan = greedy_plan(traced, cpu_mesh((2,)), {**split, **{n: "S(0)" for n in traced.input_names}})
    plan = with_fingerprint(plan, traced, plan.mesh, None)  # as a saved plan of this model
    assert {d.fqn: str(d.storage) for d in plan.params if not d.storage.is_replicate()} == {"A_log": "S(0)", "proj.weight": "S(0)"}
    ref = reference_steps(model, [sample] * 2)
    for declare in (False, True):
        for unknown, refused in run_ranks(_scan_steps, 2, model, sample, plan, ref, declare, timeout_s=100):
            assert "['proj.wieght'] are not parameters of this module" in unknown
            if declare:
                assert refused is None
            else:
                assert refused.startswith("1 split parameters hold the same values in every rank's block: proj.weight"), refused
                assert "pm.expect_equal_blocks(name, ...)" in refused
