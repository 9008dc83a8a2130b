"""Real small searches on digits for the dashboard's plan, stage-tree, curve and one-shot views:
a grid over learning-rate schedules (one stage tree: trials share their first epochs), ASHA (trials
stopped at a rung, others promoted past it), a one-shot search (a supernet, scored subnets and the
best one retrained) and 40 random trials over a log-uniform learning rate (log axes, many curves).
"""

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn

from .tiny_search import TinyNet


class FixedNet(tnn.ModelSpace):
    """One architecture: the trials of the schedule grid differ only in how they train."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


class TwoOps(tnn.ModelSpace):
    """A one-shot space: one or two hidden layers, and the activation after them."""

    def __init__(self):
        super().__init__()
        self.hidden = tnn.LayerChoice({"one": nn.Linear(64, 32),
                                       "two": nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32))},
                                      label="hidden")
        self.act = tnn.LayerChoice({"relu": nn.ReLU(), "tanh": nn.Tanh()}, label="act")
        self.out = nn.Linear(32, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.out(self.act(self.hidden(x.flatten(1))))


def build(db) -> None:
    """Four experiments in the store ``db``: ``stages``, ``asha``, ``oneshot`` and ``logscale``."""
    train, val = td.datasets.digits()
    schedules = td.evaluators.Classification(train, val, batch_size=128, lr=0.05, schedule="step",
                                             epochs=td.choice("epochs", [2, 3]),
                                             milestones=td.choice("milestones", [[1], [2]]),
                                             gamma=td.choice("gamma", [0.1, 0.5]))
    td.Experiment(FixedNet(), schedules, td.strategy.GridSearch(batch_size=16), store=db, name="stages",
                  options=td.RunOptions(seeds="per-architecture", verbose=False)).run()
    asha = td.evaluators.Classification(train, val, epochs=3, batch_size=256, lr=td.choice("lr", [0.01, 0.03, 0.1]))
    td.Experiment(TinyNet(), asha, td.strategy.ASHA(max_steps=3, reduction_factor=3, batch_size=6), budget=6,
                  store=db, name="asha", options=td.RunOptions(seed=3, verbose=False)).run()
    oneshot = td.evaluators.Classification(train, val, epochs=3, batch_size=128, optimizer="adam", lr=0.01)
    td.Experiment(TwoOps(), oneshot, td.oneshot.RandomOneShot(samples=4, population=4, retrain=1), store=db,
                  name="oneshot", options=td.RunOptions(verbose=False)).run()
    logscale = td.evaluators.Classification(train, val, epochs=2, batch_size=256, lr=td.loguniform("lr", 1e-3, 1.0))
    td.Experiment(TinyNet(), logscale, td.strategy.Random(), budget=40, store=db, name="logscale",
                  options=td.RunOptions(seed=2, verbose=False)).run()
