"""A real search script for the command-line tests: `tridens run search_script.py [slow]`."""

import sys
import time

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn


class Net(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        h = td.choice("hidden", [4, 8, 16, 32, 64, 128])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def train(model, lr, pause):
    train, val = td.datasets.digits()
    x, y = train.tensors
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for epoch in range(2):
        for i in range(0, len(x), 128):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 128]), y[i:i + 128]).backward()
            opt.step()
        with torch.no_grad():
            acc = (model(val.tensors[0]).argmax(1) == val.tensors[1]).float().mean().item()
        td.report(acc, step=epoch)
        time.sleep(pause)


if __name__ == "__main__":
    pause = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    evaluator = td.evaluators.FunctionalEvaluator(train, lr=td.choice("lr", [0.01, 0.003]), pause=pause)
    exp = td.Experiment(Net(), evaluator, td.strategy.Random(), budget=6, name="cli-search",
                        options=td.RunOptions(seed=3))
    exp.run()
    print("best", exp.best().id, exp.best().metric)
