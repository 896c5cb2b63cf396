"""The planner under bf16 mixed precision: what the profiler and the cost model make of a graph traced under the policy.

Hand counts: a parameter computed on a bf16 copy holds its float32 master (4 bytes an element) and the copy (2);
its gradient (float32), AdamW's two float32 moments and step are the master's; it is summed over ranks in the
reduce dtype. An op is priced at the rate of the dtype its math runs in (the preset's datasheet numbers x 0.7).
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.api import profiled
from autopar.solver.cost import compute_time_s
from autopar.solver.mesh import SUSTAINED, make_mesh
from tests.codegen.mixed import BF16, trace_mixed
from tests.codegen.plans import load_zoo


@pytest.fixture(scope="module")
def gpt2_bf16():
    torch.manual_seed(0)
    model, sample = load_zoo("gpt2").build(batch_size=2, seq_len=8, size="tiny", device="cpu")
    return model, trace_mixed(model, sample)


@pytest.mark.parametrize("reduce_dtype, summed_itemsize", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_masters_copies_and_summed_gradients_by_hand(gpt2_bf16, reduce_dtype, summed_itemsize):
    model, traced = gpt2_bf16
    policy = autopar.MixedPrecision(torch.bfloat16, reduce_dtype)
    params = profiled(traced, "adamw", model, policy).evaluate().params
    counted = [p for p in params.values() if p.param_bytes]  # the tied LM head is counted once, as the embedding
    assert len(counted) == len({id(p) for p in model.parameters()})
    for p in counted:
        n = model.get_parameter(p.fqn).numel()
        assert (p.param_bytes, p.copy_bytes, p.compute_bytes) == (6 * n, 2 * n, 2 * n), p.fqn
        assert (p.grad_bytes, p.optimizer_bytes, p.summed_bytes) == (4 * n, 8 * n + 4, summed_itemsize * n), p.fqn


def test_every_op_is_priced_at_the_rate_of_its_dtype(gpt2_bf16):
    """The matmuls run in bf16 at the bf16 rate; the cross-entropy's log-softmax in float32 (autocast's list) at
    fp32's, or TF32's where asked; a mesh of one measured rate prices all alike."""
    model, traced = gpt2_bf16
    nodes = profiled(traced, "adamw", model, BF16).evaluate().nodes
    matmuls = [c for c in nodes.values() if c.op in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")]
    assert matmuls and {c.dtype for c in matmuls} == {"bfloat16"}
    assert {c.dtype for c in nodes.values() if c.op == "aten._log_softmax.default"} == {"float32"}
    flops = 1e12
    h100 = make_mesh(8, hardware="h100", precision="bf16")
    assert compute_time_s(flops, 0.0, h100, "bfloat16") == pytest.approx(flops / (SUSTAINED * 989.4e12))
    assert compute_time_s(flops, 0.0, h100, "float32") == pytest.approx(flops / (SUSTAINED * 67e12))
    tf32 = make_mesh(8, hardware="h100", precision="tf32")
    assert compute_time_s(flops, 0.0, tf32, "float32") == pytest.approx(flops / (SUSTAINED * 494.7e12))
    cpu = make_mesh(2, hardware="cpu")
    assert compute_time_s(flops, 0.0, cpu, "bfloat16") == compute_time_s(flops, 0.0, cpu, "float32") == flops / cpu.flops_per_s
