"""A graph mutator (Retiarii's ``Mutator``) that swaps 3x3 convolutions for depthwise-separable ones.

The base model is a plain PyTorch CNN with no tridens in it. ``ToDepthwiseSeparable`` walks the
model's graph IR (``graph.nodes(op_type=nn.Conv2d)``) and, for every 3x3 convolution with more
than one input channel, asks ``self.choice`` whether to replace it (``node.replace(module)``).
``td.ModelSpace.from_base`` turns base + mutator into a space with one label per convolution.

The example prints every model of the space: its mutation history (who decided what), its
parameter count, and its structural fingerprint -- and the *prefix* fingerprint of the first
convolution, which all models share (the part a cross-model optimizer could compute once). Then
it trains every model for an epoch on 8x8 digits with a grid search and prints the results.

Run::

    python examples/mutator_depthwise.py               # 4 models, 1 epoch each, a few seconds
    python examples/mutator_depthwise.py --store dw.db --epochs 3
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import tridens as td


class BaseCNN(nn.Module):
    """Three 3x3 convolutions, a max-pool and a linear classifier, for 1x8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x))
        return self.head(torch.flatten(x, 1))


class DepthwiseSeparable(nn.Sequential):
    """Depthwise kxk convolution (one filter per channel) followed by a pointwise 1x1 one."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__(
            nn.Conv2d(conv.in_channels, conv.in_channels, conv.kernel_size, conv.stride, conv.padding,
                      groups=conv.in_channels),
            nn.Conv2d(conv.in_channels, conv.out_channels, 1))


class ToDepthwiseSeparable(td.Mutator):
    """For each 3x3 convolution with several input channels: keep it, or make it depthwise-separable."""

    def mutate(self, graph: td.graph.Graph) -> None:
        for node in graph.nodes(op_type=nn.Conv2d):
            conv = node.module
            if conv.kernel_size != (3, 3) or conv.groups != 1 or conv.in_channels == 1:
                continue
            if self.choice(["conv", "depthwise_separable"], label=f"{node.name}.kind") == "depthwise_separable":
                node.replace(DepthwiseSeparable(conv))


def main() -> None:
    parser = argparse.ArgumentParser(description="A depthwise-separable mutator on a plain CNN, on 8x8 digits.")
    parser.add_argument("--store", help="SQLite store of the experiment (default: a temporary file, deleted at exit)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per trial (default 1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tridens-mutator-depthwise-") as tmp:
        run(args, args.store or os.path.join(tmp, "tridens.db"))


def run(args: argparse.Namespace, store: str) -> None:
    """Show every model of the space, then train them all."""
    x = torch.zeros(2, 1, 8, 8)
    space = td.ModelSpace.from_base(BaseCNN(), [ToDepthwiseSeparable()], example_inputs=(x,))
    print("search space:")
    for label, domain in space.search_space().describe().items():
        print(f"  {label:<12} {domain['values']}  ({domain['source']})")

    print("\nevery model of the space:")
    for sample in space.search_space().grid():
        model = space.freeze(sample)
        graph = td.graph.trace(model, (x,))
        first_conv = graph.nodes(op_type=nn.Conv2d)[0]
        params = sum(p.numel() for p in model.parameters())
        print(f"  sample {sample}")
        for step in model.tridens_history:
            print(f"    history: {step.by:<22} decided {step.choices}")
        print(f"    params {params:>6}  fingerprint {graph.fingerprint()[:12]}  "
              f"prefix fingerprint of {first_conv.name} {first_conv.prefix_fingerprint()[:12]}")
    again = td.graph.trace(space.freeze(sample), (x,)).fingerprint()
    print(f"  freezing the last sample again gives the same fingerprint: {again == graph.fingerprint()}")

    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=args.epochs, batch_size=32, optimizer="adam", lr=0.003)
    exp = td.Experiment(space, evaluator, td.strategy.GridSearch(), budget=int(space.size()), store=store,
                        name="mutator-depthwise", options=td.RunOptions(verbose=False))
    exp.run()
    print(f"\ntrained {len(exp.trials())} models for {args.epochs} epoch(s); best first:")
    for trial in exp.top(4):
        print(f"  val_acc {trial.metric:.3f}  params {trial.info.get('params', '?'):>6}  {trial.sample}")


if __name__ == "__main__":
    main()
