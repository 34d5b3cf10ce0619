"""ResNet-18 with GroupNorm in plain torch: the usual model of DP image-classification benchmarks.

DP-SGD needs per-example gradients, and BatchNorm mixes the examples of a batch, so DP work
replaces it by GroupNorm (De et al. 2022, "Unlocking high-accuracy differentially private image
classification through scale"). The layout is ResNet-18's (He et al. 2016, Table 1): a 7×7
stride-2 stem and max-pool, then four stages of two basic blocks (64, 128, 256, 512 channels),
global average pooling and a linear head — the model Opacus's CIFAR-10 tutorial fine-tunes once
its BatchNorm layers become ``GroupNorm(min(32, C), C)``, as here. torchvision is not used, so
the benchmark needs nothing beyond torch.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["resnet18_gn"]


def _norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with 32 groups (fewer if the layer is narrower), as Opacus's validator makes."""
    return nn.GroupNorm(min(32, channels), channels)


class BasicBlock(nn.Module):
    """Two 3×3 convolutions and a residual connection (1×1 projection where the shape changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.norm1 = _norm(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.norm2 = _norm(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), _norm(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


def resnet18_gn(classes: int = 10, channels: int = 3) -> nn.Sequential:
    """ResNet-18 (11.2 M parameters at 10 classes) with every BatchNorm replaced by GroupNorm."""
    layers: list[nn.Module] = [
        nn.Conv2d(channels, 64, 7, 2, 3, bias=False), _norm(64), nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]  # fmt: skip
    width = 64
    for stage, outputs in enumerate((64, 128, 256, 512)):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(BasicBlock(width, outputs, stride))
            width = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)
