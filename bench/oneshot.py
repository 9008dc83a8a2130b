"""One-shot NAS (SPOS, DARTS) against a 64-trial multi-trial random search, same space and evaluator.

The space is a small CNN over scikit-learn's 8x8 digits with every kind of choice a supernet
holds: the width (entangled), the stem kernel (entangled), a LayerChoice of five ops, a Repeat
depth with a kernel size per block, an InputChoice (skip or not) and the hidden width. Each
system runs in a fresh process per seed (``--one NAME --seed S``), interleaved, and reports the
process CPU-seconds of its ``Experiment.run()`` (user + system, ``resource.getrusage``) and wall time:

* ``random64``: ``td.strategy.Random()``, ``max_trials=64``, the evaluator's epochs per trial;
* ``spos``: ``td.oneshot.RandomOneShot(epochs=..., samples=..., retrain=k)``;
* ``darts``: ``td.oneshot.DARTS(epochs=..., samples=..., retrain=k, warmup=...)``
  (``k = --retrain-top``, or ``--darts-retrain-top`` for DARTS alone: the k best architectures by
  inherited score are retrained; the best counts).

The figure: the retrained architecture's validation accuracy against the best of the 64 trials,
and the ratio of CPU-seconds (supernet training + search + retrain vs the 64 trials).

Run::

    python bench/oneshot.py                       # 3 seeds, the defaults below
    python bench/oneshot.py --seeds 1 --epochs 3  # a quick look
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import _common  # noqa: E402
import tridens as td  # noqa: E402
from tridens import nn as tnn  # noqa: E402


class SepConv(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.pw = nn.Conv2d(c, c, 1)

    def forward(self, x):
        return self.pw(self.dw(x))


class Block(nn.Module):
    def __init__(self, c: int, k: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, k, padding=k // 2)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))) + x


class BenchCNN(tnn.ModelSpace):
    """stem (width, kernel) -> op (5 choices) -> blocks (depth 1-3, a kernel each) -> skip? -> fc (hidden)."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [16, 32, 48])
        k = td.choice("stem_k", [3, 5])
        self.stem = nn.Conv2d(1, w, k, padding=k // 2)
        self.stem_bn = nn.BatchNorm2d(w)
        self.op = tnn.LayerChoice({
            "conv3": nn.Conv2d(w, w, 3, padding=1), "conv5": nn.Conv2d(w, w, 5, padding=2), "sep": SepConv(w),
            "maxpool": nn.MaxPool2d(3, 1, 1), "identity": nn.Identity()}, label="op")
        self.blocks = tnn.Repeat(lambda i: Block(w, td.choice(f"k{i}", [3, 5])), depth=td.choice("depth", [1, 2, 3]))
        self.skip = tnn.InputChoice(2, 1, label="skip")
        hidden = td.choice("hidden", [32, 64, 128])
        self.fc1 = nn.Linear(w * 16, hidden)
        self.fc2 = nn.Linear(hidden, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        x = F.relu(self.stem_bn(self.stem(x)))
        y = self.blocks(F.relu(self.op(x)))
        x = F.max_pool2d(self.skip([x, y]), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def one(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=args.epochs, batch_size=64, optimizer="adam", lr=0.003)
    space = BenchCNN()
    space.search_space()
    torch.optim.Adam([nn.Parameter(torch.zeros(1))])  # the first optimizer imports torch._dynamo: not timed
    if name == "random64":
        strategy: Any = td.strategy.Random()
        budget: int | None = 64
    elif name == "spos":
        strategy = td.oneshot.RandomOneShot(epochs=args.spos_epochs, samples=args.samples, retrain=args.retrain_top,
                                            fair=args.fair, bn_batches=args.bn_batches)
        budget = None
    elif name == "darts":
        retrain = args.retrain_top if args.darts_retrain_top is None else args.darts_retrain_top
        strategy = td.oneshot.DARTS(epochs=args.darts_epochs, samples=args.samples, retrain=retrain,
                                    arch_lr=args.arch_lr, bn_batches=args.bn_batches, warmup=args.darts_warmup)
        budget = None
    else:
        raise SystemExit(f"unknown system {name!r}")
    with tempfile.TemporaryDirectory() as tmp:
        exp = td.Experiment(space, evaluator, strategy, store=os.path.join(tmp, "b.db"), name=name,
                            budget=budget, options=td.RunOptions(seed=seed, verbose=False))
        cpu0, wall0 = _cpu(), time.perf_counter()
        exp.run()
        cpu, wall = _cpu() - cpu0, time.perf_counter() - wall0
        trials = exp.trials()
    out: dict[str, Any] = {"system": name, "seed": seed, "cpu_s": cpu, "wall_s": wall}
    if name == "random64":
        done = [t for t in trials if t.metric is not None]
        best = max(done, key=lambda t: t.metric)
        out.update(acc=best.metric, trials=len(done), sample=space.restrict(best.sample))
    else:
        role = lambda t: t.info.get("oneshot", {}).get("role")  # noqa: E731
        sup = next(t for t in trials if role(t) == "supernet")
        subnets = [t for t in trials if role(t) == "subnet"]
        retrained = [t for t in trials if role(t) == "retrain"]
        best = max(retrained, key=lambda t: t.metric)  # the best of the retrained architectures (one by default)
        best_inherited = max(subnets, key=lambda t: t.metric)
        out.update(acc=best.metric, inherited_acc=best_inherited.metric, subnets=len(subnets),
                   supernet_cpu_s=sup.info["oneshot"].get("train_cpu_s"),
                   retrain_cpu_s=sum(t.info["oneshot"].get("retrain_cpu_s", 0.0) for t in retrained),
                   retrained=len(retrained), sample=space.restrict(best.sample),
                   retrained_acc=[t.metric for t in sorted(retrained, key=lambda t: t.id)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help="run one system in this process and print its RESULT line")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--systems", default="random64,spos,darts")
    parser.add_argument("--epochs", type=int, default=5, help="epochs of each trial and of the retrain")
    parser.add_argument("--spos-epochs", type=int, default=30)
    parser.add_argument("--darts-epochs", type=int, default=10)
    parser.add_argument("--arch-lr", type=float, default=3e-3)
    parser.add_argument("--darts-warmup", type=float, default=0.5,
                        help="DARTS(warmup=...): share of the supernet steps that train the weights only")
    parser.add_argument("--darts-retrain-top", type=int, default=None,
                        help="DARTS' retrain=k (default: --retrain-top)")
    parser.add_argument("--samples", type=int, default=64, help="subnets scored with inherited weights")
    parser.add_argument("--retrain-top", type=int, default=1, help="architectures retrained from scratch (the best counts)")
    parser.add_argument("--fair", action="store_true", help="SPOS with FairNAS sampling (RandomOneShot(fair=True))")
    parser.add_argument("--bn-batches", type=int, default=4, help="BatchNorm recalibration batches per scored subnet")
    parser.add_argument("--baseline", help="'ACC,CPU_S': compare with these random64 means (measured earlier) "
                                           "instead of running random64")
    args = parser.parse_args()
    if args.one:
        _common.emit(one(args.one, args.seed, args))
        return
    _common.print_machine()
    passed = [f"--epochs={args.epochs}", f"--spos-epochs={args.spos_epochs}", f"--darts-epochs={args.darts_epochs}",
              f"--arch-lr={args.arch_lr}", f"--samples={args.samples}", f"--retrain-top={args.retrain_top}",
              f"--bn-batches={args.bn_batches}", f"--darts-warmup={args.darts_warmup}",
              *([f"--darts-retrain-top={args.darts_retrain_top}"] if args.darts_retrain_top is not None else []),
              *(["--fair"] if args.fair else [])]
    print(f"config: {' '.join(passed)}, seeds {args.seeds}", flush=True)
    names = args.systems.split(",")
    results = _common.interleave(names, args.seeds, lambda name, r: _common.run_worker(
        __file__, ["--one", name, "--seed", str(r), *passed]))
    base = results.get("random64")
    if base is None and args.baseline:
        acc, cpu = (float(v) for v in args.baseline.split(","))
        base = [{"acc": acc, "cpu_s": cpu}]
        print(f"random64 not run: compared with the recorded means, acc {100 * acc:.2f} %, CPU {cpu:.1f} s")
    rows = []
    for name in names:
        res = results[name]
        acc = statistics.mean(r["acc"] for r in res)
        cpu = statistics.mean(r["cpu_s"] for r in res)
        row = [name, f"{100 * acc:.2f}", f"{cpu:.1f}", f"{statistics.mean(r['wall_s'] for r in res):.1f}"]
        if base and name != "random64":
            base_acc = statistics.mean(r["acc"] for r in base)
            base_cpu = statistics.mean(r["cpu_s"] for r in base)
            row += [f"{100 * (acc - base_acc):+.2f}", f"{cpu / base_cpu:.3f}",
                    f"{100 * statistics.mean(r['inherited_acc'] for r in res):.2f}"]
        else:
            row += ["", "", ""]
        rows.append(row)
    print(_common.table(["system", "val acc % (mean)", "CPU-s (mean)", "wall s (mean)", "acc - random64 (pts)",
                         "CPU ratio", "best inherited acc %"], rows))
    for name in names:
        for r in results[name]:
            print(f"  {name} seed {r['seed']}: acc {100 * r['acc']:.2f}, CPU {r['cpu_s']:.1f} s, {r['sample']}")


if __name__ == "__main__":
    main()
