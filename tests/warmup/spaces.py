"""Spaces for the warm-start tests (importable)."""

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn


class DigitsMLP(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        h = td.choice("hidden", [16, 24, 32, 48])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


class OpaqueMLP(tnn.ModelSpace):
    """Data-dependent control flow: torch.fx cannot trace it (one opaque node)."""

    def __init__(self):
        super().__init__()
        h = td.choice("hidden", [16, 24])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        if float(x.sum()) > 0:
            x = x * 2
        return self.body(x)


def half(model):
    return 0.5
