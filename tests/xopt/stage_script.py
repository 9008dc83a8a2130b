"""A stage-tree experiment run as its own process (tests/xopt/test_stage_store.py kills it with
SIGKILL and runs it again to resume): a grid over step-schedule milestones, decay factors and
epoch budgets, per-architecture seeds, one group. Every training batch appends one byte to
``<store>.batches`` (the transform below), so the test counts what each run trained.

Usage: python -m tests.xopt.stage_script STORE [SECONDS_PER_BATCH]
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import tridens as td

STORE = sys.argv[1]
PAUSE = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0


def counted(x: torch.Tensor) -> torch.Tensor:
    """The identity, counting the batch (and slowing it down by PAUSE seconds)."""
    with open(STORE + ".batches", "a") as f:
        f.write("x")
    time.sleep(PAUSE)
    return x


class Net(td.nn.ModelSpace):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


if __name__ == "__main__":
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(
        train, val, batch_size=128, lr=0.05, schedule="step", epochs=td.choice("epochs", [2, 4]),
        milestones=td.choice("milestones", [[1], [2]]), gamma=td.choice("gamma", [0.1, 0.5]), transforms=counted)
    td.Experiment(Net(), evaluator, td.strategy.GridSearch(batch_size=16), store=STORE, name="tree",
                  seeds="per-architecture", verbose=False).run()
