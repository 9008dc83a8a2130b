"""Bookkeeping cost of the store per trial (not a test: run it, it prints; never asserted).

    .venv/bin/python tests/store/bench_bookkeeping.py

One trial = add_trial + 3 add_metrics + update_trial to completed, each committed (the engine's
pattern), on a fresh file in a temporary directory; also grouped in one transaction per trial,
with synchronous=FULL, and the cost of a small checkpoint.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from tridens.store import Store
from tridens.trial import Trial, TrialStatus


def per_trial_ms(n: int = 500, *, grouped: bool = False, synchronous: str = "NORMAL") -> float:
    with tempfile.TemporaryDirectory() as d, Store(os.path.join(d, "bench.db"), synchronous=synchronous) as s:
        s.create_experiment("bench")
        start = time.perf_counter()
        for i in range(n):
            def one() -> None:
                t = s.add_trial("bench", Trial(id=-1, sample={"width": 32, "op": 1, "lr": 0.01}, seed=i,
                                               fingerprint="f" * 16, started_at=time.time()))
                for step in range(3):
                    s.add_metrics(t.id, step, {"val_acc": 0.5 + step / 10})
                t.status, t.metric, t.finished_at = TrialStatus.COMPLETED, 0.7, time.time()
                s.update_trial(t)
            if grouped:
                with s.transaction():
                    one()
            else:
                one()
        return (time.perf_counter() - start) / n * 1e3


def checkpoint_ms(n: int = 100) -> float:
    state = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)).state_dict()
    with tempfile.TemporaryDirectory() as d, Store(os.path.join(d, "bench.db")) as s:
        s.create_experiment("bench")
        ids = [s.add_trial("bench", Trial(id=-1, sample={}, seed=i)).id for i in range(n)]
        start = time.perf_counter()
        for i in ids:
            s.save_checkpoint(i, state)
        return (time.perf_counter() - start) / n * 1e3


if __name__ == "__main__":
    for label, kw in [("each write committed", {}), ("one transaction per trial", {"grouped": True}),
                      ("each write committed, synchronous=FULL", {"synchronous": "FULL"})]:
        runs = [per_trial_ms(**kw) for _ in range(5)]
        print(f"{label:42s} median {statistics.median(runs):.3f} ms/trial  (runs: "
              f"{', '.join(f'{r:.3f}' for r in runs)})")
    print(f"{'checkpoint of a 4,810-parameter MLP':42s} {checkpoint_ms():.3f} ms")
