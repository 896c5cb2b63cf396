"""`ParallelModule.clip_grad_norm_`, and torch's own `clip_grad_norm_` on its parameters, give torch's single-device
norm and clipped gradients under any plan.

Random plans (random strategy per node, random ZeRO storage) shard, replicate and
ZeRO-shard different parameters on different axes, so the norm must count each
block once: summing local norms over all ranks would double-count replicated
parameters, and clipping by local norms would scale ranks differently.
"""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch
from torch.nn.utils import clip_grad_norm_  # bound before any module is parallelized, as scripts do

from tests.codegen.harness import call, local_sample, loss_of, trace_model
from tests.codegen.plans import cpu_mesh, load_zoo, random_plan

from autopar.codegen import ParallelModule, lower
from autopar.codegen.shapes import local_block
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh

MAX_NORM = 0.05  # well below the gradients' norm: clipping happens


def _other() -> torch.Tensor:
    """A tensor outside the module, whole on every rank (a head the user keeps apart), with its gradient."""
    other = torch.ones(3, requires_grad=True)
    other.grad = torch.full((3,), 0.02)
    return other


def _reference(model, sample, norm_type, with_other):
    ref = copy.deepcopy(model)
    loss_of(call(ref, sample)).backward()
    other = [_other()] if with_other else []
    total = torch.nn.utils.clip_grad_norm_([*ref.parameters(), *other], MAX_NORM, norm_type=norm_type)
    return total, {n: p.grad.clone() for n, p in ref.named_parameters()}


def _clip_on_ranks(rank, world, mesh_shape, model, sample, traced, plans, norm_type, how):
    mesh = ProcessMesh(mesh_shape)
    out = []
    for plan in plans:
        torch.manual_seed(0)
        pm = ParallelModule(lower(traced, plan, mesh, params=dict(model.named_parameters(remove_duplicate=False))), traced, mesh, plan)
        args, kwargs = local_sample(sample, pm)
        loss_of(pm(*args, **kwargs)).backward()
        if how == "module":
            total = pm.clip_grad_norm_(MAX_NORM, norm_type=norm_type)
        else:  # torch's own, over the module's shards (and a tensor of no module)
            total = clip_grad_norm_([*pm.parameters(), *([_other()] if how == "torch with another tensor" else [])],
                                    MAX_NORM, norm_type=norm_type)
        grads = {fqn: (p.grad.clone(), pm.info.param_storage[fqn]) for fqn, p in pm.named_parameters()}
        out.append((float(total), grads, mesh.coordinate))
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mesh_shape, norm_type, how", [
    ((2,), 2.0, "module"), ((2, 2), 2.0, "module"), ((2,), math.inf, "module"),
    ((2, 2), 2.0, "torch"), ((2,), math.inf, "torch"), ((2, 2), 2.0, "torch with another tensor")])
def test_clipping_matches_single_device(mesh_shape, norm_type, how):
    model, sample = load_zoo("gpt2").build(batch_size=4, seq_len=8, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    rng = random.Random(7)
    plans = [random_plan(traced, cpu_mesh(mesh_shape), rng) for _ in range(3)]
    assert sum(any(p.zero for p in plan.params) for plan in plans) >= 1
    want_total, want = _reference(model, sample, norm_type, how == "torch with another tensor")
    assert float(want_total) > MAX_NORM
    for rank_results in run_ranks(_clip_on_ranks, math.prod(mesh_shape), mesh_shape, model, sample, traced, plans,
                                  norm_type, how, timeout_s=180):
        for total, grads, coordinate in rank_results:
            assert total == pytest.approx(float(want_total), rel=1e-5)
            for fqn, (grad, storage) in grads.items():
                torch.testing.assert_close(grad, local_block(want[fqn], storage, mesh_shape, coordinate),
                                           rtol=1e-4, atol=1e-6, msg=lambda m: f"{fqn}: {m}")
