"""Model spaces shared by the tests."""

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn


class Block(nn.Module):
    def __init__(self, width: int, index: int):
        super().__init__()
        k = td.choice(f"kernel{index}", [3, 5])
        self.conv = nn.Conv2d(width, width, k, padding=k // 2)

    def forward(self, x):
        return torch.relu(self.conv(x)) + x


class HelloNet(tnn.ModelSpace):
    """The DESIGN.md example: width, op, depth with per-block kernels."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [8, 16, 32])
        self.stem = nn.Conv2d(1, w, 3, padding=1)
        self.op = tnn.LayerChoice([nn.Conv2d(w, w, 3, padding=1), nn.Conv2d(w, w, 5, padding=2)], label="op")
        self.blocks = tnn.Repeat(lambda i: Block(w, i), depth=td.choice("depth", [1, 2, 3]))
        self.drop = nn.Dropout(td.uniform("dropout", 0.0, 0.5))
        self.head = nn.Linear(w, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        x = self.blocks(self.op(self.stem(x)))
        return self.head(self.drop(x.mean((2, 3))))


class SkipNet(tnn.ModelSpace):
    """InputChoice + dict LayerChoice + a nested user module with its own choices."""

    def __init__(self):
        super().__init__()
        h = td.choice("hidden", [16, 32])
        self.fc1 = nn.Linear(64, h)
        self.fc2 = nn.Linear(h, h)
        self.act = tnn.LayerChoice({"relu": nn.ReLU(), "gelu": nn.GELU(), "tanh": nn.Tanh()}, label="act")
        self.skip = tnn.InputChoice(n_candidates=2, n_chosen=1, reduction="sum", label="skip")
        self.out = nn.Linear(h, 10)

    def forward(self, x):
        x = x.flatten(1)
        a = self.act(self.fc1(x))
        b = self.act(self.fc2(a))
        return self.out(self.skip([a, b]))


class DartsNet(tnn.ModelSpace):
    def __init__(self, channels: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 3, padding=1)
        ops = {
            "conv3": lambda j, k, i: nn.Conv2d(channels, channels, 3, padding=1),
            "sep3": lambda j, k, i: nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, groups=channels),
                                                  nn.Conv2d(channels, channels, 1)),
            "pool": lambda j, k, i: nn.AvgPool2d(3, stride=1, padding=1),
            "skip": lambda j, k, i: nn.Identity(),
        }
        self.cell = tnn.Cell(ops, num_nodes=3, num_ops_per_node=2, num_predecessors=1, label="cell")
        self.head = nn.Linear(3 * channels, 10)

    def forward(self, x):
        return self.head(self.cell(self.stem(x)).mean((2, 3)))
