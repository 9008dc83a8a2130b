"""A tiny real search on scikit-learn's digits for the interface tests (dashboard, loggers, CLI views).

Run as a script it extends the experiment to TRIALS trials: ``python tiny_search.py DB TRIALS``.
"""

import sys

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn

NAME = "tiny"


class TinyNet(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        hidden = td.choice("hidden", [4, 8, 16, 32])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def experiment(db, trials, callbacks=(), epochs=3, name=NAME):
    """``trials`` random samples of the hidden width and the learning rate, ``epochs`` epochs each."""
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train=train, val=val, epochs=epochs, batch_size=256,
                                             lr=td.choice("lr", [0.01, 0.03, 0.1]))
    return td.Experiment(TinyNet(), evaluator, td.strategy.Random(), budget=trials, store=db, name=name,
                         options=td.RunOptions(seed=5, verbose=False), callbacks=list(callbacks))


if __name__ == "__main__":
    experiment(sys.argv[1], int(sys.argv[2])).run()
