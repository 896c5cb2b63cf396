"""LLaMA written from scratch with Hugging Face parameter names.

    autopar plan examples/llama.py --gpus 8

Pre-norm decoder: RMSNorm, rotary position embeddings (cos/sin tables precomputed
as non-persistent buffers, applied with `rotate_half` as in HF), SwiGLU MLP,
grouped-query attention (k/v heads repeated with expand + reshape, HF's `repeat_kv`)
through causal `F.scaled_dot_product_attention`, and an untied LM head.
Parameter names match `transformers.LlamaForCausalLM` (`model.layers.3.self_attn.q_proj.weight`).

`forward(input_ids, labels)` returns the mean cross-entropy. `labels` are the
targets at each position (already shifted; -100 is ignored); without labels the
model predicts `input_ids[:, 1:]`.

The rotary tables are not in the state dict: after materialising a meta model
(`to_empty`), call `reset_parameters()` on every module that has it (FSDP's
convention) to recompute them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int  # < n_heads: grouped-query attention
    intermediate_size: int
    vocab_size: int = 32000  # LLaMA 1/2 SentencePiece vocabulary
    max_seq_len: int = 2048  # rows of the rotary tables
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0  # attention dropout (LLaMA trains without any)


CONFIGS: dict[str, LlamaConfig] = {
    # 2 layers, GQA with 2 query heads per kv head: for tests.
    "tiny": LlamaConfig(n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, intermediate_size=176, vocab_size=256),
    # LLaMA-2 7B (= LLaMA-1 7B shape): 6.74B parameters.
    "7b": LlamaConfig(n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=32, intermediate_size=11008),
    # LLaMA-2 70B: 8 kv heads (grouped-query attention), 4K context; 69.0B parameters.
    "70b": LlamaConfig(n_layers=80, hidden_size=8192, n_heads=64, n_kv_heads=8, intermediate_size=28672, max_seq_len=4096,
                       norm_eps=1e-5),
    # LLaMA-3 8B: 8 kv heads, 128K vocabulary; 8.03B parameters.
    "8b-gqa": LlamaConfig(
        n_layers=32,
        hidden_size=4096,
        n_heads=32,
        n_kv_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # normalise in fp32 under bf16 training, as HF and Meta do
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.type_as(x)


class RotaryEmbedding(nn.Module):
    """cos/sin of position * inverse frequency, (max_seq_len, head_dim), sliced to T on use."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        device = self.cos.device
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        t = torch.arange(self.max_seq_len, device=device).float()
        freqs = torch.outer(t, inv_freq)  # (S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (S, hd): HF's half-split layout
        with torch.no_grad():
            self.cos.copy_(emb.cos())
            self.sin.copy_(emb.sin())

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin  # cos, sin (T, hd) broadcast over (B, nh)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, n_kv, T, hd) -> (B, n_kv * n_rep, T, hd), each kv head repeated n_rep times in place."""
    if n_rep == 1:
        return x
    B, n_kv, T, hd = x.shape
    return x[:, :, None, :, :].expand(B, n_kv, n_rep, T, hd).reshape(B, n_kv * n_rep, T, hd)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.hidden_size % cfg.n_heads != 0 or cfg.n_heads % cfg.n_kv_heads != 0:
            raise ValueError(
                f"need hidden_size ({cfg.hidden_size}) % n_heads ({cfg.n_heads}) == 0 "
                f"and n_heads % n_kv_heads ({cfg.n_kv_heads}) == 0"
            )
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.hidden_size // cfg.n_heads
        self.dropout = cfg.dropout
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)  # (B, nh, T, hd)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, C)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.hidden_size // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = self.rotary_emb(input_ids.shape[1])  # (T, hd) each
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for module in self.modules():  # HF's initializer_range
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:  # next-token prediction on the batch itself
            input_ids, labels = input_ids[:, :-1], input_ids[:, 1:]
        logits = self.lm_head(self.model(input_ids))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)


def build(
    batch_size: int = 1,  # one full-context sequence (2K tokens) per step
    seq_len: int = 2048,  # LLaMA-1/2 context
    size: str = "7b",
    device: str | torch.device = "meta",
    dropout: float = 0.0,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """LLaMA `size` in train mode on `device` and a batch `{"input_ids", "labels"}` of random tokens."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(CONFIGS)}")
    cfg = dataclasses.replace(CONFIGS[size], dropout=dropout)
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the {size!r} context of {cfg.max_seq_len}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).train()
        input_ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
        labels = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
    return model, {"input_ids": input_ids, "labels": labels}
