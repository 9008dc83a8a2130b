"""One-shot NAS: the same kind of model space as ``hello_nas.py``, searched by one supernet.

The space below is ordinary PyTorch with inline choices. A one-shot strategy builds ONE supernet
from it (every ``LayerChoice`` candidate, the largest width and kernel sliced per sample, the
largest depth cut per sample), trains it once, then scores many architectures with the
supernet's weights (BatchNorm recalibrated) and stores each as a trial. ``--retrain`` trains the
best one from scratch, as a normal trial.

Run::

    python examples/oneshot_nas.py                          # DARTS, a few seconds on a CPU
    python examples/oneshot_nas.py --strategy spos --epochs 10 --retrain --store oneshot.db
    python examples/oneshot_nas.py --strategy enas          # or gdas
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


class Block(nn.Module):
    """A residual conv-BN block whose kernel size is a choice."""

    def __init__(self, c: int, k: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, k, padding=k // 2)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x))) + x


class OneShotNet(tnn.ModelSpace):
    """stem (width) -> op (LayerChoice) -> 1-3 blocks (a kernel each) -> dropout -> fc (hidden)."""

    def __init__(self) -> None:
        super().__init__()
        w = td.choice("width", [16, 32])
        self.stem = nn.Sequential(nn.Conv2d(1, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU())
        self.op = tnn.LayerChoice({
            "conv3x3": nn.Conv2d(w, w, 3, padding=1),
            "depthwise_separable": nn.Sequential(nn.Conv2d(w, w, 3, padding=1, groups=w), nn.Conv2d(w, w, 1)),
            "maxpool": nn.MaxPool2d(3, stride=1, padding=1),
        }, label="op")
        self.blocks = tnn.Repeat(lambda i: Block(w, td.choice(f"kernel{i}", [3, 5])), depth=td.choice("depth", [1, 2, 3]))
        self.dropout = nn.Dropout(td.choice("dropout", [0.0, 0.25]))
        hidden = td.choice("hidden", [32, 64])
        self.fc1 = nn.Linear(w * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.op(self.stem(x))))
        x = self.dropout(F.max_pool2d(x, 2).flatten(1))                 # 8x8 -> 4x4
        return self.fc2(F.relu(self.fc1(x)))


STRATEGIES = {
    "darts": lambda a: td.oneshot.DARTS(arch_lr=3e-3, samples=a.samples, retrain=a.retrain),
    "gdas": lambda a: td.oneshot.GumbelDARTS(arch_lr=3e-3, samples=a.samples, retrain=a.retrain),
    "spos": lambda a: td.oneshot.RandomOneShot(samples=a.samples, retrain=a.retrain),
    "enas": lambda a: td.oneshot.ENAS(samples=a.samples, retrain=a.retrain),
}


def main() -> None:
    parser = argparse.ArgumentParser(description="One-shot NAS with tridens on 8x8 digits.")
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="darts")
    parser.add_argument("--store", help="SQLite store (default: a temporary file, deleted at exit)")
    parser.add_argument("--epochs", type=int, default=3, help="supernet epochs (and retrain epochs)")
    parser.add_argument("--samples", type=int, default=16, help="architectures scored with inherited weights")
    parser.add_argument("--retrain", action="store_true", help="train the best architecture from scratch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tridens-oneshot-") as tmp:
        run(args, args.store or os.path.join(tmp, "tridens.db"))


def run(args: argparse.Namespace, store: str) -> None:
    """Train the supernet, search it, print the best architectures."""
    space = OneShotNet()
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=args.epochs, batch_size=64, optimizer="adam", lr=0.003)
    exp = td.Experiment(space, evaluator, STRATEGIES[args.strategy](args), store=store,
                        name=f"oneshot-{args.strategy}", options=td.RunOptions(seed=args.seed, verbose=False))
    exp.run()

    supernet = next(t for t in exp.trials() if t.info["oneshot"]["role"] == "supernet")
    if "probabilities" in supernet.info["oneshot"]:
        print("architecture weights (softmax of alpha):")
        for label, probs in supernet.info["oneshot"]["probabilities"].items():
            print(f"  {label:<8} " + "  ".join(f"{p:.2f}" for p in probs))
    print(f"\ntop architectures (store: {store}):")
    print(f"  {'rank':<5}{'val_acc':>8}  {'how':<10}sample")
    for rank, trial in enumerate(exp.top(5), 1):
        role = trial.info["oneshot"]["role"]
        how = "retrained" if role == "retrain" else "inherited"
        print(f"  {rank:<5}{trial.metric:>8.3f}  {how:<10}{space.restrict(trial.sample)}")


if __name__ == "__main__":
    main()
