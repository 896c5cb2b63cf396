"""Vision Transformer (ViT) image classifier written from scratch with timm's parameter names.

    autopar plan examples/vit.py --gpus 8

Conv2d patch embedding (kernel = stride = patch), a learned [CLS] token and
position embedding, pre-LN blocks with `F.scaled_dot_product_attention` and a
fused qkv projection, a final LayerNorm and a linear head on the [CLS] token.
Parameter names match timm's `vit_base_patch16_224` (`blocks.3.attn.qkv.weight`).

`forward(pixels, labels)` returns the mean cross-entropy over `num_classes`;
the sample input is the tuple `(pixels (B, 3, H, W), labels (B,))`.
The image size comes from the config, so `seq_len` is ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ViTConfig:
    image_size: int
    patch_size: int
    n_layers: int
    hidden_size: int
    n_heads: int
    mlp_ratio: int = 4
    num_classes: int = 1000  # ImageNet-1k
    in_channels: int = 3
    layer_norm_eps: float = 1e-6  # timm's value
    dropout: float = 0.0  # attention and residual dropout


CONFIGS: dict[str, ViTConfig] = {
    # 16 patches + [CLS] = 17 tokens: for tests.
    "tiny": ViTConfig(image_size=32, patch_size=8, n_layers=2, hidden_size=64, n_heads=4, num_classes=10),
    "base": ViTConfig(image_size=224, patch_size=16, n_layers=12, hidden_size=768, n_heads=12),  # ViT-B/16, 86.6M
    "large": ViTConfig(image_size=224, patch_size=16, n_layers=24, hidden_size=1024, n_heads=16),  # ViT-L/16, 304M
}


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(cfg.in_channels, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)  # (B, C, H/p, W/p)
        return x.flatten(2).transpose(1, 2)  # (B, N, C)


class Attention(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        if cfg.hidden_size % cfg.n_heads != 0:
            raise ValueError(f"hidden_size ({cfg.hidden_size}) must be divisible by n_heads ({cfg.n_heads})")
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.proj_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        hs = C // self.n_heads
        qkv = self.qkv(x).view(B, N, 3, self.n_heads, hs).permute(2, 0, 3, 1, 4)  # (3, B, nh, N, hs)
        q, k, v = qkv.unbind(0)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)  # (B, nh, N, hs)
        y = y.transpose(1, 2).reshape(B, N, C)  # (B, N, C)
        return self.proj_drop(self.proj(y))


class Mlp(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.mlp_ratio * cfg.hidden_size)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.hidden_size, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


class VisionTransformer(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        if cfg.image_size % cfg.patch_size != 0:
            raise ValueError(f"image_size ({cfg.image_size}) must be divisible by patch_size ({cfg.patch_size})")
        self.config = cfg
        n_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden_size))
        self.pos_embed = nn.Parameter(torch.empty(1, n_patches + 1, cfg.hidden_size))
        self.pos_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.num_classes)
        nn.init.normal_(self.pos_embed, std=0.02)  # timm: trunc_normal_(std=.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels)  # (B, N, C)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, C)
        x = torch.cat((cls, x), dim=1) + self.pos_embed  # (B, N+1, C)
        x = self.pos_drop(x)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits = self.head(x[:, 0])  # (B, num_classes)
        return F.cross_entropy(logits, labels)


def build(
    batch_size: int = 64,  # images per step (DeiT trains ViT-B with 128 per GPU)
    seq_len: int | None = None,  # ignored: the token count is (image_size / patch_size)^2 + 1
    size: str = "base",
    device: str | torch.device = "meta",
    dropout: float = 0.0,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """ViT `size` in train mode on `device` and a batch `(pixels, labels)` of random images and classes."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(CONFIGS)}")
    cfg = dataclasses.replace(CONFIGS[size], dropout=dropout)
    torch.manual_seed(seed)
    with torch.device(device):
        model = VisionTransformer(cfg).train()
        pixels = torch.randn(batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)
        labels = torch.randint(0, cfg.num_classes, (batch_size,))
    return model, (pixels, labels)
