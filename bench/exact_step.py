"""Where an exact fused step of small models spends its time: cProfile of ``BatchedMember.train_batch``.

The headline MLP sweep's unit (``bench/headline.py --workload mlp``): K=8 MLPs on digits, 64 hidden
units x 2 layers, ReLU and tanh variants, Adam at four lrs, batch 32, fused exactly (the grouped
program), one torch thread. One warm-up epoch, then ``--epochs`` epochs profiled; printed: the
step's total and its parts (optimizer, backward, forward Linear, loss), cumulative seconds. Run it
with ``PYTHONPATH`` at two trees to compare the code of two commits.

    PYTHONPATH=src .venv/bin/python bench/exact_step.py --epochs 4
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from headline import LRS_MLP as LRS  # noqa: E402  (the sweep's lrs and MLPs, as the headline trains them)
from headline import mlp  # noqa: E402

import torch  # noqa: E402

import tridens as td  # noqa: E402
from tridens.evaluators._supervised import BatchSource  # noqa: E402
from tridens.trial import Trial  # noqa: E402
from tridens.units import Job  # noqa: E402
from tridens.xopt import BatchingSettings  # noqa: E402
from tridens.xopt._batched import BatchedMember  # noqa: E402

PARTS = {"optimizer": ("_vector_optim.py", "step"), "backward": ("~", "<method 'run_backward'"),
         "forward Linear": ("_exact.py", "linear_per_model"), "loss": ("~", "<built-in method torch._C._nn.cross_entropy_loss>")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train=train, val=val, epochs=args.epochs + 1, batch_size=32, optimizer="adam",
                                      lr=td.choice("lr", LRS))
    jobs = []
    for activation in ("relu", "tanh"):
        for lr in LRS:
            torch.manual_seed(len(jobs))
            jobs.append(Job(Trial(id=len(jobs), sample={"lr": lr}, seed=len(jobs)),
                            mlp(args.hidden, args.depth, activation)))
    member = BatchedMember(jobs, ev, settings=BatchingSettings())
    cfg = ev.config({"lr": LRS[0]})
    batches = list(BatchSource(cfg.train, torch.device("cpu")).epoch_batches(cfg, 0, 0))

    def run(epochs: int) -> None:
        for _ in range(epochs):
            member.begin_epoch()
            for b, (x, y) in enumerate(batches):
                member.train_batch(x, y, b)
            member.end_epoch()

    run(1)
    profile = cProfile.Profile()
    profile.enable()
    run(args.epochs)
    profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    steps = args.epochs * len(batches)
    print(f"K={len(jobs)} MLPs {args.hidden}x{args.depth}, {member.engine}, {steps} steps, 1 thread (cProfile, cumulative s)")
    total = sum(v[3] for k, v in stats.items() if k[0].endswith("_batched.py") and k[2] == "train_batch")
    print(f"  train_batch {total:.3f}")
    for part, (file, name) in PARTS.items():
        seconds = sum(v[3] for k, v in stats.items() if k[0].endswith(file) and k[2].startswith(name))
        print(f"  {part} {seconds:.3f}")


if __name__ == "__main__":
    main()
