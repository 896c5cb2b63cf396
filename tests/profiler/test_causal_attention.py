"""Hugging Face attention traced as eager runs it: `is_causal=True`, grouped k and v, no mask tensors.

Under export HF builds a boolean (B, 1, T, T) causal mask and `repeat_kv` copies that
eager skips. The tracer drops them (`autopar.tracer.attention`); tests/tracer/test_trace.py
checks that the rewritten graph still computes the eager loss on real weights, here we
check what is left and what the profiler then prices (the zoo traces are shared here).
"""
from __future__ import annotations

import pytest
import torch

from autopar.profiler import profile
from tests.profiler.zoo import DYNAMIC, SEQ

SDPA = torch.ops.aten.scaled_dot_product_attention.default


@pytest.mark.parametrize("name, heads, kv_heads", [("hf_gpt2", 4, 4), ("hf_llama", 4, 2)])
def test_causal_mask_and_repeat_kv_are_gone(traced_zoo, name, heads, kv_heads):
    traced = traced_zoo(name)
    attn = [n for n in traced.graph.nodes if n.target is SDPA]
    assert attn
    for node in attn:
        q, k, v = node.args
        assert node.kwargs.get("is_causal") is True and "attn_mask" not in node.kwargs
        assert k.meta["val"].shape[1] == v.meta["val"].shape[1] == kv_heads and q.meta["val"].shape[1] == heads
        assert node.kwargs.get("enable_gqa", False) == (kv_heads < heads)
    # no (B, 1, T, T) boolean tensor is built any more, and no k, v copy
    assert not [n for n in traced.graph.nodes if getattr(n.meta.get("val"), "dtype", None) == torch.bool
                and n.meta["val"].dim() == 4]
    assert not [n for n in traced.graph.nodes if n.target is torch.ops.aten.expand.default and n.meta["val"].dim() == 5]
    # the profiler prices what remains: attention keeps only its logsumexp (B, H, T) fp32 beyond q, k, v, out
    B = 4
    cost = profile(traced).evaluate(batch=B, **({"seq": SEQ} if "seq" in DYNAMIC[name] else {}))
    for node in attn:
        assert cost.nodes[node.name].extra_saved_bytes == B * heads * SEQ * 4


def test_grouped_query_attention_is_counted_with_the_query_heads(traced_zoo):
    """A hand count: each of the query heads multiplies against its group's key and value, (T x d)(d x T) then
    (T x T)(T x d) in forward, 5 such products in backward; fewer key/value heads save memory, not FLOPs (torch
    2.11's FlopCounterMode raised on such shapes: `profiler.flops`)."""
    traced = traced_zoo("hf_llama")
    B = 4
    cost = profile(traced).evaluate(batch=B, **({"seq": SEQ} if "seq" in DYNAMIC["hf_llama"] else {}))
    for node in (n for n in traced.graph.nodes if n.target is SDPA):
        q, k, _ = (a.meta["val"] for a in node.args)
        assert k.shape[1] < q.shape[1]  # grouped
        heads, head_dim = q.shape[1], q.shape[3]
        product = 2 * B * heads * SEQ * SEQ * head_dim
        assert cost.nodes[node.name].fwd_flops == 2 * product
        assert cost.nodes[node.name].bwd_flops == 5 * product
