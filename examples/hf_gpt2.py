"""Hugging Face `transformers.GPT2LMHeadModel` with random weights (never downloaded).

    autopar plan examples/hf_gpt2.py --gpus 8

The same architecture as `examples/gpt2.py`, in HF's code: `Conv1D` projections
(weights stored (in, out)), HF's causal-mask construction and the SDPA attention
path. `forward(input_ids=..., labels=...)` returns HF's `CausalLMOutputWithCrossAttentions`;
its `.loss` is the mean cross-entropy, with HF shifting `labels` by one inside.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel

# GPT2Config's defaults are GPT-2 small (124M): 12 layers, 12 heads, 768 wide,
# 50257 tokens, 1024 positions, tanh GELU, tied LM head.
CONFIGS: dict[str, GPT2Config] = {
    "tiny": GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=256, bos_token_id=255, eos_token_id=255),
    "small": GPT2Config(),
}


def build(
    batch_size: int = 8,  # 8 x 1024 = 8K tokens per step, as examples/gpt2.py
    seq_len: int = 1024,  # GPT-2's full context
    size: str = "small",
    device: str | torch.device = "meta",
    dropout: float = 0.0,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """GPT2LMHeadModel `size` in train mode on `device` and a batch `{"input_ids", "labels"}`."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(CONFIGS)}")
    config = GPT2Config.from_dict(
        {
            **CONFIGS[size].to_dict(),
            "resid_pdrop": dropout,  # HF's defaults are 0.1; ours are 0 so steps are deterministic
            "embd_pdrop": dropout,
            "attn_pdrop": dropout,
            "use_cache": False,  # training: no KV cache in the traced graph
        },
        attn_implementation="sdpa",
    )
    if seq_len > config.n_positions:
        raise ValueError(f"seq_len {seq_len} exceeds the {size!r} context of {config.n_positions}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT2LMHeadModel(config).train()
        model.loss_type = "ForCausalLM"  # HF's default for this class, named so it does not warn
        input_ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    return model, {"input_ids": input_ids, "labels": input_ids.clone()}  # HF shifts labels itself
