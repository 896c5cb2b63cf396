"""Ops whose CPU kernels need contiguous inputs run where eager runs, under random plans.

A local tensor can be strided where the traced one was contiguous: a collective between two
transposes returns a contiguous tensor, and the transpose back is then strided (diffusers'
attention norms `x.transpose(1, 2)`; on a 2x2 mesh its `native_group_norm` raised). The model
below feeds every op of `codegen.kernel_layouts` (the ops `benchmarks/contiguous_kernels.py`
finds) through such transpose pairs; random plans put collectives between them.
"""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from tests.codegen.harness import check_plan, reference, trace_model
from tests.codegen.plans import cpu_mesh, random_plan

from autopar.codegen import kernel_layouts
from autopar.runtime.launch import run_ranks
from autopar.runtime.mesh import ProcessMesh
from autopar.solver.strategies import enumerate_strategies


class StridedInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 8)
        self.bag = nn.EmbeddingBag(16, 8, mode="mean")
        self.lin = nn.Linear(8, 8, bias=False)  # (pdist ignores a shift: a bias would get a gradient of round-off)

    def forward(self, x, ids, offsets):
        h = self.norm(x.transpose(1, 2).transpose(1, 2))  # contiguous when traced: no copy in the graph
        pairs = h.reshape(h.shape[0], 8, 2, 2).transpose(2, 3).transpose(2, 3).contiguous()
        c = torch.view_as_complex(pairs)  # (B, 8, 2) complex
        b = self.bag(ids.t().t().flatten(), offsets)
        d = torch.pdist(self.lin(b).t().t())
        return h.square().mean() + c.abs().mean() + d.mean()


def _strided_inputs_met(rank, world, cases):
    """Train every case; count, per op, the strided inputs its layout function was handed."""
    met: dict[str, int] = {}
    for op, (positions, lay_out) in list(kernel_layouts.KERNEL_LAYOUTS.items()):
        def counting(x, op=str(op), lay_out=lay_out):
            met[op] = met.get(op, 0) + (lay_out(x) is not x)
            return lay_out(x)
        kernel_layouts.KERNEL_LAYOUTS[op] = (positions, counting)
    mesh = ProcessMesh((world,))
    for label, model, sample, traced, plan, ref, steps in cases:
        check_plan(model, sample, traced, plan, ref, steps, mesh, label)
    return met


@pytest.mark.timeout(200)
def test_ops_needing_contiguous_inputs_run_under_random_plans():
    torch.manual_seed(0)
    model = StridedInputs()
    sample = (torch.randn(4, 8, 4), torch.randint(0, 16, (4, 3)), torch.tensor([0, 2, 5, 9]))
    traced = trace_model(model, sample)
    ops = {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert {str(op) for op in kernel_layouts.KERNEL_LAYOUTS} - ops == {"aten._embedding_bag_forward_only.default"}
    mesh, rng = cpu_mesh((2,)), random.Random(0)
    strategies, ref = enumerate_strategies(traced, mesh), reference(model, sample, 1)
    cases = [(f"plan {i}", model, sample, traced, random_plan(traced, mesh, rng, strategies), ref, 1) for i in range(12)]
    for met in run_ranks(_strided_inputs_met, 2, cases, timeout_s=180):
        # the plans did hand these kernels strided tensors (each raised on them before its layout was restored)
        assert met.get("aten.native_group_norm.default", 0) > 0 and met.get("aten.view_as_complex.default", 0) > 0, met


def test_a_batch_of_one_laid_out_channels_last_is_laid_out_as_group_norm_checks():
    """A local batch of one (batch 4 on 2x2) whose dim 0 stride is a slice's: contiguous in channels-last by
    `is_contiguous`, yet its strides suggest the plain format, which the kernel checks."""
    x = torch.empty_strided((1, 64, 8, 8), (64, 1, 512, 64)).normal_()
    assert x.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="is_contiguous"):
        torch.native_group_norm(x, None, None, 1, 64, 64, 8, 1e-5)
    laid_out = kernel_layouts.in_own_format(x)
    out = torch.native_group_norm(laid_out, None, None, 1, 64, 64, 8, 1e-5)[0]
    torch.testing.assert_close(out, torch.native_group_norm(x.contiguous(), None, None, 1, 64, 64, 8, 1e-5)[0])
    channels_last = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    assert kernel_layouts.in_own_format(channels_last) is channels_last  # no copy where the kernel takes it as it is
