"""Benchmark: Fluid allocation (StaticFluid / DynamicFluid) vs one trial per worker.

Three parts:

``sim``  A trace-driven simulation of ``--devices`` devices (default 8). Workloads are sequences of
         TrialGroups as strategies hand them over -- successive halving (rungs 27x1, 9x2, 3x6, 1x18
         epochs, each rung waiting for the previous one), a random search (one group of 24 full-budget
         trials) and an evolution (6 generations of 8 trials) -- with heterogeneous trials: epoch times
         drawn log-normally (sigma 0.8, a ~10x spread between the 5th and 95th percentiles, 10 s median),
         each trial's device utilization alone ``u`` growing with its size (0.2-1.0; the Fluid paper
         measured single trials using at most ~60% of a GPU) and its data-parallel efficiency
         ``e`` from 0.5 (small) to 0.9 (big). Ground truth of the simulator: trials packed on a device progress at
         rate 1 / max(1, sum u) each (a device is shared, MPS-like, and only slows down once
         oversubscribed); a trial on w devices at rate 1 + (w - 1) e; moving a trial stalls it 2 s.
         The schedulers see each trial's one-device time with 10% measurement noise, and predict with
         the policy's own constant efficiency (0.8). ``one-per-worker`` runs each group's trials
         first-come first-served, one per device. The same scheduler code (``FluidScheduler``) drives
         the real executor. A ``cpu`` variant sets u = 1 for every trial (packing only time-shares, as
         on a CPU core) to show what is left of Fluid's gain without intra-device sharing.
``real`` For real on CPU worker processes here: ``td.Experiment(..., executor=td.executors.Process(workers=2))``
         with ``allocation=None`` (one trial per worker), ``"static"`` and ``"dynamic"``, on digits,
         a successive-halving-shaped sequence of TrialGroups of heterogeneous CNNs (see ``REAL_GROUPS``);
         each run in a fresh process, interleaved, wall time and CPU-seconds (children included).
         ``--workload fashion-sh``: Fashion-MNIST (3,000 images) rungs 6 x 1, 2 x 2, 1 x 6 epochs
         (``FASHION_GROUPS``), whose long last rungs leave one worker idle under one trial per worker.
         ``--executor ray --device cuda``: the same on a local Ray with the evaluator on the GPU, where
         a Fluid share below 1 is a fractional ``num_gpus`` (trials packed on the one GPU).
``random-search`` The 64-trial 1-epoch random search of ``bench/random_search.py`` with
         ``tridens-process`` (the pool) beside ``tridens-functional`` (in-process), interleaved, with
         CPU-seconds.

    .venv/bin/python bench/fluid.py sim                      # seconds
    .venv/bin/python bench/fluid.py real --rounds 3          # a few minutes here
    .venv/bin/python bench/fluid.py real --workload fashion-sh --rounds 3   # ~4 minutes on a quiet 2-core machine
    .venv/bin/python bench/fluid.py random-search --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import tridens as td  # noqa: E402
from tridens import nn as tnn  # noqa: E402
from tridens.engine import DynamicFluid, StaticFluid  # noqa: E402


# -- part 1: trace-driven simulation -------------------------------------------------------------------
def workload(kind: str, rng: random.Random, cpu: bool = False) -> list[list[dict[str, float]]]:
    """TrialGroups of trials ``{"epoch": seconds per epoch on one device, "epochs", "u", "e"}``."""
    def trial(epochs: float) -> dict[str, float]:
        epoch = 10.0 * math.exp(rng.gauss(0.0, 0.8))
        # Bigger models keep a device busier: u from the trial's size rank in the spread.
        size = min(1.0, max(0.0, math.log(epoch / 10.0) / 1.6 + 0.5))  # 0 (small) .. 1 (big)
        u = 1.0 if cpu else 0.2 + 0.8 * size
        return {"epoch": epoch, "epochs": epochs, "u": u, "e": 0.5 + 0.4 * size}

    if kind == "sha":  # successive halving, eta 3: a trial promoted to the next rung trains the difference
        groups, budget, size = [], 0, 27
        for target in (1, 3, 9, 27):
            groups.append([trial(target - budget) for _ in range(size)])
            budget, size = target, size // 3
        return groups
    if kind == "random":
        return [[trial(8) for _ in range(24)]]
    if kind == "evolution":
        return [[trial(4) for _ in range(8)] for _ in range(6)]
    raise ValueError(kind)


def simulate(groups: list[list[dict[str, float]]], devices: int, policy: StaticFluid | None, rng: random.Random,
             move_cost: float = 2.0) -> float:
    """Makespan of running ``groups`` one after another on ``devices`` devices."""
    clock = 0.0
    for group in groups:
        work = {i: t["epoch"] * t["epochs"] for i, t in enumerate(group)}  # one-device seconds left
        if policy is None:  # one trial per device, first come first served
            free = [0.0] * devices
            for i in range(len(group)):
                d = min(range(devices), key=lambda k: free[k])
                free[d] += work[i]
            clock += max(free)
            continue
        sched = policy.scheduler(devices)
        for i in work:
            sched.submit(i, work[i] * math.exp(rng.gauss(0.0, 0.1)))
        stall: dict[int, float] = {}
        now = 0.0
        sched.schedule()
        while work:
            for key in list(sched.rescales()):  # DynamicFluid: the trial moves (a checkpoint, a restart)
                sched.release(key, work[key])
                stall[key] = now + move_cost
            sched.schedule()
            rates = {}
            for key, entry in sched.running.items():
                t = group[key]
                if now < stall.get(key, 0.0):
                    rates[key] = 0.0
                elif entry.share >= 1:
                    rates[key] = 1 + (entry.share - 1) * t["e"]
                else:
                    demand = sum(group[k]["u"] for k in sched.load[entry.devices[0]])
                    rates[key] = 1.0 / max(1.0, demand)
            horizon = [work[k] / r for k, r in rates.items() if r > 0]
            horizon += [stall[k] - now for k in rates if rates[k] == 0]
            dt = min(horizon)
            now += dt
            for key, r in rates.items():
                work[key] -= r * dt
            for key in [k for k in rates if work[k] <= 1e-9]:
                del work[key]
                sched.finish(key)
            for key in rates:
                if key in work:
                    sched.progress(key, work[key])
        clock += now
    return clock


def run_sim(args: argparse.Namespace) -> None:
    policies = {"one-per-worker": None,
                "StaticFluid": StaticFluid(max_pack=args.max_pack, max_span=args.max_span, epsilon=2.0, efficiency=0.8),
                "DynamicFluid": DynamicFluid(max_pack=args.max_pack, max_span=args.max_span, epsilon=2.0, efficiency=0.8)}
    print(f"simulation: {args.devices} devices, max_pack c={args.max_pack}, max_span d={args.max_span}, "
          f"seeds 0-{args.seeds - 1}; makespan in simulated seconds (median over seeds)")
    rows = []
    for cpu in (False, True):
        for kind in ("sha", "random", "evolution"):
            spans: dict[str, list[float]] = {name: [] for name in policies}
            for seed in range(args.seeds):
                groups = workload(kind, random.Random(seed), cpu=cpu)
                for name, policy in policies.items():
                    spans[name].append(simulate(groups, args.devices, policy, random.Random(seed + 1000)))
            base = spans["one-per-worker"]
            label = f"{kind}{' (cpu: u=1)' if cpu else ''}"
            row = [label, C.median(base)]
            for name in ("StaticFluid", "DynamicFluid"):
                speedups = [b / f for b, f in zip(base, spans[name])]
                row += [C.median(spans[name]), f"{(C.median(speedups) - 1) * 100:+.0f}% ({(min(speedups) - 1) * 100:+.0f}..{(max(speedups) - 1) * 100:+.0f})"]
            rows.append(row)
    print(C.table(["workload", "one-per-worker s", "StaticFluid s", "Static gain (min..max)", "DynamicFluid s",
                   "Dynamic gain (min..max)"], rows))
    print("gain = one-per-worker makespan / Fluid makespan - 1, median over seeds (range)")


# -- part 2: real runs on CPU workers ------------------------------------------------------------------
# A successive-halving-shaped sequence: 6 trials x 1 epoch, 2 x 3 epochs, 1 x 6 epochs, widths mixed.
REAL_GROUPS = [
    [{"width": w, "epochs": 1} for w in (8, 16, 32, 48, 8, 64)],
    [{"width": 48, "epochs": 3}, {"width": 16, "epochs": 3}],
    [{"width": 64, "epochs": 6}],
]


class CNNSpace(tnn.ModelSpace):
    """conv 3x3 (w) -> conv 3x3 (2w) -> max-pool -> linear; importable, the pool's workers unpickle it."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [8, 16, 32, 48, 64])
        self.conv1 = nn.Conv2d(1, w, 3, padding=1)
        self.conv2 = nn.Conv2d(w, 2 * w, 3, padding=1)
        self.fc = nn.Linear(2 * w * 16, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc(x.flatten(1))


# A successive-halving-shaped sequence on Fashion-MNIST (3,000 training images, 28x28) whose last
# rungs are long: 6 CNNs x 1 epoch, the best-looking 2 x 2 epochs, 1 x 6 epochs. One trial per worker
# leaves a worker idle for about half of the run (the second rung's shorter trial ends early, the
# last rung has a single trial); Fluid can span those trials over both workers with DDP.
FASHION_GROUPS = [
    [{"width": w, "epochs": 1} for w in (8, 16, 32, 8, 16, 32)],
    [{"width": 32, "epochs": 2}, {"width": 16, "epochs": 2}],
    [{"width": 32, "epochs": 6}],
]
WORKLOADS = {"digits": REAL_GROUPS, "fashion-sh": FASHION_GROUPS}


class FashionCNNSpace(tnn.ModelSpace):
    """conv 3x3 (w) -> pool -> conv 3x3 (2w) -> pool -> linear, for 28x28 images."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [8, 16, 32])
        self.conv1 = nn.Conv2d(1, w, 3, padding=1)
        self.conv2 = nn.Conv2d(w, 2 * w, 3, padding=1)
        self.fc = nn.Linear(2 * w * 49, 10)
        self.example_inputs = (torch.zeros(2, 1, 28, 28),)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def one_real(allocation: str, workload: str = "digits", executor: str = "process", device: str = "cpu") -> dict[str, Any]:
    from tridens.trial import TrialGroup

    torch.set_num_threads(1)
    groups = WORKLOADS[workload]

    class FixedGroups(td.strategy.Strategy):
        def start(self, space, objective, rng, history=()):
            super().start(space, objective, rng, history)
            self._next = 0

        def ask(self, remaining=None):
            if self._next >= len(groups):
                return None
            self._next += 1
            return TrialGroup([dict(s) for s in groups[self._next - 1]])

    epochs = sorted({s["epochs"] for g in groups for s in g})
    if workload == "digits":
        train, val = td.datasets.digits()
        space: tnn.ModelSpace = CNNSpace()
        lr = 3e-3
    else:
        train, val = td.datasets.fashion_mnist(limit=3000, val_limit=500)
        space, lr = FashionCNNSpace(), 2e-3
    ev = td.evaluators.Classification(train=train, val=val, epochs=td.choice("epochs", epochs), batch_size=128,
                                      optimizer="adam", lr=lr, device=device)
    # on Ray with a CUDA evaluator the workers are the GPU's shares: a Fluid share below 1 is a fractional num_gpus
    policy = None if allocation == "none" else allocation
    pool = (td.executors.Ray(workers=2, allocation=policy) if executor == "ray"
            else td.executors.Process(workers=2, allocation=policy))
    with tempfile.TemporaryDirectory() as d:
        exp = td.Experiment(space, ev, FixedGroups(), store=os.path.join(d, "f.db"), name="fluid",
                            options=td.RunOptions(verbose=False), executor=pool)
        t0 = time.perf_counter()
        exp.run()
        seconds = time.perf_counter() - t0
        trials = exp.trials()
    return {"seconds": seconds, "completed": sum(t.status.value == "completed" for t in trials),
            "best": max(t.metric for t in trials if t.metric is not None),
            "final": [[t.metrics["val_acc"][-1], t.metrics["val_loss"][-1]] for t in trials],
            "last_curve": trials[-1].metrics["val_loss"],
            "allocations": {t.id: [a["share"] for a in t.info.get("allocation", [])] for t in trials}}


def run_real(args: argparse.Namespace) -> None:
    C.print_machine()
    script = os.path.abspath(__file__)
    names = ["none", "static", "dynamic"]
    res: dict[str, list[dict[str, Any]]] = {n: [] for n in names}

    def one(name: str, r: int) -> dict[str, Any]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = C.run_worker(script, ["--one", name, "--workload", args.workload, "--executor", args.executor,
                                    "--device", args.device], env={"OMP_NUM_THREADS": "1"}, timeout=1800)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out["cpu_s"] = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        out["load"] = os.getloadavg()[0]
        return out

    res = C.interleave(names, args.rounds, one)
    base = res["none"]
    rows = []
    for name in names:
        runs = res[name]
        ratios = [b["seconds"] / r["seconds"] for b, r in zip(base, runs)]
        cpu_ratios = [r["cpu_s"] / b["cpu_s"] for b, r in zip(base, runs)]
        # Same trials, same training: DDP changes only the float summation order.
        diff = max(abs(x - y) for r in runs for a, b in zip(base[0]["final"], r["final"]) for x, y in zip(a, b))
        rows.append([{"none": "one trial per worker", "static": "StaticFluid", "dynamic": "DynamicFluid"}[name],
                     C.median(r["seconds"] for r in runs), min(r["seconds"] for r in runs), max(r["seconds"] for r in runs),
                     C.median(r["cpu_s"] for r in runs), C.median(ratios), C.median(cpu_ratios),
                     C.median(r["best"] for r in runs), f"{diff:.1e}"])
    groups = WORKLOADS[args.workload]
    print(f"\n2 {'Ray' if args.executor == 'ray' else 'pool'} workers on {args.device}, {args.workload}, groups {[[(s['width'], s['epochs']) for s in g] for g in groups]}, "
          f"median of {args.rounds} interleaved rounds, load average {min(r['load'] for v in res.values() for r in v):.1f}"
          f"-{max(r['load'] for v in res.values() for r in v):.1f}:")
    print(C.table(["allocation", "wall s", "min", "max", "CPU s (all processes)", "paired speed-up vs one-per-worker",
                   "paired CPU-s ratio", "best val_acc", "max |final metric - one-per-worker|"], rows))
    for name in ("static", "dynamic"):
        print(f"{name}: shares per trial in the last run: {res[name][-1]['allocations']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": C.machine(), "results": res}, f, indent=1)


# -- part 3: the random search of bench/random_search.py, process pool vs in-process -----------------------
def run_random_search(args: argparse.Namespace) -> None:
    C.print_machine()
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "random_search.py")

    def one(name: str, r: int) -> dict[str, Any]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = C.run_worker(script, ["--one", name, "--trials", str(args.trials)], env={"OMP_NUM_THREADS": "1"},
                           timeout=3600)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out["cpu_s"] = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        out["load"] = os.getloadavg()[0]
        return out

    names = ["tridens-functional", "tridens-process"]
    res = C.interleave(names, args.rounds, one)
    rows = [[n, C.median(r["seconds"] for r in res[n]), min(r["seconds"] for r in res[n]),
             max(r["seconds"] for r in res[n]), C.median(r["cpu_s"] for r in res[n]),
             C.median(r["train_seconds"] for r in res[n])] for n in names]
    print(f"\n{args.trials}-trial random search, 1 epoch each on digits, median of {args.rounds} interleaved rounds:")
    print(C.table(["system", "wall s", "min", "max", "CPU s (all processes)", "sum of train s"], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", nargs="?", choices=["sim", "real", "random-search"], default="sim")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--max-pack", type=int, default=2)
    p.add_argument("--max-span", type=int, default=4)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trials", type=int, default=64)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="digits",
                   help="real: digits (the first sessions' groups) or fashion-sh (long last rungs)")
    p.add_argument("--executor", choices=["process", "ray"], default="process",
                   help="real: the process pool, or a local Ray (fractional GPUs with --device cuda)")
    p.add_argument("--device", default="cpu", help="real: the evaluator's device (cpu, cuda)")
    p.add_argument("--one", help="(internal) one real run with this allocation, JSON out")
    p.add_argument("--json")
    args = p.parse_args()
    if args.one:
        C.emit(one_real(args.one, args.workload, args.executor, args.device))
    elif args.part == "sim":
        run_sim(args)
    elif args.part == "real":
        run_real(args)
    else:
        run_random_search(args)


if __name__ == "__main__":
    main()
