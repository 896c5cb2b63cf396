"""Memory under bf16 mixed precision is what the plan says (`tests/codegen/test_memory.py`'s measurement).

The same GPT-2 on 2 gloo ranks, data parallel and ZeRO, under `MixedPrecision(torch.bfloat16)`: float32 masters,
gradients and AdamW state, bf16 compute copies (one flat buffer), bf16 activations but for the cross-entropy's
float32 logits. The profiler prices the masters and their copies, and the memory model what the step holds.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils import _pytree as pytree

from autopar.api import profiled
from autopar.profiler.measure import LiveStorageTracker
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.solver import fixed_plan
from tests.codegen.harness import local_sample, parallel_module
from tests.codegen.mixed import BF16, trace_mixed
from tests.codegen.plans import cpu_mesh, greedy_plan
from tests.codegen.test_memory import _gpt2

log = logging.getLogger(__name__)


def _measure(rank, world, model, sample, traced, plans):
    out = {}
    for name, plan in plans.items():
        pm = parallel_module(model, sample, traced, plan, ProcessMesh((world,)), mixed_precision=BF16)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        args, kwargs = local_sample(sample, pm)
        pm(*args, **kwargs).backward()  # warm-up: optimizer state exists from here on
        opt.step()
        opt.zero_grad(set_to_none=False)  # grads stay allocated (zeroed) through forward, as the model counts them
        opt_state = [t for s in opt.state.values() for t in pytree.tree_leaves(s) if isinstance(t, torch.Tensor)]
        batch = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        copies = [] if pm._copies is None else [pm._copies.flat]
        live = [*pm.parameters(), *pm.buffers(), *opt_state, *batch, *copies]
        with LiveStorageTracker(live, may_free=[p.grad for p in pm.parameters()]) as tracker:
            pm(*args, **kwargs).backward()
            peak = tracker.peak_bytes
        out[name] = {"peak": peak, "predicted": plan.memory.total_bytes, "copies": sum(c.nbytes for c in copies)}
        del pm, opt, opt_state, live
    return out


@pytest.mark.timeout(150)
def test_bf16_memory_is_what_the_plan_says():
    """The measured peak of a bf16 step is within 10% of the plan's total (as float32's, test_memory.py); the copies
    are one bf16 buffer of every replicated parameter (ZeRO's shards have none: their gathers cast)."""
    model, sample = _gpt2()
    traced = trace_mixed(model, sample)
    prof = profiled(traced, "adamw", model, BF16)
    mesh = cpu_mesh((2,))
    choices = {d.node: d.strategy for d in greedy_plan(traced, mesh, {n: "S(0)" for n in traced.input_names}).nodes}
    plans = {"replicated": fixed_plan(traced, prof, mesh, choices),
             "zero": fixed_plan(traced, prof, mesh, choices, zero_params=frozenset(traced.param_fqns.values()))}
    numel = sum(p.numel() for p in model.parameters())
    for res in run_ranks(_measure, 2, model, sample, traced, plans, timeout_s=140):
        for name, r in res.items():
            log.warning("%-10s measured peak %.2f MB, predicted %.2f MB", name, r["peak"] / 2**20, r["predicted"] / 2**20)
            assert abs(r["peak"] - r["predicted"]) <= 0.10 * r["predicted"], (name, r)
        assert res["replicated"]["copies"] == 2 * numel and res["zero"]["copies"] == 0
