"""Benchmark: the store's cost per trial as an experiment grows.

One experiment in a real SQLite store (a temporary directory); trials are added until the
experiment holds N of them, then 200 more are added and finished with a tiny checkpoint
(``add_trial`` + ``finish_trial``, what the engine does per trial) and timed: CPU milliseconds per
trial at N = 1,000, 5,000, 10,000 and 20,000. A store whose per-trial work is constant shows the
same figure at every N.

    .venv/bin/python bench/store_scale.py
    PYTHONPATH=OLD/src .venv/bin/python bench/store_scale.py     # another tree's store, to compare
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

import tridens
from tridens.store import Store
from tridens.trial import Trial


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000,5000,10000,20000", help="experiment sizes to time at")
    p.add_argument("--timed", type=int, default=200, help="trials timed at each size")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    state = {"w": torch.zeros(4)}
    per_trial: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as d:
        store = Store(os.path.join(d, "s.db"))
        store.create_experiment("e")
        n = 0
        for size in sizes:
            while n < size - args.timed:  # trials without a checkpoint, to grow the experiment
                store.add_trial("e", Trial(id=-1, sample={"x": n}, seed=0))
                n += 1
            c0 = time.process_time()
            for _ in range(args.timed):
                t = store.add_trial("e", Trial(id=-1, sample={"x": n}, seed=0))
                store.finish_trial(t, state)
                n += 1
            per_trial[size] = (time.process_time() - c0) / args.timed * 1e3
            print(f"at {size:6d} trials: {per_trial[size]:.2f} ms CPU per trial (add + finish)", flush=True)
        store.close()
    print(json.dumps({"tridens": os.path.dirname(tridens.__file__), "cpu_ms_per_trial_at": per_trial}))


if __name__ == "__main__":
    main()
