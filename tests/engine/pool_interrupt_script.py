"""A process-pool search on digits that a test interrupts with Ctrl-C, then resumes:

    python -m tests.engine.pool_interrupt_script STORE TRIALS

Trials train two small CNN epochs each on two pool workers, so that a Ctrl-C finds both busy.
"""

import sys

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn


class SmallCNN(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        width = td.choice("width", [8, 12, 16, 24])
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                  nn.Linear(width * 64, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def experiment(db, trials):
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=2, batch_size=16,
                                             lr=td.loguniform("lr", 1e-3, 1e-1))
    return td.Experiment(SmallCNN(), evaluator, td.strategy.Random(batch_size=2), budget=trials, store=db,
                         name="pool", options=td.RunOptions(seed=1, verbose=True),
                         executor=td.executors.Process(workers=2))


if __name__ == "__main__":
    experiment(sys.argv[1], int(sys.argv[2])).run()
