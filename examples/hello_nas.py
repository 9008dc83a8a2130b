"""Hello, NAS: the tridens version of NNI's ``hello_nas`` tutorial, on scikit-learn's 8x8 digits.

The model space is a small CNN written as ordinary PyTorch, with three choices inline:

* ``conv2``   -- a ``tnn.LayerChoice`` between a plain 3x3 convolution and a depthwise-separable one;
* ``dropout`` -- the dropout rate, a ``td.choice`` passed straight to ``nn.Dropout``;
* ``feature`` -- the width of the hidden fully connected layer.

The learning rate is a fourth choice, on the evaluator. A few trials of random search train
each sampled model for an epoch with ``td.evaluators.Classification`` and the results go to a
SQLite store (a temporary file unless ``--store`` says otherwise). The best trials are printed.

Run::

    python examples/hello_nas.py                 # 4 trials, 1 epoch each, a few seconds on a CPU
    python examples/hello_nas.py --trials 16 --epochs 5 --store hello.db
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import tridens as td
from tridens import nn as tnn


class DepthwiseSeparableConv(nn.Module):
    """A depthwise 3x3 convolution followed by a pointwise 1x1 one."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.depthwise = nn.Conv2d(c_in, c_in, 3, padding=1, groups=c_in)
        self.pointwise = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.depthwise(x))


class HelloNAS(tnn.ModelSpace):
    """conv1 -> conv2 (choice) -> max-pool -> dropout (choice) -> fc (width choice) -> fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = tnn.LayerChoice({
            "conv3x3": nn.Conv2d(16, 32, 3, padding=1),
            "depthwise_separable": DepthwiseSeparableConv(16, 32),
        }, label="conv2")
        self.dropout = nn.Dropout(td.choice("dropout", [0.25, 0.5, 0.75]))
        feature = td.choice("feature", [64, 128, 256])
        self.fc1 = nn.Linear(32 * 4 * 4, feature)
        self.fc2 = nn.Linear(feature, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)           # 8x8 -> 4x4
        x = self.dropout(torch.flatten(x, 1))
        return self.fc2(F.relu(self.fc1(x)))


def main() -> None:
    parser = argparse.ArgumentParser(description="NNI-style hello_nas with tridens on 8x8 digits.")
    parser.add_argument("--store", help="SQLite store of the experiment (default: a temporary file, deleted at exit)")
    parser.add_argument("--trials", type=int, default=4, help="number of trials (default 4)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per trial (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tridens-hello-nas-") as tmp:
        run(args, args.store or os.path.join(tmp, "tridens.db"))


def run(args: argparse.Namespace, store: str) -> None:
    """Describe the space, search it, print the best trials."""
    space = HelloNAS()
    print("search space:")
    for label, domain in space.search_space().describe().items():
        print(f"  {label:<8} {domain['values']}")

    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=args.epochs, batch_size=32, optimizer="adam",
                                             lr=td.choice("lr", [0.003, 0.001]))
    exp = td.Experiment(space, evaluator, td.strategy.Random(), budget=args.trials, store=store,
                        name="hello-nas", options=td.RunOptions(seed=args.seed, verbose=False))
    exp.run()

    print(f"\ntop trials of {len(exp.trials())} (store: {store}):")
    print(f"  {'rank':<5}{'val_acc':>8}  {'fingerprint':<14}sample")
    for rank, trial in enumerate(exp.top(3), 1):
        print(f"  {rank:<5}{trial.metric:>8.3f}  {trial.fingerprint[:12]:<14}{trial.sample}")
    best = exp.top(1)[0]
    print(f"\nbest: {best.sample['conv2']} conv2, dropout {best.sample['dropout']}, "
          f"{best.sample['feature']} features, lr {best.sample['lr']}: val_acc {best.metric:.3f}")


if __name__ == "__main__":
    main()
