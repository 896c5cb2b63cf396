"""BERT encoder with a sequence-classification head, written from scratch with Hugging Face names.

    autopar plan examples/bert.py --gpus 8

Word + position + token-type embeddings, post-LN encoder layers with bidirectional
`F.scaled_dot_product_attention` (no padding mask: every sample is full length),
GELU MLP, a tanh pooler on the [CLS] position and a linear classifier.
Parameter names match `transformers.BertForSequenceClassification`
(`bert.encoder.layer.3.attention.self.query.weight`).

`forward(input_ids, labels, token_type_ids=None)` returns the mean cross-entropy
of the classifier over `num_labels` classes; `labels` has shape (B,).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class BertConfig:
    n_layers: int
    hidden_size: int
    n_heads: int
    intermediate_size: int
    vocab_size: int = 30522  # bert-base-uncased WordPiece vocabulary
    max_position_embeddings: int = 512
    type_vocab_size: int = 2  # sentence A / sentence B
    num_labels: int = 2  # e.g. SST-2
    layer_norm_eps: float = 1e-12  # BERT's value
    dropout: float = 0.0  # hidden and attention dropout (BERT fine-tunes with 0.1)


CONFIGS: dict[str, BertConfig] = {
    "tiny": BertConfig(n_layers=2, hidden_size=64, n_heads=4, intermediate_size=256, vocab_size=256),
    "base": BertConfig(n_layers=12, hidden_size=768, n_heads=12, intermediate_size=3072),  # 109M
    "large": BertConfig(n_layers=24, hidden_size=1024, n_heads=16, intermediate_size=4096),  # 335M
}


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))  # (B, T, C)


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        if cfg.hidden_size % cfg.n_heads != 0:
            raise ValueError(f"hidden_size ({cfg.hidden_size}) must be divisible by n_heads ({cfg.n_heads})")
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_heads
        q = self.query(x).view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.key(x).view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = self.value(x).view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)  # bidirectional
        return y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)


class SelfOutput(nn.Module):
    """Projection, dropout, then the residual add and post-LN (HF's BertSelfOutput / BertOutput)."""

    def __init__(self, d_in: int, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = SelfAttention(cfg)  # HF's name
        self.output = SelfOutput(cfg.hidden_size, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.intermediate_act_fn = nn.GELU()  # exact erf GELU, BERT's "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = SelfOutput(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)  # LN(x + attn(x))
        return self.output(self.intermediate(x), x)  # LN(x + mlp(x))


class Encoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Layer(cfg) for _ in range(cfg.n_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class Pooler(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x[:, 0]))  # [CLS] token, (B, C)


class BertModel(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.pooler = Pooler(cfg)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        return self.pooler(self.encoder(self.embeddings(input_ids, token_type_ids)))


class BertForSequenceClassification(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg)
        self.dropout = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
        for module in self.modules():  # BERT's initializer_range
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if token_type_ids is None:  # a single segment
            token_type_ids = torch.zeros_like(input_ids)
        logits = self.classifier(self.dropout(self.bert(input_ids, token_type_ids)))  # (B, num_labels)
        return F.cross_entropy(logits, labels)


def build(
    batch_size: int = 32,  # BERT's fine-tuning batch size
    seq_len: int = 512,  # BERT's maximum sequence length
    size: str = "base",
    device: str | torch.device = "meta",
    dropout: float = 0.0,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """BERT `size` in train mode on `device` and a batch `{"input_ids", "labels"}` (labels (B,))."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(CONFIGS)}")
    cfg = dataclasses.replace(CONFIGS[size], dropout=dropout)
    if seq_len > cfg.max_position_embeddings:
        raise ValueError(f"seq_len {seq_len} exceeds the {size!r} maximum of {cfg.max_position_embeddings}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = BertForSequenceClassification(cfg).train()
        input_ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len))
        labels = torch.randint(0, cfg.num_labels, (batch_size,))
    return model, {"input_ids": input_ids, "labels": labels}
