"""A pipeline priced for a model traced under a mixed-precision policy (bf16 compute on float32 masters): every part
of its price is a time, none negative, and the step adds up as 1F1B's formula says.

The shape is the width of Megatron-LM's 39.1B row (hidden 8192, 64 heads, vocabulary 51,200, 2,048 tokens) at two
layers, on fake tensors: at that width ZeRO's sharded gradients pay on a (32, 8) stage mesh, which is where the saving
of the all-reduce ZeRO replaces was priced at the bytes held (master and bf16 copy) instead of the bytes summed."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autopar.api import traced_model
from autopar.mixed_precision import MixedPrecision
from autopar.pipeline.api import microbatch_sample, search_cache
from autopar.pipeline.cache import SearchCache
from autopar.pipeline.search import Config, Topology, price_config
from autopar.solver.mesh import PRESETS, MeshAxis
from tests.zoo import load_zoo

MICROBATCHES = 2
ROWS = 32  # a micro-batch: one sequence per data-parallel rank of the (32, 8) stage mesh


def _priced():
    gpt = load_zoo("gpt2")
    cfg = gpt.GPTConfig(n_layer=2, n_head=64, n_embd=8192, vocab_size=51200, block_size=2048)
    with torch.device("meta"):
        model = gpt.GPT(cfg).train()
        tokens = torch.randint(0, cfg.vocab_size, (MICROBATCHES * ROWS, 2048))
    sample = {"input_ids": tokens, "labels": tokens}
    policy = MixedPrecision(torch.bfloat16)
    cache = SearchCache(lambda m: traced_model(model, microbatch_sample(sample, m), "cpu", mixed_precision=policy),
                        time_limit_s=3, masters=policy.masters(model), reduce_dtype=policy.reduce_dtype)
    nodes = Topology(intra=PRESETS["a100"].axes[0], inter=MeshAxis("node", 1, 2e-5, 25e9), gpus_per_node=8,
                     base=PRESETS["a100"])
    # stage 0: the embeddings and layer 0; stage 1: layer 1, the head (tied to the embedding) and the loss
    return price_config(cache, Config(2, (32, 8), MICROBATCHES), "1f1b", topology=nodes, time_limit_s=3, starts=(2,))


def test_a_mixed_precision_pipeline_prices_no_negative_time():
    plan = _priced()
    for stage in plan.stages:
        t = stage.plan.time
        assert min(t.compute_s, t.comm_s, t.recompute_s, t.update_s, t.offload_s) >= 0, t
    step = plan.time
    assert min(*step.stage_s, step.bubble_s, step.p2p_s, step.sync_s, step.update_s) >= 0, step
    # a micro-batch through a stage takes at least its forward and backward compute (its plan's compute less the
    # optimizer's step, which runs once a step)
    for stage, micro_s in zip(plan.stages, step.stage_s):
        assert micro_s >= stage.plan.time.compute_s - stage.plan.time.update_s > 0
    # 1F1B on 2 stages: the first micro-batch through both, then one slowest stage per micro-batch; the bubble is
    # the faster stage's time; then the slower rank's gradient sync and optimizer step
    schedule_s = (MICROBATCHES - 1) * max(step.stage_s) + sum(step.stage_s)
    assert step.bubble_s == pytest.approx(min(step.stage_s))
    assert max(step.sync_s, step.update_s) <= step.step_s - schedule_s <= step.sync_s + step.update_s + 1e-12


def test_stages_traced_under_bf16_mixed_precision_are_priced_at_bf16_rates_and_bytes():
    # the tiny MLP on 2 stages of one A100 each, priced with memory of no cost to read so that every op takes its
    # math's rate: under the policy each stage's forward and backward computes in bf16 at 312 TFLOP/s against
    # float32's 19.5, exactly 16 times faster, keeps less for backward, and holds a bf16 copy beside each float32
    # master (1.5 times the parameter bytes), as the plan without stages prices them (`api.profiled`)
    model, sample = load_zoo("mlp").build(batch_size=8, seq_len=8, size="tiny", device="cpu")
    a100 = replace(PRESETS["a100"], mem_bandwidth_bytes_per_s=1e30)
    link = MeshAxis("link", 1, 0.0, 1e9)
    priced = [price_config(search_cache(model, sample, "cpu", time_limit_s=5, mixed_precision=policy), Config(2, (1,), 2),
                           "1f1b", topology=Topology(link, link, 8, a100), time_limit_s=5, starts=(2,))
              for policy in (None, MixedPrecision(torch.bfloat16))]
    for fp32, bf16 in zip(*(p.stages for p in priced)):
        assert fp32.plan.time.compute_s == pytest.approx(16 * bf16.plan.time.compute_s, rel=1e-9)
        assert bf16.plan.memory.activations_bytes < fp32.plan.memory.activations_bytes
        assert bf16.plan.memory.params_bytes == 1.5 * fp32.plan.memory.params_bytes
