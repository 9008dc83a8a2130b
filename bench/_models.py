"""Models shared by several benchmarks (imported by the driver; Ray workers receive them by value)."""

from __future__ import annotations

import torch
from torch import nn

import tridens as td


class SmallCNN(td.nn.ModelSpace):
    """A fixed small CNN for 8x8 digits (conv 3x3 16 -> ReLU -> conv 3x3 32 -> ReLU -> max-pool ->
    linear): searches over it vary only its training (schedule, lr, momentum)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                                      nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))
