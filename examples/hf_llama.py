"""Hugging Face `transformers.LlamaForCausalLM` with random weights (never downloaded).

    autopar plan examples/hf_llama.py --gpus 8

The same architecture as `examples/llama.py`, in HF's code: HF's rotary module,
causal-mask construction and SDPA attention path. `forward(input_ids=..., labels=...)`
returns HF's `CausalLMOutputWithPast`; its `.loss` is the mean cross-entropy, with
HF shifting `labels` by one inside.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

CONFIGS: dict[str, LlamaConfig] = {
    # 2 layers, GQA with 2 query heads per kv head: for tests.
    "tiny": LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=176,
        vocab_size=256,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # LLaMA-2 7B: 6.74B parameters (LlamaConfig's defaults, spelled out).
    "7b": LlamaConfig(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}


def build(
    batch_size: int = 1,  # one full-context sequence (2K tokens) per step, as examples/llama.py
    seq_len: int = 2048,  # LLaMA-1/2 context
    size: str = "7b",
    device: str | torch.device = "meta",
    dropout: float = 0.0,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """LlamaForCausalLM `size` in train mode on `device` and a batch `{"input_ids", "labels"}`."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(CONFIGS)}")
    config = LlamaConfig.from_dict(
        {
            **CONFIGS[size].to_dict(),
            "attention_dropout": dropout,
            "use_cache": False,  # training: no KV cache in the traced graph
        },
        attn_implementation="sdpa",
    )
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len {seq_len} exceeds the {size!r} context of {config.max_position_embeddings}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).train()
        input_ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    return model, {"input_ids": input_ids, "labels": input_ids.clone()}  # HF shifts labels itself
