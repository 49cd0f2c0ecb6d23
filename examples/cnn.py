"""A small ResNet-style CNN for 32x32 images: bottleneck blocks in one nn.Sequential.

memadvisor plan examples/cnn.py:build --budget-gb 0.25
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 convolutions with a residual, as in ResNet-50."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + x)


class SmallResNet(nn.Module):
    def __init__(self, channels: int = 64, width: int = 32, depth: int = 6, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.layers = nn.Sequential(*(Bottleneck(channels, width) for _ in range(depth)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))  # (B, C, 32, 32)
        return self.head(x.mean(dim=(2, 3)))  # (B, classes)


def build(batch_size: int = 8) -> dict:
    """The model, a sample batch of images and labels, and the loss."""
    torch.manual_seed(0)
    images = torch.randn(batch_size, 3, 32, 32)
    labels = torch.randint(0, 10, (batch_size,))
    return {
        "model": SmallResNet(),
        "sample_batch": (images, labels),
        "loss_fn": lambda logits, batch: F.cross_entropy(logits, batch[1]),
    }
