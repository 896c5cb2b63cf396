"""Profiler vs independent measurement on tiny Hugging Face models as users build them (config defaults).

- Recompute: a Llama with its KV cache on by default, every decoder layer checkpointed; the
  measured step runs as the tracer captures it, cache off (`without_kv_cache`): recomputing a
  layer would otherwise append its keys and values to the cache a second time.
- A layer shared across depth (ALBERT): each call of a checkpointed block is its own region
  (`block_call_of`), as eager checkpointing of the block's forward makes it.
- Mixture of experts: eager transformers runs the experts with `torch._grouped_mm`, which
  torch's FlopCounterMode counts as 0 unless `register_flop_formulas` gives it a formula.
"""
from __future__ import annotations

import torch
import transformers as hf
from torch.utils.flop_counter import FlopCounterMode

from autopar.api import capture_copy
from autopar.profiler import block_call_of, block_of, peak_memory, profile
from autopar.profiler.flops import register_flop_formulas
from autopar.profiler.measure import block_paths, checkpoint_modules, measure_flops, measure_step
from autopar.tracer import trace
from autopar.tracer.capture import without_kv_cache

_TINY = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64)


def _sample(batch: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (batch, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_recomputed_hf_llama_peak_matches_the_measured_peak():
    torch.manual_seed(0)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(**_TINY)).train()
    assert model.config.use_cache  # the default the tracer switches off
    sample = _sample(8)
    traced = trace(*capture_copy(model, sample, "cpu"))
    cost = profile(traced).evaluate()
    blocks = block_paths(model)
    assert blocks == ["model.layers.0", "model.layers.1"]
    checkpoint_modules(model, blocks)
    recompute = frozenset(n.name for n in traced.graph.nodes if block_of(n) in blocks)
    with without_kv_cache(model):
        measured = measure_step(model, sample).peak_bytes
    predicted = peak_memory(traced, cost, recompute).peak_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)
    # Recompute is what lowers it: the same prediction without it is clearly above.
    assert peak_memory(traced, cost).peak_bytes > 1.1 * measured


def test_a_shared_layer_checkpointed_per_call_matches_the_measured_peak():
    torch.manual_seed(0)
    model = hf.AlbertForMaskedLM(hf.AlbertConfig(vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                                                 num_attention_heads=4, intermediate_size=64)).train()
    sample = _sample(8)
    traced = trace(*capture_copy(model, sample, "cpu"))
    cost = profile(traced).evaluate()
    blocks = block_paths(model)
    assert blocks == ["albert.encoder.albert_layer_groups.0"]  # one module, run at each of the 3 depths
    checkpoint_modules(model, blocks)
    recompute = frozenset(n.name for n in traced.graph.nodes if block_of(n) in blocks)
    assert len({block_call_of(n) for n in traced.graph.nodes if n.name in recompute}) == 3  # three regions
    measured = measure_step(model, sample).peak_bytes
    predicted = peak_memory(traced, cost, recompute, region_of=block_call_of).peak_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


def test_grouped_mm_flops_match_a_hand_count():
    register_flop_formulas()
    sizes, k, n = [5, 0, 11, 16], 8, 12  # tokens per expert (one gets none), d_in, d_out
    tokens = torch.randn(sum(sizes), k, requires_grad=True)
    weights = torch.randn(len(sizes), k, n, requires_grad=True)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    with FlopCounterMode(display=False) as counter:
        out = torch._grouped_mm(tokens, weights, offs)
        out.backward(torch.randn_like(out))
    # forward, the tokens' gradient and the weights' gradient: each one (m_e x k) @ (k x n) per expert
    assert counter.get_total_flops() == 3 * sum(2 * m * k * n for m in sizes)


def test_mixture_of_experts_flops_match_flop_counter_mode():
    torch.manual_seed(0)
    model = hf.MixtralForCausalLM(hf.MixtralConfig(**_TINY, num_local_experts=4, num_experts_per_tok=2)).train()
    sample = _sample(4)
    cost = profile(trace(*capture_copy(model, sample, "cpu"))).evaluate()
    predicted = sum(c.fwd_flops + c.bwd_flops for c in cost.nodes.values())
    register_flop_formulas()
    with FlopCounterMode(display=False) as counter:
        model(**sample).loss.backward()
    # The experts by hand: 4 x 16 tokens routed to 2 experts each, gate+up (32 -> 128) and down (64 -> 32) in each of
    # 2 layers, forward and the two gradients.
    experts = 3 * 2 * (4 * 16 * 2) * (2 * 32 * 128 + 2 * 64 * 32)
    assert counter.get_flop_counts()["Global"][torch.ops.aten._grouped_mm] == experts
    assert predicted == counter.get_total_flops() == measure_flops(model, sample)
