"""Search a space from the hub: DARTS' cell space (``td.hub.DARTS``) on 8x8 digits.

The space is the DARTS paper's at a size a CPU trains quickly: 3 cells of width 8 on one-channel
8x8 images. By default regularized evolution trains 6 sampled architectures for 3 epochs each
(about a minute on two cores; the best reach about 95% validation accuracy). ``--strategy darts``
trains one supernet instead (every operation on every input of every node, about 50 times the
work of one architecture per step: several minutes) and scores architectures with its weights.
The best cells are printed as DARTS genotypes, the form ``td.hub.DARTS_V2`` has.

Run::

    python examples/hub_search.py                              # regularized evolution, ~1 minute
    python examples/hub_search.py --trials 12 --store hub.db   # a longer search, kept in hub.db
    python examples/hub_search.py --strategy darts --epochs 2  # one-shot DARTS, several minutes
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import tridens as td


def genotype(sample: dict[str, Any], kind: str) -> list[tuple[str, int]]:
    """A cell of a sample as DARTS writes it: ``[(op, input), ...]`` two per node."""
    nodes = sorted({int(label.split("_")[1]) for label in sample if label.startswith(f"{kind}/op_")})
    return [(sample[f"{kind}/op_{n}_{k}"], sample[f"{kind}/input_{n}_{k}"]) for n in nodes for k in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description="Search td.hub.DARTS on 8x8 digits.")
    parser.add_argument("--strategy", choices=["evolution", "darts"], default="evolution")
    parser.add_argument("--store", help="SQLite store (default: a temporary file, deleted at exit)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--trials", type=int, default=6, help="architectures trained (evolution)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tridens-hub-") as tmp:
        run(args, args.store or os.path.join(tmp, "tridens.db"))


def run(args: argparse.Namespace, store: str) -> None:
    """Search the space and print the best cells."""
    train, val = td.datasets.digits()
    space = td.hub.DARTS(width=8, num_cells=3, in_channels=1)
    evaluator = td.evaluators.Classification(train, val, epochs=args.epochs, batch_size=64, lr=0.05)
    if args.strategy == "darts":
        strategy: Any = td.oneshot.DARTS(samples=8)
        max_trials = None
    else:
        strategy, max_trials = td.strategy.RegularizedEvolution(population=4, sample_size=2), args.trials
    print(f"td.hub.DARTS: {len(space.search_space())} labels, {space.size():.3g} architectures")
    exp = td.Experiment(space, evaluator, strategy, budget=max_trials, store=store, name=f"hub-{args.strategy}")
    exp.run()
    print(f"top architectures (store: {store}):")
    for rank, trial in enumerate(exp.top(3), 1):
        sample = space.restrict(trial.sample)
        print(f"  {rank}. val_acc {trial.metric:.3f}")
        print(f"     normal: {genotype(sample, 'normal')}")
        print(f"     reduce: {genotype(sample, 'reduce')}")


if __name__ == "__main__":
    main()
