"""Importable spaces and evaluator functions for engine tests (the process executor pickles them)."""

import math
import os
import time

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.trial import TrialGroup


class TinyCNN(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [8, 16])
        self.conv = nn.Conv2d(1, w, 3, padding=1)
        self.op = tnn.LayerChoice([nn.Conv2d(w, w, 3, padding=1), nn.Identity()], label="op")
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(w * 16, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        x = torch.relu(self.op(torch.relu(self.conv(x))))
        x = nn.functional.max_pool2d(x, 2)
        return self.head(self.drop(x.flatten(1)))


def digits_loop(lr, hidden=32, epochs=2, float_labels=False, loss_and_acc=False):
    """A user's own training loop on digits (their MLP, Adam, batches of 128), reporting each
    epoch's validation accuracy as ``val_acc``, or ``{"loss", "acc"}`` with ``loss_and_acc``;
    ``float_labels`` passes float labels to cross entropy, a user's bug that fails every trial."""
    train, val = td.datasets.digits()
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = train.tensors
    y = y.float() if float_labels else y
    for epoch in range(epochs):
        for i in range(0, len(x), 128):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 128]), y[i:i + 128]).backward()
            opt.step()
        with torch.no_grad():
            out = model(val.tensors[0])
            acc = (out.argmax(1) == val.tensors[1]).float().mean().item()
            if loss_and_acc:
                td.report({"loss": nn.functional.cross_entropy(out, val.tensors[1]).item(), "acc": acc}, step=epoch)
            else:
                td.report({"val_acc": acc}, step=epoch)


class WidthMLP(tnn.ModelSpace):
    """An MLP on digits whose hidden width is the one choice ("width")."""

    def __init__(self, widths=(16, 32)):
        super().__init__()
        w = td.choice("width", list(widths))
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, w), nn.ReLU())
        self.head = nn.Linear(w, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.head(self.body(x))


class TinyMLP(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        h = td.choice("hidden", [4, 8])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


class EqualActivationsMLP(TinyMLP):
    """TinyMLP with a choice between two equal activations ("act"): four samples, two models."""

    def __init__(self):
        super().__init__()
        self.body[2] = tnn.LayerChoice([nn.ReLU(), nn.ReLU()], label="act")


TRAINED: list[int] = []  # the hidden width of each model score_and_count trained, in this process


def score_and_count(model):
    width = model.body[1].out_features
    TRAINED.append(width)
    if width == 8:
        raise RuntimeError("boom: hidden=8 is not supported")
    td.report(0.25, step=0)


class AwayMLP(TinyMLP):
    """TinyMLP whose width-8 models misbehave in any process but the one that built them (the
    driver, where tracing and planning run): ``"hang"`` sleeps ten minutes inside an epoch without
    a word, ``"die"`` ends the process (``os._exit(3)``)."""

    def __init__(self, away="hang"):
        super().__init__()
        self.away, self.built_in = away, os.getpid()

    def forward(self, x):
        if self.body[1].out_features == 8 and os.getpid() != self.built_in:
            if self.away == "hang":
                time.sleep(600)
            else:
                os._exit(3)
        return super().forward(x)


def score_by_width(model, scale=1.0):
    """A trivial user loop: reports a value derived from the model, per step."""
    width = model.body[1].out_features
    for step in range(3):
        td.report(scale * width / 8 * (step + 1) / 3, step=step)


def raise_on_hidden_8(model):
    if model.body[1].out_features == 8:
        raise RuntimeError("boom: hidden=8 is not supported")
    return 0.5


def nan_on_hidden_8(model):
    return math.nan if model.body[1].out_features == 8 else 0.5


def sleep_on_hidden_8(model):
    if model.body[1].out_features == 8:
        time.sleep(60)
    return 0.5


def sleep_briefly(model):
    time.sleep(0.7)
    return 0.5


class InheritNet(tnn.ModelSpace):
    """A stem every child shares, a conv whose width/kernel mutate, BatchNorm, and a head that
    changes shape with the width (weight-inheritance and super-graph tests). ``dropout`` > 0 puts
    a Dropout after the stem (in the prefix the children share)."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        w = td.choice("width", [8, 12])
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.drop = nn.Dropout(dropout) if dropout else None
        self.conv = tnn.LayerChoice([nn.Conv2d(8, w, 3, padding=1), nn.Conv2d(8, w, 5, padding=2)], label="op")
        self.bn = nn.BatchNorm2d(w)
        self.head = nn.Linear(w * 16, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        if self.drop is not None:
            x = self.drop(x)
        x = torch.relu(self.bn(self.conv(x)))
        return self.head(nn.functional.max_pool2d(x, 2).flatten(1))


class MLPSpace(tnn.ModelSpace):
    """Fluid and DDP tests: no dropout and no BatchNorm: data-parallel training then equals one-process training."""

    def __init__(self):
        super().__init__()
        h = td.choice("hidden", [4, 64, 512])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


class Groups(td.strategy.Strategy):
    """A user strategy handing over fixed TrialGroups (Fluid tests)."""

    def __init__(self, groups):
        self.groups = groups

    def start(self, space, objective, rng, history=()):
        super().start(space, objective, rng, history)
        self._next = 0

    def ask(self, remaining=None):
        if self._next >= len(self.groups):
            return None
        self._next += 1
        return TrialGroup([dict(s) for s in self.groups[self._next - 1]])


class _Away(nn.Module):
    """An operation that hangs (``"hang"``: ten minutes without a word) or ends its process
    (``"die"``: ``os._exit(3)``) in any process but ``driver``; ``"die-once"`` ends it at its
    40th call there (two epochs in) unless the file ``marker`` exists, which it creates."""

    calls = 0

    def __init__(self, away, driver, marker=None):
        super().__init__()
        self.away, self.driver, self.marker = away, driver, marker
        self.lin = nn.Linear(64, 10)

    def forward(self, x):
        if os.getpid() != self.driver:
            if self.away == "hang":
                time.sleep(600)
            elif self.away == "die":
                os._exit(3)
            else:
                _Away.calls += 1
                if _Away.calls == 40 and not os.path.exists(self.marker):
                    open(self.marker, "w").close()
                    os._exit(3)
        return self.lin(x)


class AwayChoice(tnn.ModelSpace):
    """A one-shot space over digits (a linear layer or a misbehaving one) whose supernet trains
    in the driver but hangs or dies in a worker: the supernet of DARTS runs every candidate."""

    def __init__(self, away, driver, marker=None):
        super().__init__()
        self.op = tnn.LayerChoice({"linear": nn.Linear(64, 10), "away": _Away(away, driver, marker)}, label="op")
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.op(x.flatten(1))
