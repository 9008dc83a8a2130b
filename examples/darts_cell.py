"""A DARTS-cell space (``tnn.Cell``) searched briefly with regularized evolution on 8x8 digits.

A DARTS cell is a small DAG: each of its ``num_nodes`` nodes sums ``num_ops_per_node`` operations,
each applied to an earlier state (the cell's inputs or earlier nodes); the cell's output
concatenates its nodes. ``tnn.Cell`` makes every operation and every input a choice, labelled
``normal/op_{node}_{k}`` and ``normal/input_{node}_{k}``. The network below stacks two cells that
share the label ``normal``, so they share one genotype, as in DARTS.

The example prints the space's size, runs a few trials of ``td.strategy.RegularizedEvolution``
(a multi-trial search: every model trains separately) and prints the best genotype found.

Run::

    python examples/darts_cell.py                      # 4 trials, 1 epoch each, a few seconds
    python examples/darts_cell.py --trials 32 --epochs 3 --store darts.db
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn

NUM_NODES = 3


def _sep_conv(c: int, kernel: int) -> nn.Module:
    return nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, kernel, padding=kernel // 2, groups=c, bias=False),
                         nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))


def operations(c: int) -> dict[str, object]:
    """The candidate operations; factories ``f(node, k, input) -> module`` build fresh ones."""
    return {
        "sep_conv_3x3": lambda j, k, i: _sep_conv(c, 3),
        "sep_conv_5x5": lambda j, k, i: _sep_conv(c, 5),
        "conv_3x3": lambda j, k, i: nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, 3, padding=1, bias=False),
                                                  nn.BatchNorm2d(c)),
        "max_pool_3x3": lambda j, k, i: nn.MaxPool2d(3, stride=1, padding=1),
        "avg_pool_3x3": lambda j, k, i: nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False),
        "skip_connect": lambda j, k, i: nn.Identity(),
    }


class DartsSpace(tnn.ModelSpace):
    """stem -> cell -> 1x1 reduce -> cell (same genotype) -> global pool -> classifier."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        c = channels
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))
        self.cell1 = tnn.Cell(operations(c), num_nodes=NUM_NODES, num_ops_per_node=2, label="normal")
        self.mix = nn.Sequential(nn.ReLU(), nn.Conv2d(NUM_NODES * c, c, 1, bias=False), nn.BatchNorm2d(c))
        self.cell2 = tnn.Cell(operations(c), num_nodes=NUM_NODES, num_ops_per_node=2, label="normal")
        self.head = nn.Linear(NUM_NODES * c, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cell2(self.mix(self.cell1(self.stem(x))))
        return self.head(x.mean(dim=(2, 3)))


def genotype(sample: dict[str, object]) -> list[str]:
    """One line per node: ``node 2 = sep_conv_3x3(input) + skip_connect(node 1)``. Nodes are numbered
    as NNI numbers them: after the cell's one predecessor (state 0, the input), from 1."""
    def state(i: int) -> str:
        return "input" if i == 0 else f"node {i}"

    return [f"node {j} = " + " + ".join(f"{sample[f'normal/op_{j}_{k}']}({state(sample[f'normal/input_{j}_{k}'])})"
                                      for k in range(2))
            for j in range(1, NUM_NODES + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description="Search a DARTS cell with regularized evolution on 8x8 digits.")
    parser.add_argument("--store", help="SQLite store of the experiment (default: a temporary file, deleted at exit)")
    parser.add_argument("--trials", type=int, default=4, help="number of trials (default 4)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per trial (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tridens-darts-cell-") as tmp:
        run(args, args.store or os.path.join(tmp, "tridens.db"))


def run(args: argparse.Namespace, store: str) -> None:
    """Describe the space, search it, print the best genotype."""
    space = DartsSpace()
    search_space = space.search_space()
    print(f"DARTS cell space: {len(search_space)} labels, {space.size():.0f} genotypes")

    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=args.epochs, batch_size=32, optimizer="adam", lr=0.003)
    strategy = td.strategy.RegularizedEvolution(population=4, sample_size=2, batch_size=2)
    exp = td.Experiment(space, evaluator, strategy, budget=args.trials, store=store, name="darts-cell",
                        options=td.RunOptions(seed=args.seed, verbose=False))
    exp.run()

    print(f"\n{len(exp.trials())} trials, best first:")
    for trial in exp.top(3):
        print(f"  val_acc {trial.metric:.3f}  params {trial.info.get('params', '?'):>6}  fingerprint {trial.fingerprint[:12]}")
    best = exp.top(1)[0]
    print(f"\nbest genotype (val_acc {best.metric:.3f}):")
    for line in genotype(best.sample):
        print(f"  {line}")


if __name__ == "__main__":
    main()
