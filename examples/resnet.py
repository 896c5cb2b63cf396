"""ResNet image classifier (He et al. 2015) written from scratch with torchvision's parameter names.

    autopar plan examples/resnet.py --gpus 8

Basic residual blocks (two 3x3 convolutions, each followed by BatchNorm) in four
stages, a 7x7 stride-2 stem with max pooling, global average pooling and a
linear head. Parameter and buffer names match torchvision's `resnet18`
(`layer2.0.downsample.1.running_mean`). The model trains in train mode, so
every BatchNorm updates its running statistics in forward: the buffers a
parallel plan must keep exactly as a single device would.

`forward(pixels, labels)` returns the mean cross-entropy over `num_classes`;
the sample input is the tuple `(pixels (B, 3, H, W), labels (B,))`.
The image size comes from the config, so `seq_len` is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ResNetConfig:
    image_size: int
    widths: tuple[int, ...]  # channels per stage; stages after the first halve the resolution
    blocks: tuple[int, ...]  # basic blocks per stage
    num_classes: int = 1000  # ImageNet-1k


CONFIGS: dict[str, ResNetConfig] = {
    # two stages of one block at 16x16: for tests
    "tiny": ResNetConfig(image_size=16, widths=(8, 16), blocks=(1, 1), num_classes=10),
    "resnet18": ResNetConfig(image_size=224, widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2)),  # 11,689,512 params
    "resnet34": ResNetConfig(image_size=224, widths=(64, 128, 256, 512), blocks=(3, 4, 6, 3)),  # 21,797,672 params
}


class BasicBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:  # the shortcut must match the block's output shape
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.config = cfg
        stem = cfg.widths[0]
        self.conv1 = nn.Conv2d(3, stem, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = stem
        for i, (width, n) in enumerate(zip(cfg.widths, cfg.blocks)):
            stride = 1 if i == 0 else 2
            layer = nn.Sequential(*[BasicBlock(in_ch if b == 0 else width, width, stride if b == 0 else 1) for b in range(n)])
            self.add_module(f"layer{i + 1}", layer)
            in_ch = width
        self.fc = nn.Linear(in_ch, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")  # torchvision's init

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(pixels))))
        for i in range(len(self.config.widths)):
            x = getattr(self, f"layer{i + 1}")(x)
        logits = self.fc(x.mean((2, 3)))  # global average pooling
        return F.cross_entropy(logits, labels)


def build(
    batch_size: int = 256,  # images per step: the usual ImageNet recipe (32 per GPU on 8 GPUs)
    seq_len: int | None = None,  # ignored: images have a fixed size
    size: str = "resnet18",
    device: str | torch.device = "meta",
    dropout: float = 0.0,  # ResNet has no dropout; accepted for the zoo's common signature
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """ResNet `size` in train mode on `device` and a batch `(pixels, labels)` of random images and classes."""
    if size not in CONFIGS:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(CONFIGS)}")
    cfg = CONFIGS[size]
    torch.manual_seed(seed)
    with torch.device(device):
        model = ResNet(cfg).train()
        pixels = torch.randn(batch_size, 3, cfg.image_size, cfg.image_size)
        labels = torch.randint(0, cfg.num_classes, (batch_size,))
    return model, (pixels, labels)
