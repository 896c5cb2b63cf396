"""Dropout p>0 under the Megatron RNG rule: the model trains; masks are independent across batch shards and
identical across ranks holding the same replicated activation (inspected by hooking the runtime's random op),
however each rank seeded torch's generator."""
from __future__ import annotations

import pytest
import torch

from tests.codegen.harness import local_sample, loss_of, trace_model
from tests.codegen.plans import cpu_mesh, greedy_plan, load_zoo

from autopar.codegen import ParallelModule, lower
from autopar.runtime import rng
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.spec import Replicate, Shard

STEPS = 6


def _train_recording_masks(rank, world, model, sample, traced, plan):
    masks: list[torch.Tensor] = []
    inner = rng.random_op

    def recording(op, groups, *args, **kwargs):
        out = inner(op, groups, *args, **kwargs)
        if op is torch.ops.aten.native_dropout.default:  # (attention's dropout goes through it too)
            masks.append(out[1].detach().clone())  # native_dropout returns (output, mask)
        return out

    rng.random_op = recording  # this forked rank only: codegen reads the attribute when it lowers
    # ranks seeded apart, as DDP loops seed their data (nanoGPT: 1337 + rank): the masks must not follow
    torch.manual_seed(rank)
    mesh = ProcessMesh((2,))
    pm = ParallelModule(lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False))), traced, mesh, plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    args, kwargs = local_sample(sample, pm)
    losses, first_masks = [], None
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_of(pm(*args, **kwargs))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if first_masks is None:
            first_masks = list(masks)
    return losses, first_masks


def _dropout_specs(plan):
    return [d.strategy.output_specs[0] for d in plan.nodes if d.op.startswith("aten.native_dropout")]


@pytest.mark.timeout(120)
def test_dropout_trains_with_megatron_masks():
    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu", dropout=0.2)
    traced = trace_model(model, sample)
    mesh = cpu_mesh((2,))
    dp = greedy_plan(traced, mesh, {name: "S(0)" for name in traced.input_names})  # activations batch-sharded
    replicated = greedy_plan(traced, mesh, {})  # every rank computes the whole batch
    assert _dropout_specs(dp) and all(s.placements[0] == Shard(0) for s in _dropout_specs(dp))
    assert all(s.placements[0] == Replicate() for s in _dropout_specs(replicated))

    for plan, same in ((dp, False), (replicated, True)):
        (losses0, masks0), (losses1, masks1) = run_ranks(_train_recording_masks, 2, model, sample, traced, plan, timeout_s=100)
        assert losses0 == losses1  # the global loss, on every rank
        assert losses0[-1] < 0.9 * losses0[0], losses0  # it trains, masks and all
        assert len(masks0) == len(_dropout_specs(plan)) == len(masks1)
        for m0, m1 in zip(masks0, masks1):
            assert 0.6 < m0.float().mean().item() < 0.95  # p=0.2 really drops
            # different batch rows: independent masks; the same replicated activation: one mask
            assert torch.equal(m0, m1) == same


class _Shuffled(torch.nn.Module):
    """Features permuted by `torch.randperm` and perturbed by an in-place `normal_`: random ops that are not
    dropout, which the Megatron rule covers too (ATen tags every op that draws)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x, y):
        x = x[:, torch.randperm(8)] + torch.empty_like(x).normal_() * 0.1
        return torch.nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


def _loss_seeded_apart(rank, world, model, sample, traced, plan):
    from tests.codegen.harness import parallel_module

    pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)))
    torch.manual_seed(rank)
    args, kwargs = local_sample(sample, pm)
    return pm(*args, **kwargs).item()


def test_other_random_ops_draw_alike_on_replicas_of_ranks_seeded_apart():
    """Under a plan that keeps the batch whole on every rank (fc1 split), each rank computes the same permutation
    and noise: before, randperm and normal drew from each rank's own generator and the two ranks' 'global'
    losses differed (1.4949 and 1.4441)."""
    torch.manual_seed(0)
    model = _Shuffled()
    sample = (torch.randn(8, 8), torch.randint(0, 4, (8,)))
    traced = trace_model(model, sample)
    plan = greedy_plan(traced, cpu_mesh((2,)), {"p_fc1_weight": "S(0)"})
    losses = run_ranks(_loss_seeded_apart, 2, model, sample, traced, plan, timeout_s=60)
    assert losses[0] == losses[1]
