"""The ``AddBatchNorm`` mutator of DESIGN.md: optionally insert BatchNorm after every convolution.

A mutator edits the graph IR of a concrete model. ``AddBatchNorm`` visits every ``nn.Conv2d``
node, decides with ``self.choice([False, True], label=f"bn.{node.name}")`` and, when the answer is
yes, inserts ``nn.BatchNorm2d(node.output_shape[1])`` right after it -- the channel count comes
from the traced shapes, so the mutator works on any CNN. The base model here also has an inline
choice (its width), so inline choices and mutators combine in one space.

The example prints the graph of the model with every BatchNorm inserted, then runs a short random
search on 8x8 digits and prints the trials with the BatchNorm layers each one got.

Run::

    python examples/mutator_batchnorm.py               # 4 trials, 1 epoch each, a few seconds
    python examples/mutator_batchnorm.py --trials 8 --store bn.db
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


class SmallCNN(tnn.ModelSpace):
    """Two 3x3 convolutions, a max-pool and a classifier; the width is an inline choice."""

    def __init__(self) -> None:
        super().__init__()
        width = td.choice("width", [16, 32])
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Linear(width * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(torch.flatten(x, 1))


class AddBatchNorm(td.Mutator):
    """After each convolution, maybe a BatchNorm2d sized from the traced output shape."""

    def mutate(self, graph: td.graph.Graph) -> None:
        for node in graph.nodes(op_type=nn.Conv2d):
            if self.choice([False, True], label=f"bn.{node.name}"):
                graph.insert_after(node, nn.BatchNorm2d(node.output_shape[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description="Insert BatchNorm after convolutions with a graph mutator.")
    parser.add_argument("--store", help="SQLite store of the experiment (default: a temporary file, deleted at exit)")
    parser.add_argument("--trials", type=int, default=4, help="number of trials (default 4)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per trial (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tridens-mutator-batchnorm-") as tmp:
        run(args, args.store or os.path.join(tmp, "tridens.db"))


def run(args: argparse.Namespace, store: str) -> None:
    """Show the fully mutated graph, then search the space."""
    x = torch.zeros(2, 1, 8, 8)
    space = td.ModelSpace.from_base(SmallCNN(), [AddBatchNorm()], example_inputs=(x,))
    labels = space.search_space().describe()
    print("search space:", ", ".join(f"{k} {v['values']}" for k, v in labels.items()))

    everything = {"width": 16, "bn.conv1": True, "bn.conv2": True}
    model = space.freeze(everything)
    print(f"\nthe model of {everything}:")
    print(td.graph.trace(model, (x,)))
    print("mutation history:", [(step.by, step.choices) for step in model.tridens_history])

    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=args.epochs, batch_size=32, optimizer="sgd",
                                             lr=0.05, momentum=0.9)
    exp = td.Experiment(space, evaluator, td.strategy.Random(), budget=args.trials, store=store,
                        name="mutator-batchnorm", options=td.RunOptions(seed=args.seed, verbose=False))
    exp.run()
    print(f"\n{len(exp.trials())} trials, best first:")
    for trial in exp.top(args.trials):
        bn = [k.removeprefix("bn.") for k, v in trial.sample.items() if k.startswith("bn.") and v]
        print(f"  val_acc {trial.metric:.3f}  width {trial.sample['width']:>2}  "
              f"BatchNorm after: {', '.join(bn) or 'none'}")


if __name__ == "__main__":
    main()
