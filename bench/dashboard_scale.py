"""The dashboard on a store of 100,000 trials: each endpoint's wall time, the server's CPU seconds,
the response's size, and the server's memory (resident set after each call, and its peak), measured
on a real ``tridens dashboard`` server process over HTTP.

The store is written once (under the temporary folder, or ``--db``) with the rows
:meth:`tridens.store.Store.add_trial` writes, inserted in bulk (``Store.add_trial`` takes minutes
for 100,000 trials): 60 % completed, 20 % stopped early, 10 % failed, 10 % running; three labels;
a three-step ``val_acc`` curve each; ``params`` (in the trial's info) as a second objective. ``--sources A,B`` starts the server from each source tree in
turn (``PYTHONPATH``), in interleaved rounds (A B A B), to compare two versions.

    python bench/dashboard_scale.py [--trials 100000] [--rounds 2] [--sources src,/work/main/src]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tridens.store import Store

ENDPOINTS = {
    "experiment (polled), first call": "/api/experiments/big",
    "experiment (polled), next poll": "/api/experiments/big",
    "trials page 50 (polled)": "/api/experiments/big/trials?limit=50",
    "hparams": "/api/experiments/big/hparams",
    "importance PED-ANOVA, first call": "/api/experiments/big/importance?evaluator=ped-anova",
    "importance PED-ANOVA, cached": "/api/experiments/big/importance?evaluator=ped-anova",
    "pareto (val_acc max, params min)": "/api/experiments/big/pareto",
    "importance fANOVA, first call": "/api/experiments/big/importance?evaluator=fanova",
}


def build(path: Path, n: int) -> None:
    """A store of ``n`` trials of one experiment ("big"), written in one transaction."""
    rng = random.Random(0)
    statuses = ["completed"] * 6 + ["stopped"] * 2 + ["failed", "running"]
    space = {"width": {"type": "categorical", "values": [16, 32, 64]},
             "op": {"type": "categorical", "values": ["conv", "pool", "skip"]},
             "lr": {"type": "loguniform", "low": 1e-3, "high": 1e-1}}
    with Store(path) as store:
        store.create_experiment("big", {"objective": {"metric": "val_acc", "mode": "max"}, "max_trials": n,
                                        "second_objective": ["params", "min"], "search_space": space})
        eid = store.get_experiment("big").id
    trials, metrics = [], []
    for i in range(n):
        width, op, lr = rng.choice([16, 32, 64]), rng.choice(["conv", "pool", "skip"]), 10 ** rng.uniform(-3, -1)
        acc = 0.5 + 0.3 * width / 64 + 0.1 * (op == "conv") - 0.1 * abs(math.log10(lr) + 2) + rng.gauss(0, 0.02)
        status = statuses[i % len(statuses)]
        steps = 1 + i % 3 if status == "stopped" else 3
        curve = [acc * (s + 1) / 3 for s in range(steps)]
        done = status in ("completed", "stopped")
        sample = json.dumps({"width": width, "op": op, "lr": lr}, separators=(",", ":"))
        info = json.dumps({"params": width * 100, "train_seconds": 0.5}, separators=(",", ":"))
        trials.append((i + 1, eid, sample, f"fp{width}{op}", i, status, curve[-1] if done else None, 0, i // 16, 3,
                       info, None, 1000.0 + i, 1000.0 + i, 1001.0 + i if done else None,
                       "RuntimeError: diverged" if status == "failed" else None))
        metrics += [(i + 1, "val_acc", s, v) for s, v in enumerate(curve)]
    import sqlite3

    conn = sqlite3.connect(path)
    with conn:
        conn.executemany("INSERT INTO trials (id, experiment_id, sample, fingerprint, seed, status, metric, metric_nan, "
                         "group_id, max_steps, info, parent, created_at, started_at, finished_at, error) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", trials)
        conn.executemany("INSERT INTO metrics (trial_id, name, step, value) VALUES (?, ?, ?, ?)", metrics)
    conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_status(pid: int) -> dict[str, float]:
    """The process's CPU seconds (user + system) and its resident set now and at its peak (MB)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    out = {"cpu": (int(fields[11]) + int(fields[12])) / ticks}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line[:5]] = int(line.split()[1]) / 1024
    return out


def measure(db: Path, source: str, call_timeout: float) -> dict[str, dict[str, float]]:
    """Start a dashboard server from ``source`` on ``db``, call every endpoint once in order (a
    call past ``call_timeout`` seconds is recorded as such, and ends this server's round)."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.path.abspath(source)}
    server = subprocess.Popen([sys.executable, "-c", "import sys; from tridens.cli import main; sys.exit(main())",
                               "dashboard", "--db", str(db), "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "/api/experiments", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the dashboard from {source} did not start")
                time.sleep(0.2)
        out: dict[str, dict[str, float]] = {"idle": _proc_status(server.pid)}
        for name, path in ENDPOINTS.items():
            before = _proc_status(server.pid)
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(base + path, timeout=call_timeout) as response:
                    body = response.read()
            except TimeoutError:   # the server is busy with it: the later endpoints are not measured
                after = _proc_status(server.pid)
                out[name] = {"wall": math.inf, "cpu": after["cpu"] - before["cpu"], "bytes": math.nan,
                             "rss": after["VmRSS"], "peak": after["VmHWM"]}
                break
            wall = time.perf_counter() - t0
            after = _proc_status(server.pid)
            out[name] = {"wall": wall, "cpu": after["cpu"] - before["cpu"], "bytes": len(body),
                         "rss": after["VmRSS"], "peak": after["VmHWM"]}
        return out
    finally:
        server.kill()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=100_000, help="trials in the store (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per source (default: %(default)s)")
    parser.add_argument("--sources", default="src", help="source trees to compare, separated by commas (default: src)")
    parser.add_argument("--call-timeout", type=float, default=300, help="seconds one call may take (default: %(default)s)")
    parser.add_argument("--db", default=None, help="a store built by an earlier call (kept; built when missing)")
    args = parser.parse_args()
    sources = args.sources.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(args.db) if args.db else Path(tmp) / "big.db"
        if not db.exists():
            t0 = time.perf_counter()
            build(db, args.trials)
            print(f"built {args.trials} trials in {time.perf_counter() - t0:.1f} s ({db.stat().st_size / 1e6:.0f} MB)")
        runs: dict[str, list[dict[str, dict[str, float]]]] = {s: [] for s in sources}
        for _ in range(args.rounds):
            for source in sources:  # interleaved: A B A B
                runs[source].append(measure(db, source, args.call_timeout))
    for source in sources:
        print(f"\n{source} ({args.trials} trials; medians of {args.rounds} rounds)")
        print("| endpoint | wall s | server CPU s | response bytes | server RSS after, MB | server peak RSS, MB |")
        print("|---|---|---|---|---|---|")
        idle = statistics.median(r["idle"]["VmRSS"] for r in runs[source])
        print(f"| (started, idle) | | | | {idle:.0f} | |")
        for name in ENDPOINTS:
            done = [r[name] for r in runs[source] if name in r]
            if not done:
                print(f"| {name} | not reached (an earlier call timed out) | | | | |")
                continue
            m = {k: statistics.median(r[k] for r in done) for k in ("wall", "cpu", "bytes", "rss", "peak")}
            wall = f"> {args.call_timeout:.0f} (timed out)" if math.isinf(m["wall"]) else f"{m['wall']:.2f}"
            size = "-" if math.isnan(m["bytes"]) else f"{m['bytes']:,.0f}"
            print(f"| {name} | {wall} | {m['cpu']:.2f} | {size} | {m['rss']:.0f} | {m['peak']:.0f} |")


if __name__ == "__main__":
    main()
