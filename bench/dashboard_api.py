"""Dashboard API latency on a store of 10,000 trials (written through tridens.store.Store): each
endpoint the experiment page polls, median of 7 calls, endpoints interleaved, wall and CPU seconds.

    python bench/dashboard_api.py [--trials 10000]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from starlette.testclient import TestClient

from tridens.dashboard import create_app
from tridens.store import Store
from tridens.trial import Trial, TrialStatus

ENDPOINTS = {
    "experiments": "/api/experiments",
    "experiment (labels, best over time)": "/api/experiments/big",
    "trials page 50": "/api/experiments/big/trials?limit=50",
    "trials last page": "/api/experiments/big/trials?offset={last}&limit=50",
    "trials sorted by metric": "/api/experiments/big/trials?sort=metric&desc=1&limit=50",
    "trials filtered by label": "/api/experiments/big/trials?label.op=conv&status=completed&limit=50",
    "curves of 5": "/api/experiments/big/curves?ids=1,2,3,4,5&metric=val_acc",
    "hparams (all finished)": "/api/experiments/big/hparams",
    "plan (625 recorded units)": "/api/experiments/big/plan",
    "stage tree": "/api/experiments/big/stages",
}


def build(path: Path, n: int) -> None:
    rng = random.Random(0)
    statuses = [TrialStatus.COMPLETED] * 6 + [TrialStatus.STOPPED] * 2 + [TrialStatus.FAILED, TrialStatus.RUNNING]
    with Store(path) as store:
        store.create_experiment("big", {"objective": {"metric": "val_acc", "mode": "max"}, "max_trials": n})
        with store.transaction():
            for i in range(n):
                width, op, lr = rng.choice([16, 32, 64]), rng.choice(["conv", "pool", "skip"]), 10 ** rng.uniform(-3, -1)
                acc = 0.5 + 0.3 * width / 64 + 0.1 * (op == "conv") - 0.1 * abs(math.log10(lr) + 2) + rng.gauss(0, 0.02)
                curve = [acc * (s + 1) / 3 for s in range(3)]
                status = statuses[i % len(statuses)]
                done = status in (TrialStatus.COMPLETED, TrialStatus.STOPPED)
                store.add_trial("big", Trial(id=-1, sample={"width": width, "op": op, "lr": lr}, seed=i, status=status,
                                             metric=curve[-1] if done else None, started_at=1000.0 + i,
                                             finished_at=1001.0 + i if done else None, group=i // 16,
                                             info={"params": width * 100, "train_seconds": 0.5, "unit": unit(i)},
                                             metrics={"val_acc": curve}))


def unit(i: int) -> dict:
    """What the planner records of trial ``i``'s unit: groups of 16 fused on a measured speed-up
    (store ids count from 1 in a new store)."""
    members = list(range(i // 16 * 16 + 1, i // 16 * 16 + 17))
    return {"kind": "batched", "trials": members, "groups": [members], "reason": "16 trials, fused",
            "shared": ["one data pipeline", "one vectorized model (grouped kernels)"], "batching": "off",
            "speedups": [{"trials": members, "speedup": 2.0, "fused": True}], "text": "batched unit of 16 trial(s)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=10_000, help="trials in the store (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="calls of each endpoint (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "big.db"
        build(db, args.trials)
        client = TestClient(create_app(db), base_url="http://127.0.0.1")  # (a Host the app allows)
        paths = {k: v.format(last=args.trials - 50) for k, v in ENDPOINTS.items()}
        for path in paths.values():  # warm up (imports, SQLite page cache)
            assert client.get(path).status_code == 200
        wall: dict[str, list[float]] = {k: [] for k in paths}
        cpu: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(args.repeats):
            for name, path in paths.items():  # interleaved
                t0, c0 = time.perf_counter(), time.process_time()
                response = client.get(path)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                assert response.status_code == 200, response.text
        t0, c0 = time.perf_counter(), time.process_time()
        importance = client.get("/api/experiments/big/importance?evaluator=ped-anova").json()
        imp_wall, imp_cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"| endpoint ({args.trials} trials) | median wall ms | median CPU ms |")
    print("|---|---|---|")
    for name in paths:
        print(f"| {name} | {statistics.median(wall[name]) * 1000:.1f} | {statistics.median(cpu[name]) * 1000:.1f} |")
    print(f"| importance, PED-ANOVA on {importance['trials']} completed (first call, uncached) | "
          f"{imp_wall * 1000:.0f} | {imp_cpu * 1000:.0f} |")


if __name__ == "__main__":
    main()
