"""A stack of residual MLP blocks (Linear-GELU-Linear) regressing `y` from `x` with MSE.

    autopar plan examples/mlp.py --gpus 8

The smallest model with the shape of a transformer's MLP: each block is the
Megatron column-parallel / row-parallel pair, so tensor parallelism, ZeRO and
data parallelism all have something to win. `forward(x, y)` returns the MSE loss;
the sample input is the tuple `(x (B, D), y (B, D))`. `seq_len` is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class MLPConfig:
    n_layers: int
    dim: int  # width of x, y and the residual stream
    hidden: int  # width inside each block


CONFIGS: dict[str, MLPConfig] = {
    "tiny": MLPConfig(n_layers=3, dim=32, hidden=64),
    "large": MLPConfig(n_layers=8, dim=2048, hidden=8192),  # 268M parameters, 1.07 GB in fp32
}


class Block(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)  # (B, D)
        return F.mse_loss(x, y)


def build(
    batch_size: int = 1024,  # enough rows that the matmuls, not the launch overhead, dominate
    seq_len: int | None = None,  # ignored: the input is (B, D)
    size: str = "large",
    device: str | torch.device = "meta",
    dropout: float = 0.0,  # ignored: the MLP has no dropout
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """MLP `size` in train mode on `device` and a batch `(x, y)` of Gaussian rows."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(CONFIGS)}")
    cfg = CONFIGS[size]
    torch.manual_seed(seed)
    with torch.device(device):
        model = MLP(cfg).train()
        x = torch.randn(batch_size, cfg.dim)
        y = torch.randn(batch_size, cfg.dim)
    return model, (x, y)
