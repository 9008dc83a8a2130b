"""Benchmark: stage trees (shared training prefixes) against trial-based execution.

One fixed small CNN (conv 3x3 -> ReLU -> conv 3x3 -> ReLU -> max-pool -> linear) on
``td.datasets.digits()``; SGD with momentum 0.9, batch size 64. A Hippo-style grid over the
learning-rate schedule: step-decay ``milestones`` (epochs), decay factor ``gamma`` and the epoch
budget ``epochs`` (see GRID), every trial with the same initial weights (``seeds=
"per-architecture"``). The same experiment runs

* ``trial`` -- ``optimize=False``: every trial trains on its own, as Ray Tune or Optuna run it;
* ``tree``  -- the default (``optimize=True``): the planner trains the grid as a stage tree.

in interleaved rounds (trial, tree, trial, tree, ...); each run is its own process
(``OMP_NUM_THREADS=1``) and reports its CPU-seconds (``time.process_time``), wall time and every
trial's per-epoch validation accuracy, which must be identical between the two modes. The
hyperband and asha rows run ``td.strategy.Hyperband`` / ``td.strategy.ASHA`` (60 trials) over the
same space (milestones x gamma; the budget is the strategy's) with and without sharing.

``--studies``: two studies in one store, the second (GRID, 60 trials) a superset of the first
(STUDY1, 12 trials). The first runs untimed, then the second is timed three ways, interleaved:
``trial`` (``optimize=False``), ``tree`` (stage tree, its own stages only:
``StagePolicy(reuse="experiment")``) and ``reuse`` (stage tree starting from the first study's
stored stages, the default). Each evaluator is a new object, so only the store carries stages over.

    .venv/bin/python bench/stage_tree.py                 # 3 rounds of the grid, then Hyperband
    .venv/bin/python bench/stage_tree.py --quick         # 1 round, smaller grid
    .venv/bin/python bench/stage_tree.py --one tree      # one measurement (JSON)
    .venv/bin/python bench/stage_tree.py --strategy asha --rounds 2
    .venv/bin/python bench/stage_tree.py --studies --rounds 2
    .venv/bin/python bench/stage_tree.py --executor process --rounds 2   # on Process(workers=2)

``--executor process`` runs every experiment on ``td.executors.Process(workers=2)``: the stage
trees (or the trials) train on the pool's workers; CPU-seconds then count the whole process tree
(the driver, the fork server, the workers), sampled every 0.1 s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import _common as C
import tridens as td
from _models import SmallCNN

GRID = {"epochs": [6, 9, 12, 15, 18], "milestones": [[3], [6], [3, 9], [6, 12]], "gamma": [0.1, 0.2, 0.5]}
QUICK = {"epochs": [4, 8], "milestones": [[2], [4], [2, 6]], "gamma": [0.1, 0.5]}
STUDY1 = {"epochs": [6, 12], "milestones": [[3], [3, 9]], "gamma": [0.1, 0.2, 0.5]}
QUICK_STUDY1 = {"epochs": [4], "milestones": [[2], [2, 6]], "gamma": [0.1, 0.5]}


def evaluator(grid: dict[str, list[Any]]) -> td.evaluators.Classification:
    train, val = td.datasets.digits()
    return td.evaluators.Classification(
        train, val, batch_size=64, optimizer="sgd", lr=0.05, momentum=0.9, schedule="step",
        epochs=td.choice("epochs", grid["epochs"]), milestones=td.choice("milestones", grid["milestones"]),
        gamma=td.choice("gamma", grid["gamma"]))


def executor(name: str, optimize: bool) -> Any:
    """The experiment's executor: in-process (``inline``) or a 2-worker pool (``process``)."""
    if name == "process":
        return td.executors.Process(workers=2, optimize=optimize)
    return td.executors.Inline(optimize=optimize)


class CpuClock:
    """CPU-seconds of the run: in-process, this process and its waited-for children (forked units);
    on a pool, its whole process tree (the workers are the fork server's children, not ours),
    sampled every 0.1 s (:class:`_common.ProcessTreeClock`)."""

    def __init__(self, on: str) -> None:
        self.tree = C.ProcessTreeClock(interval=0.1) if on == "process" else None

    def start(self) -> float:
        return self.tree.start().samples[-1][1] if self.tree else self._own()

    def stop(self) -> float:
        return self.tree.stop()[1] if self.tree else self._own()

    @staticmethod
    def _own() -> float:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + kids.ru_utime + kids.ru_stime


def measure(mode: str, strategy: str, grid: dict[str, list[Any]], on: str = "inline") -> dict[str, Any]:
    torch.set_num_threads(1)
    ev = evaluator(grid)
    max_trials = None
    if strategy == "grid":
        chosen: Any = td.strategy.GridSearch()
    elif strategy == "asha":
        ev.epochs = max(grid["epochs"])     # the strategy decides the budget, up to the longest
        chosen, max_trials = td.strategy.ASHA(max_steps=max(grid["epochs"]), reduction_factor=3), 60
    else:
        ev.epochs = max(grid["epochs"])
        chosen = td.strategy.Hyperband(max_steps=max(grid["epochs"]), reduction_factor=3)
    with tempfile.TemporaryDirectory() as tmp:
        exp = td.Experiment(SmallCNN(), ev, chosen, store=os.path.join(tmp, "s.db"), name="schedules",
                            budget=max_trials, options=td.RunOptions(seeds="per-architecture", verbose=False),
                            executor=executor(on, mode == "tree"))
        clock = CpuClock(on)
        cpu0, wall0, driver0 = clock.start(), time.perf_counter(), time.process_time()
        exp.run()
        cpu, wall = clock.stop() - cpu0, time.perf_counter() - wall0
        driver_cpu = time.process_time() - driver0
        trials = exp.trials()
    curves = {json.dumps(t.sample, sort_keys=True): t.metrics.get("val_acc", []) for t in trials}
    return {"mode": mode, "strategy": strategy, "executor": on, "cpu": cpu, "driver_cpu": driver_cpu, "wall": wall, "trials": len(trials),
            "trial_epochs": sum(len(c) for c in curves.values()), "best": max((max(c) for c in curves.values() if c), default=None),
            "curves": curves}


def measure_studies(mode: str, first: dict[str, list[Any]], second: dict[str, list[Any]],
                    on: str = "inline") -> dict[str, Any]:
    """The second of two studies in one store, timed; ``mode``: trial, tree (no reuse) or reuse."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "s.db")
        td.Experiment(SmallCNN(), evaluator(first), td.strategy.GridSearch(), store=store, name="first",
                      options=td.RunOptions(seeds="per-architecture", verbose=False),
                      executor=executor(on, True)).run()
        policy = td.store.StagePolicy(reuse="store" if mode == "reuse" else "experiment")
        exp = td.Experiment(SmallCNN(), evaluator(second), td.strategy.GridSearch(), store=store, name="second",
                            options=td.RunOptions(seeds="per-architecture", stage_policy=policy, verbose=False),
                            executor=executor(on, mode != "trial"))
        clock = CpuClock(on)
        cpu0, wall0, driver0 = clock.start(), time.perf_counter(), time.process_time()
        exp.run()
        cpu, wall = clock.stop() - cpu0, time.perf_counter() - wall0
        driver_cpu = time.process_time() - driver0
        trials = exp.trials()
    curves = {json.dumps(t.sample, sort_keys=True): t.metrics.get("val_acc", []) for t in trials}
    reused = sum(t.info.get("stage_store", {}).get("epochs", 0) for t in trials)
    return {"mode": mode, "strategy": "studies", "executor": on, "cpu": cpu, "driver_cpu": driver_cpu, "wall": wall, "trials": len(trials),
            "trial_epochs": sum(len(c) for c in curves.values()), "best": max(max(c) for c in curves.values() if c),
            "curves": curves, "started_from_stored_epochs": reused}


def run_one(mode: str, strategy: str, quick: bool, on: str = "inline") -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--one", mode, "--strategy", strategy, "--executor", on] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=["trial", "tree", "reuse"], help="one measurement, printed as JSON")
    parser.add_argument("--strategy", choices=["grid", "hyperband", "asha", "studies"], default="grid")
    parser.add_argument("--studies", action="store_true", help="two studies, the second a superset of the first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round of a smaller grid")
    parser.add_argument("--no-hyperband", action="store_true")
    parser.add_argument("--executor", choices=["inline", "process"], default="inline",
                        help="where the experiments run: in-process, or on Process(workers=2)")
    args = parser.parse_args()
    grid = QUICK if args.quick else GRID
    if args.one:
        if args.strategy == "studies":
            print(json.dumps(measure_studies(args.one, QUICK_STUDY1 if args.quick else STUDY1, grid, args.executor)))
        else:
            print(json.dumps(measure(args.one, args.strategy, grid, args.executor)))
        return
    rounds = 1 if args.quick else args.rounds
    if args.studies:
        studies(rounds, args.quick, grid, args.executor)
        return
    if args.strategy != "grid":
        strategies = [args.strategy]
    else:
        strategies = ["grid"] + ([] if args.no_hyperband else ["hyperband"])
    n = len(list(itertools.product(*grid.values())))
    for strategy in strategies:
        runs: dict[str, list[dict[str, Any]]] = {"trial": [], "tree": []}
        for _ in range(rounds):
            for mode in ("trial", "tree"):
                runs[mode].append(run_one(mode, strategy, args.quick, args.executor))
        same = all(a["curves"] == b["curves"] for a, b in zip(runs["trial"], runs["tree"]))
        med = {mode: {k: statistics.median(r[k] for r in rs) for k in ("cpu", "wall")} for mode, rs in runs.items()}
        print(f"{strategy}: {runs['trial'][0]['trials']} trials ({n} configurations), "
              f"{runs['trial'][0]['trial_epochs']} trial-epochs, {rounds} interleaved round(s)")
        for mode in ("trial", "tree"):
            print(f"  {mode:5s}  cpu {med[mode]['cpu']:7.1f} s   wall {med[mode]['wall']:7.1f} s   "
                  f"best val_acc {runs[mode][0]['best']:.4f}")
        print(f"  stage tree: {med['trial']['cpu'] / med['tree']['cpu']:.2f}x fewer CPU-seconds, "
              f"{med['trial']['wall'] / med['tree']['wall']:.2f}x shorter; identical per-epoch curves: {same}")


def studies(rounds: int, quick: bool, grid: dict[str, list[Any]], on: str = "inline") -> None:
    modes = ("trial", "tree", "reuse")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode in modes:
            runs[mode].append(run_one(mode, "studies", quick, on))
    same = all(r["curves"] == runs["trial"][i]["curves"] for m in modes for i, r in enumerate(runs[m]))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("cpu", "wall")} for m, rs in runs.items()}
    first = QUICK_STUDY1 if quick else STUDY1
    print(f"two studies: the second ({runs['trial'][0]['trials']} trials, {runs['trial'][0]['trial_epochs']} trial-epochs) "
          f"a superset of the first ({len(list(itertools.product(*first.values())))} trials); {rounds} interleaved round(s)")
    for m in modes:
        print(f"  {m:5s}  cpu {med[m]['cpu']:7.1f} s   wall {med[m]['wall']:7.1f} s   "
              f"epochs started from the first study's stages: {runs[m][0]['started_from_stored_epochs']}")
    print(f"  second study with reuse: {med['trial']['cpu'] / med['reuse']['cpu']:.2f}x fewer CPU-seconds than trial-based, "
          f"{med['tree']['cpu'] / med['reuse']['cpu']:.2f}x fewer than a stage tree without reuse "
          f"(wall {med['trial']['wall'] / med['reuse']['wall']:.2f}x, {med['tree']['wall'] / med['reuse']['wall']:.2f}x); "
          f"identical per-epoch curves: {same}")


if __name__ == "__main__":
    main()
