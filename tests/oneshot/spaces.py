"""Small one-shot spaces for the tests (importable: the resume test runs a script that uses them)."""

import random

import torch
import torch.nn.functional as F
from torch import nn

import tridens as td
from tridens import nn as tnn


class Block(nn.Module):
    def __init__(self, c: int, k: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, k, padding=k // 2)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))) + x


class DigitsCNN(tnn.ModelSpace):
    """Width, kernel size, an op choice, a depth and a skip input choice over 8x8 digits."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [8, 16])
        self.stem = nn.Conv2d(1, w, td.choice("stem_k", [3, 5]), padding=td.choice("stem_k", [3, 5]) // 2)
        self.stem_bn = nn.BatchNorm2d(w)
        self.op = tnn.LayerChoice({"conv3": nn.Conv2d(w, w, 3, padding=1),
                                   "sep": nn.Sequential(nn.Conv2d(w, w, 3, padding=1, groups=w), nn.Conv2d(w, w, 1)),
                                   "pool": nn.MaxPool2d(3, 1, 1)}, label="op")
        self.blocks = tnn.Repeat(lambda i: Block(w, td.choice(f"k{i}", [3, 5])), depth=td.choice("depth", [1, 2]))
        self.skip = tnn.InputChoice(2, 1, label="skip")
        hidden = td.choice("hidden", [16, 32])
        self.fc1 = nn.Linear(w * 16, hidden)
        self.fc2 = nn.Linear(hidden, 10)
        self.example_inputs = (torch.randn(3, 1, 8, 8),)

    def forward(self, x):
        x = F.relu(self.stem_bn(self.stem(x)))
        y = self.blocks(F.relu(self.op(x)))
        x = self.skip([x, y])
        x = F.max_pool2d(x, 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class ToyChoice(tnn.ModelSpace):
    """A linear classifier on digits behind a choice between a real layer and one that outputs zeros."""

    def __init__(self):
        super().__init__()
        self.op = tnn.LayerChoice({"linear": nn.Linear(64, 10), "zero": Zero()}, label="op")
        self.example_inputs = (torch.randn(2, 1, 8, 8),)

    def forward(self, x):
        return self.op(x.flatten(1))


class Zero(nn.Module):
    def forward(self, x):
        return x.new_zeros(x.shape[0], 10)


def spos_steps(net, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    """``steps`` SPOS steps of a supernet (a random path per batch of 32, Adam, seeded): weights
    and BatchNorm statistics away from their initial values."""
    opt = torch.optim.Adam(net.model.parameters(), lr=0.01)
    rng = random.Random(0)
    for i in range(steps):
        net.set_path(net.search_space.random_sample(rng))
        idx = torch.arange(i * 32, i * 32 + 32)
        opt.zero_grad()
        F.cross_entropy(net.model(x[idx]), y[idx]).backward()
        opt.step()


def role(trial):
    """A one-shot trial's role: "supernet", "subnet" (scored with supernet weights) or "retrain"."""
    return trial.info["oneshot"]["role"]
