"""GPT-2 written from scratch: nanoGPT's layout with Hugging Face parameter names.

    autopar plan examples/gpt2.py --gpus 8

Pre-LN decoder: learned position embeddings, causal self-attention through
`F.scaled_dot_product_attention` with one fused qkv projection (`c_attn`), a
tanh-GELU MLP, a final LayerNorm and an LM head tied to the token embedding.
Parameter names match `transformers.GPT2LMHeadModel` (`transformer.h.3.attn.c_attn.weight`),
but weights are `nn.Linear` (out, in), not HF's `Conv1D` (in, out).

`forward(input_ids, labels)` returns the mean cross-entropy. `labels` are the
targets at each position (already shifted, as in nanoGPT's `(x, y)` batches;
-100 is ignored); without labels the model predicts `input_ids[:, 1:]`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 50257  # GPT-2 BPE vocabulary
    block_size: int = 1024  # context length: rows of the learned position table
    layer_norm_eps: float = 1e-5  # GPT-2's value
    dropout: float = 0.0  # embedding, attention and residual dropout; 0 makes steps deterministic


CONFIGS: dict[str, GPTConfig] = {
    # 2 layers, vocab 256: for tests; block_size 1024 so the default seq_len builds too.
    "tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256),
    "small": GPTConfig(n_layer=12, n_head=12, n_embd=768),  # 124M
    "medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),  # 1.5B
    # GPT-3 paper, table 2.1: 175B with GPT-2's architecture (dense attention only).
    "gpt3-175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, block_size=2048),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head != 0:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's "gelu_new"
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2 and HF
        self.apply(self._init_weights)
        # GPT-2 paper: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:  # next-token prediction on the batch itself
            input_ids, labels = input_ids[:, :-1], input_ids[:, 1:]
        B, T = input_ids.shape
        pos = torch.arange(T, dtype=torch.long, device=input_ids.device)  # (T,)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(pos)  # (B, T, C)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def build(
    batch_size: int = 8,  # 8 x 1024 = 8K tokens per step
    seq_len: int = 1024,  # GPT-2's full context
    size: str = "small",
    device: str | torch.device = "meta",
    dropout: float = 0.0,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """GPT `size` in train mode on `device` and a batch `{"input_ids", "labels"}` of random tokens."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(CONFIGS)}")
    cfg = dataclasses.replace(CONFIGS[size], dropout=dropout)
    if seq_len > cfg.block_size:
        raise ValueError(f"seq_len {seq_len} exceeds the {size!r} context of {cfg.block_size}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(cfg).train()
        input_ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
        labels = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    return model, {"input_ids": input_ids, "labels": labels}
