"""Profiler vs independent measurement of real CPU training steps of zoo models at two batch sizes."""
from __future__ import annotations

import pytest

from autopar.profiler import block_of, peak_memory, profile
from autopar.profiler.measure import block_paths, checkpoint_modules, measure_flops, measure_step
from tests.profiler.zoo import DYNAMIC, SEQ, load_example

# Every zoo model at two batch sizes.
CASES = [
    ("gpt2", 4), ("gpt2", 8), ("bert", 4), ("bert", 8), ("vit", 4), ("vit", 16), ("mlp", 64), ("mlp", 512),
    ("llama", 4), ("llama", 8), ("resnet", 4), ("resnet", 16), ("hf_gpt2", 4), ("hf_gpt2", 8), ("hf_llama", 4), ("hf_llama", 8),
]


def _sizes(name: str, batch: int) -> dict[str, int]:
    return {"batch": batch, "seq": SEQ} if "seq" in DYNAMIC[name] else {"batch": batch}


@pytest.mark.parametrize("name,batch", CASES)
def test_flops_match_flop_counter_mode(traced_zoo, name, batch):
    traced = traced_zoo(name)
    cost = profile(traced).evaluate(**_sizes(name, batch))
    predicted = sum(c.fwd_flops + c.bwd_flops for c in cost.nodes.values())
    model, sample = load_example(name).build(batch, SEQ, size="tiny", device="cpu")
    measured = measure_flops(model, sample)
    assert measured > 0
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


@pytest.mark.parametrize("recompute_blocks", [False, True])
@pytest.mark.parametrize("name,batch", CASES)
def test_peak_memory_within_5_percent(traced_zoo, name, batch, recompute_blocks):
    traced = traced_zoo(name)
    cost = profile(traced, optimizer="adamw").evaluate(**_sizes(name, batch))
    model, sample = load_example(name).build(batch, SEQ, size="tiny", device="cpu")
    recompute = frozenset()
    if recompute_blocks:
        blocks = block_paths(model)
        checkpoint_modules(model, blocks)
        recompute = frozenset(n.name for n in traced.graph.nodes if n.op == "call_function" and block_of(n) in blocks)
        assert recompute
    est = peak_memory(traced, cost, recompute)
    measured = measure_step(model, sample, optimizer="adamw").peak_bytes
    assert abs(est.peak_bytes - measured) <= 0.05 * measured, (est, measured)
    # The breakdown is consistent: the peak is at least the static part.
    assert est.peak_bytes >= est.params_bytes + est.optimizer_bytes


def test_recompute_lowers_the_prediction_as_measured(traced_zoo):
    traced = traced_zoo("gpt2")
    cost = profile(traced).evaluate(batch=8, seq=SEQ)
    blocks = {block_of(n) for n in traced.graph.nodes} - {""}
    recompute = frozenset(n.name for n in traced.graph.nodes if block_of(n) in blocks)
    full, ckpt = peak_memory(traced, cost), peak_memory(traced, cost, recompute)
    assert ckpt.activations_bytes < 0.5 * full.activations_bytes
    assert ckpt.peak_bytes < full.peak_bytes
