"""Benchmark: the same 16-trial search in-process, on the process pool and on a local Ray.

The search: ``td.strategy.Random(batch_size=16)`` (one group of 16) over :class:`_models.DigitsCNN`
(width x kernel x hidden) with ``lr`` {1e-3, 3e-3, 1e-2}, trained by ``td.evaluators.Classification``
on ``td.datasets.digits()`` for 3 epochs, batch 32, Adam, seed 0, a SQLite store in a temporary
directory. The systems differ only in ``executor=``:

* ``inline``  -- ``td.executors.Inline()``: the group's units train in the driver, in lockstep.
* ``process`` -- ``td.executors.Process(workers=2)``: the units on a pool of two worker processes.
* ``ray``     -- ``td.executors.Ray(workers=2)``: the executor starts a local Ray (two CPUs) and
  runs the units as Ray tasks.

Each run is a fresh Python process (``OMP_NUM_THREADS=1``); the systems run interleaved
(A B C, B C A, ...) and the table shows medians. "wall s" is ``exp.run()`` from the call to its
return, executor start and shutdown included; "to 1st trial s" is from the call to the first
trial's start (executor start, planning); "CPU s" is the CPU of the whole process tree of the run (driver,
pool workers, Ray's daemons and workers), sampled from /proc every 0.1 s.

``--profile NAME`` runs one system under cProfile in this process and prints the driver's top
functions by cumulative time (what the driver waits on and spends).

    .venv/bin/python bench/executors.py --rounds 3
    .venv/bin/python bench/executors.py --profile ray
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402
from _models import DigitsCNN  # noqa: E402

import torch  # noqa: E402

import tridens as td  # noqa: E402

SYSTEMS = ["inline", "process", "ray"]
TRIALS = 16
EPOCHS = 3


def executor(name: str) -> Any:
    if name == "inline":
        return td.executors.Inline()
    if name == "process":
        return td.executors.Process(workers=2)
    if name == "ray":
        return td.executors.Ray(workers=2)
    raise SystemExit(f"unknown system {name!r}; one of {SYSTEMS}")


def one(name: str) -> dict[str, Any]:
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train=train, val=val, epochs=EPOCHS, batch_size=32, optimizer="adam",
                                             lr=td.choice("lr", [1e-3, 3e-3, 1e-2]))
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # torch._dynamo's import, paid before timing
    with tempfile.TemporaryDirectory() as d:
        exp = td.Experiment(DigitsCNN(), evaluator, td.strategy.Random(batch_size=TRIALS), budget=TRIALS,
                            store=os.path.join(d, "e.db"), name="executors", executor=executor(name),
                            options=td.RunOptions(verbose=False, seed=0))
        t0 = time.time()
        exp.run()
        wall = time.time() - t0
        trials = exp.trials()
    started = [t.started_at for t in trials if t.started_at is not None]
    return {"trials": len(trials), "wall_s": wall,
            "first_trial_s": (min(started) - t0) if started else float("nan"),
            "epochs": sum(len(t.metrics.get("val_acc", [])) for t in trials),
            "best": max(t.metric for t in trials if t.metric is not None)}


def profile(name: str, top: int) -> None:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    result = one(name)
    prof.disable()
    print(f"{name}: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})}")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--one", help="run one system once in this process and print its JSON")
    p.add_argument("--profile", help="run one system under cProfile and print the driver's top functions")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", help="write all raw results here")
    args = p.parse_args()
    if args.one:
        C.emit(one(args.one))
        return
    if args.profile:
        profile(args.profile, args.top)
        return
    C.become_subreaper()
    C.print_machine()
    systems = [s for s in args.systems.split(",") if s]
    script = os.path.abspath(__file__)
    res = C.interleave(systems, args.rounds, lambda name, r: C.measure_tree(script, ["--one", name],
                                                                             {"OMP_NUM_THREADS": "1"}))
    ref = C.median(r["wall_s"] for r in res[systems[0]])
    ref_cpu = C.median(r["cpu_s"] for r in res[systems[0]])
    rows = []
    for name in systems:
        runs = res[name]
        wall, cpu = C.median(r["wall_s"] for r in runs), C.median(r["cpu_s"] for r in runs)
        rows.append([name, runs[0]["trials"], C.median(r["epochs"] for r in runs), wall, wall / ref,
                     C.median(r["first_trial_s"] for r in runs),
                     cpu, cpu / ref_cpu, C.median(r["best"] for r in runs)])
    print(f"\n{TRIALS}-trial random search ({EPOCHS} epochs, digits CNN), median of {args.rounds} interleaved rounds:")
    print(C.table(["system", "trials", "epochs", "wall s", f"x {systems[0]}", "to 1st trial s",
                   "CPU s (tree)", f"CPU x {systems[0]}", "best val_acc"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": C.machine(), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
