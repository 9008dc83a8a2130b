"""A small search run as its own process, for the decision cache's test: 8 trials of one MLP
(4 learning rates x 2 activations) on digits, the environment's optimization settings (so
``$TRIDENS_DECISION_CACHE`` names the cache file), the planner's log on stderr, each trial's
final validation accuracy on stdout as JSON.

Usage: python -m tests.xopt.decision_script STORE
"""

from __future__ import annotations

import json
import logging
import sys

import torch
from torch import nn

import tridens as td


class Net(td.nn.ModelSpace):
    def __init__(self):
        super().__init__()
        act = nn.ReLU if td.choice("act", ["relu", "tanh"]) == "relu" else nn.Tanh
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), act(), nn.Linear(32, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def main(store: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    torch.set_num_threads(1)
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train, val, epochs=1, batch_size=32, optimizer="adam",
                                      lr=td.choice("lr", [1e-3, 3e-3, 1e-2, 3e-2]))
    exp = td.Experiment(Net(), ev, td.strategy.GridSearch(), budget=8, store=store, name="cache",
                        options=td.RunOptions(verbose=False, seed=1))
    exp.run()
    print(json.dumps({json.dumps(t.sample, sort_keys=True): t.metrics["val_acc"][-1] for t in exp.trials()}))


if __name__ == "__main__":
    main(sys.argv[1])
