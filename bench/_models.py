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


class DigitsCNN(td.nn.ModelSpace):
    """conv k x k (width) -> conv 3x3 (2 x width) -> max-pool -> MLP head (hidden) on 8x8 digits:
    ``width`` {8, 16, 24, 32} x ``kernel`` {3, 5} x ``hidden`` {32, 64, 96, 128}."""

    def __init__(self) -> None:
        super().__init__()
        width, kernel = td.choice("width", [8, 16, 24, 32]), td.choice("kernel", [3, 5])
        hidden = td.choice("hidden", [32, 64, 96, 128])
        self.conv1 = nn.Conv2d(1, width, kernel, padding=kernel // 2)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 16, hidden)
        self.fc2 = nn.Linear(hidden, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))
