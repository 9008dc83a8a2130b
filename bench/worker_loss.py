"""The cost of a lost pool worker during PBT: the same population on ``td.executors.Process``,
undisturbed and with one worker killed mid-search, beside the same search on the code before the
pool kept its members' rounds.

The search: PBT (population 8, exploit every 2 epochs, ``lr`` and ``momentum`` perturbed) over a
fixed small CNN on digits, 8 epochs, SGD, batch 64, ``Process(workers=2)``: four members per
worker, in lockstep. Each worker writes its members' trainer states per round under the run's
storage before it reports the round. In ``killed``, when the driver decides the first member's
step ``--at`` (every worker has reported that round and waits), worker 0 is SIGKILLed: its
members go on once on a fresh worker from that round, which the driver answers again. ``before``
runs the undisturbed search on the source tree given by ``--before-src`` (the code before rounds
were kept: a dead worker failed its members), to show what keeping the rounds costs.

Each run in a fresh process, interleaved (A B C, B C A, ...); wall time and CPU-seconds of the
whole process tree (driver and workers) from the search's start to its end. The killed run's
metrics must equal the undisturbed run's (same seed): it reports whether they do.

    .venv/bin/python bench/worker_loss.py --rounds 3 --before-src /tmp/src-before
    (/tmp/src-before: ``git archive aa15a1a~1 src | tar -x -C /tmp/before``, then its ``src``)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402

import tridens as td  # noqa: E402
from _models import SmallCNN  # noqa: E402

STATE: dict[str, Any] = {}


class PBTKillingAWorker(td.strategy.PBT):
    """PBT that SIGKILLs pool worker 0 when the first member's step ``at`` is decided."""

    def __init__(self, at: int, **kw: Any):
        super().__init__(**kw)
        self.at = at

    def decide(self, trial, step):
        if step == self.at and "killed_at" not in STATE:
            STATE["killed_at"] = time.perf_counter()
            os.kill(STATE["pool"].pids()[0], signal.SIGKILL)
        return super().decide(trial, step)


def one(mode: str, at: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train=train, val=val, epochs=8, batch_size=64, optimizer="sgd",
                                      lr=td.loguniform("lr", 1e-3, 0.5), momentum=td.uniform("momentum", 0.0, 0.95))
    args = {"population": 8, "interval": 2, "hyperparams": ["lr", "momentum"]}
    pool = td.executors.Process(workers=2)
    STATE["pool"] = pool
    strategy = PBTKillingAWorker(at=at, **args) if mode == "killed" else td.strategy.PBT(**args)
    clock = C.ProcessTreeClock(interval=0.25)
    with tempfile.TemporaryDirectory() as d:
        exp = td.Experiment(SmallCNN(), ev, strategy, executor=pool, store=os.path.join(d, "w.db"), name="pbt",
                            budget=td.Budget(max_trials=8), options=td.RunOptions(seed=0, verbose=False))
        clock.start()
        t0 = time.perf_counter()
        exp.run()
        wall = time.perf_counter() - t0
        clock.stop()
        cpu = clock.elapsed_cpu()
        trials = sorted(exp.trials(), key=lambda t: t.number)
    return {"wall": wall, "cpu": cpu, "completed": sum(t.status.value == "completed" for t in trials),
            "epochs": sum(len(t.metrics.get("val_acc", [])) for t in trials),
            "best": max(t.metric for t in trials if t.metric is not None),
            "curves": [t.metrics.get("val_acc", []) for t in trials]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--at", type=int, default=4, help="the step whose decision kills the worker")
    p.add_argument("--before-src", help="the src folder of the code before the pool kept rounds")
    p.add_argument("--one", choices=["before", "undisturbed", "killed"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        C.emit(one(args.one, args.at))
        return
    C.print_machine()
    script = os.path.abspath(__file__)
    names = (["before"] if args.before_src else []) + ["undisturbed", "killed"]

    def run(name: str, r: int) -> dict[str, Any]:
        env = {"OMP_NUM_THREADS": "1"}
        if name == "before":
            env["PYTHONPATH"] = os.path.abspath(args.before_src)
        return C.run_worker(script, ["--one", name, "--at", str(args.at)], env=env, timeout=600)

    res = C.interleave(names, args.rounds, run)
    rows = [[name, C.median(r["wall"] for r in res[name]), C.median(r["cpu"] for r in res[name]),
             C.median(r["completed"] for r in res[name]), C.median(r["epochs"] for r in res[name]),
             C.median(r["best"] for r in res[name])] for name in names]
    print(C.table(["run", "wall s", "CPU s", "completed", "epochs recorded", "best"], rows))
    pairs = list(zip(res["undisturbed"], res["killed"]))
    same = all(a["curves"] == b["curves"] for a, b in pairs)
    print(f"extra of a killed worker (paired medians over {args.rounds} rounds): "
          f"wall +{C.median(b['wall'] - a['wall'] for a, b in pairs):.2f} s, "
          f"CPU +{C.median(b['cpu'] - a['cpu'] for a, b in pairs):.2f} s; "
          f"curves equal to the undisturbed run's: {same}")
    if args.before_src:
        before = list(zip(res["before"], res["undisturbed"]))
        print(f"keeping the rounds (undisturbed over before, paired medians): "
              f"wall x{C.median(b['wall'] / a['wall'] for a, b in before):.3f}, "
              f"CPU x{C.median(b['cpu'] / a['cpu'] for a, b in before):.3f}; "
              f"curves equal: {all(a['curves'] == b['curves'] for a, b in before)}")


if __name__ == "__main__":
    main()
