"""What ops save for backward and their scratch: kept-whole SiLU, attention masks, scratch as a peak."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.profiler import peak_memory, profile
from autopar.profiler.measure import measure_step
from autopar.profiler.probe import _Watch
from autopar.tracer import trace


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64, bias=False)
        self.down = nn.Linear(64, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x))).square().mean()


class MaskedAttention(nn.Module):
    """sdpa with a boolean mask that is either an input or built from shapes (`diagonal` picks its pattern)."""

    def __init__(self, diagonal: int = 0) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.diagonal = diagonal

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=2))  # (B, 2, T, 8)
        if mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(self.diagonal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(B, 1, T, T)).sum()


def _trace(model_cls, *args, **kwargs):
    with torch.device("meta"):
        model = model_cls(*args, **kwargs)
    return trace(model, torch.empty(2, 8, 16, device="meta"), dynamic_dims={"batch": 0, "seq": 1})


def test_silu_keeps_only_its_input():
    traced = _trace(SwiGLU)
    cost = profile(traced).evaluate(batch=4, seq=32)
    # The tracer keeps silu whole (decomposed, x * sigmoid(x) would also save the sigmoid).
    assert not [c for c in cost.nodes.values() if c.op == "aten.sigmoid.default"]
    (silu,) = [name for name, c in cost.nodes.items() if c.op == "aten.silu.default"]
    (up,) = [n.name for n in traced.graph.nodes if n.target is torch.ops.aten.mm.default][:1]
    # silu keeps only x = up(x) (4*32*64 fp32) for backward.
    assert cost.nodes[silu].saved_refs == ((up, 0),)
    assert cost.nodes[up].output_bytes == (4 * 32 * 64 * 4,)
    assert cost.nodes[silu].output_bytes == (4 * 32 * 64 * 4,)
    with torch.device("cpu"):
        torch.manual_seed(0)
        real = SwiGLU()
    measured = measure_step(real, torch.randn(4, 32, 16)).peak_bytes
    assert abs(peak_memory(traced, cost).peak_bytes - measured) <= 0.01 * measured


@pytest.mark.parametrize("mask_from", ["input", "shapes, not causal"])
def test_masks_eager_builds_are_kept_and_priced(mask_from):
    if mask_from == "input":
        with torch.device("meta"):
            model = MaskedAttention()
        mask = torch.ones(8, 8, dtype=torch.bool, device="meta").tril()
        traced = trace(model, (torch.empty(2, 8, 16, device="meta"), mask), dynamic_dims={"batch": 0})
        sizes = {"batch": 4}
    else:
        traced = _trace(MaskedAttention, diagonal=1)  # each query also sees the next key
        sizes = {"batch": 4, "seq": 8}
    (attn,) = [n for n in traced.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(attn.args) == 4 and not attn.kwargs.get("is_causal")  # the tracer kept the mask
    cost = profile(traced).evaluate(**sizes)
    # The CPU kernel turns the bool mask into a float (B, 1, T, T) one and keeps it, with the logsumexp.
    assert cost.nodes[attn.name].extra_saved_bytes == 4 * 8 * 8 * 4 + 4 * 2 * 8 * 4


def test_scratch_is_a_peak_not_a_sum():
    with FakeTensorMode():
        watch = _Watch()
        with watch:
            a = torch.empty(100)
            del a  # dead before b is made: the two never coexist
            b = torch.empty(200)
            del b
            kept = torch.empty(50)
        assert watch.peak_scratch({StorageWeakRef(kept.untyped_storage())}) == 200 * 4


class GatedMLP(nn.Module):
    """A Llama MLP's gate: down(silu(gate(x)) * up(x)), then a softmax over the features."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 64, bias=False)
        self.up = nn.Linear(16, 64, bias=False)
        self.down = nn.Linear(64, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate(x)) * self.up(x)
        return self.down(h).softmax(-1).square().mean()


def test_each_backward_step_makes_gradients_for_its_inputs_and_keeps_what_it_saved_of_itself():
    """Per input, the gradient storage a node's backward makes (by hand: the gated product makes one of its size
    for each factor; a matmul one for the activation and one for the weight; a view none, it hands the
    gradient on), and what its own backward keeps of its outputs (softmax its result; silu nothing of its own)."""
    traced = _trace(GatedMLP)
    cost = profile(traced).evaluate(batch=4, seq=32)
    hidden, features = 4 * 32 * 64 * 4, 4 * 32 * 16 * 4
    by_op = lambda op: [c for c in cost.nodes.values() if c.op == op]  # noqa: E731
    (mul,) = [c for c in by_op("aten.mul.Tensor") if c.value_bytes == (hidden,)]
    assert mul.grad_input_bytes == (hidden, hidden) and mul.self_saved_bytes == 0
    (silu,) = by_op("aten.silu.default")
    assert silu.grad_input_bytes == (hidden,) and silu.self_saved_bytes == 0
    (softmax,) = by_op("aten._softmax.default")
    assert softmax.grad_input_bytes == (features,) and softmax.self_saved_bytes == features
    weight = 64 * 16 * 4
    down = [c for c in by_op("aten.mm.default") if c.value_bytes == (4 * 32 * 16 * 4,)]
    assert [sorted(c.grad_input_bytes) for c in down] == [sorted((hidden, weight))]
    views = [c for c in by_op("aten.view.default") if c.requires_grad]
    assert views and all(sum(c.grad_input_bytes) == 0 for c in views)
