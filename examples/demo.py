"""`make demo`: about a minute of regularized evolution over a CNN space on real digits.

The space has a width, a per-layer operator choice, a depth whose blocks each choose a kernel
(conditional labels), a dropout rate, and the learning rate of the declarative evaluator. The
experiment is stored in runs/demo.db; inspect it afterwards with

    .venv/bin/tridens ls --db runs/demo.db
    .venv/bin/tridens top <name> --db runs/demo.db
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn


class SepConv(nn.Module):
    """Depthwise-separable convolution."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, kernel, padding=kernel // 2, groups=channels)
        self.pointwise = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.depthwise(x))


class Block(nn.Module):
    def __init__(self, channels: int, index: int):
        super().__init__()
        k = td.choice(f"block{index}.kernel", [3, 5])
        self.op = tnn.LayerChoice({"conv": nn.Conv2d(channels, channels, k, padding=k // 2),
                                   "sepconv": SepConv(channels, k)}, label=f"block{index}.op")
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.op(x))) + x


class DigitsCNN(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [16, 32, 48])
        self.stem = nn.Sequential(nn.Conv2d(1, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU())
        self.blocks = tnn.Repeat(lambda i: Block(w, i), depth=td.choice("depth", [1, 2, 3]))
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.drop = nn.Dropout(td.choice("dropout", [0.0, 0.2, 0.4]))
        self.head = nn.Linear(w * 4, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.blocks(self.stem(x)))
        return self.head(self.drop(x.flatten(1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="runs/demo.db")
    parser.add_argument("--duration", default="60s")
    parser.add_argument("--trials", type=int, default=60)
    args = parser.parse_args()
    Path(args.store).parent.mkdir(parents=True, exist_ok=True)
    # One thread per process: PyTorch's default (one per core) makes these small models wait on
    # each other's threads, most of all on a busy machine. OMP_NUM_THREADS overrides it.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    space = DigitsCNN()
    print(f"search space: {len(space.search_space())} labels, {space.size():,.0f} samples")
    for label, spec in space.search_space().items():
        cond = f"  (if {' and '.join(map(str, spec.conditions))})" if spec.conditions else ""
        print(f"  {label}: {spec.domain!r}{cond}")

    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train=train, val=val, epochs=3, batch_size=64, optimizer="adam",
                                             lr=td.choice("lr", [0.003, 0.01]), schedule="cosine")
    name = time.strftime("demo-%Y%m%d-%H%M%S")
    exp = td.Experiment(space, evaluator, td.strategy.RegularizedEvolution(population=8, sample_size=3),
                        budget=td.Budget(max_trials=args.trials, max_duration=args.duration), store=args.store,
                        name=name)
    try:
        exp.run()
    except KeyboardInterrupt as stop:  # Ctrl-C: one line saying how to finish the experiment
        sys.exit(f"\n{stop}")

    print(f"\n{exp.stop_reason}; best trials of {name}:")
    for t in exp.top(5):
        sample = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v!r}" for k, v in t.sample.items())
        print(f"  trial {t.number:3d}  val_acc={t.metric:.4f}  params={t.info['params']:>7,}  {sample}")
    print(f"\n{len(exp.trials())} trials stored in {Path(args.store).resolve()}")
    print(f"try: .venv/bin/tridens top {name} --db {args.store}")


if __name__ == "__main__":
    main()
