"""`torch.compile` over a parallel module: its forward runs eagerly (a graph break), and trains like one device.

Without that, `torch.compile(pm)` raised an internal dynamo error inside the gradient sync's
`register_hook`.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.codegen.harness import EPS, LR, check_steps, local_sample, parallel_module, reference, trace_model
from tests.codegen.plans import cpu_mesh, greedy_plan, load_zoo, random_plan

from autopar.codegen.shapes import local_block
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh

STEPS = 2


def _compiled_steps(rank, world, model, sample, traced, plans, ref):
    mesh = ProcessMesh((world,))
    for label, plan in plans:
        pm = parallel_module(model, sample, traced, plan, mesh)
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
        if label == "pm.compile()":
            pm.compile()  # nn.Module's in-place compile: `pm` itself is called compiled
            check_steps(pm, opt, ref, range(STEPS), label, [sample] * STEPS)
            continue
        compiled = torch.compile(pm)  # a wrapper module calling pm
        args, kwargs = local_sample(sample, pm)
        for step in range(STEPS):
            opt.zero_grad()
            loss = compiled(*args, **kwargs)
            loss.backward()
            opt.step()
            assert abs(loss.item() - ref.losses[step]) <= 1e-5 * abs(ref.losses[step]), (label, step, loss.item())
            for fqn, p in pm.named_parameters():
                want = local_block(ref.params[step][fqn], pm.info.param_storage[fqn], mesh.shape, mesh.coordinate)
                torch.testing.assert_close(p.detach(), want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{label} {fqn}: {m}")


@pytest.mark.timeout(240)
def test_torch_compile_of_a_parallel_module_trains_like_one_device():
    """`torch.compile(pm)` and `pm.compile()` under a data-parallel plan and a random plan (tensor splits,
    ZeRO, recompute) on 2 ranks: losses and AdamW-updated parameters match one device."""
    model, sample = load_zoo("gpt2").build(batch_size=8, seq_len=16, size="tiny", device="cpu")
    traced = trace_model(model, sample)
    ref = reference(model, sample, STEPS)
    mesh = cpu_mesh((2,))
    plans = [("torch.compile(pm)", greedy_plan(traced, mesh, {n: "S(0)" for n in traced.input_names})),
             ("pm.compile()", random_plan(traced, mesh, random.Random(3)))]
    run_ranks(_compiled_steps, 2, model, sample, traced, plans, ref, timeout_s=220)
