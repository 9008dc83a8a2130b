"""Benchmark: a 32-trial ASHA search on digits with tridens in-process, tridens on Ray, and Ray Tune
(the cluster executor's overhead and scaling on one machine).

Every system trains the same small CNN space (``width`` {8, 16, 24, 32}, ``kernel`` {3, 5},
``hidden`` {32, 64, 96, 128}, ``lr`` {1e-3, 2e-3, 5e-3, 1e-2}: 128 configurations) on
``td.datasets.digits()`` with the same training function -- tridens' ``SupervisedTrainer`` (Adam,
batch 32, up to 9 epochs, validation accuracy after each) -- under the same ASHA settings: grace
period / min_steps 1, max 9 epochs, reduction factor 3, one bracket (rungs after epochs 1 and 3).
Each system draws its own 32 random configurations (seeded), so the epochs trained differ a
little: the table shows them, and the wall time per trained epoch.

* ``tridens-inline``  -- ``td.Experiment(..., td.strategy.ASHA(min_steps=1, max_steps=9,
  reduction_factor=3, batch_size=32), executor=td.executors.Inline())``: the 32 trials of the group train in
  lockstep in the driver (fused where the planner measures a gain).
* ``tridens-ray``     -- the same with ``executor=td.executors.Ray(workers=2)`` (``optimize=True``, the
  default): the planner's units as Ray tasks with one CPU each (a fused unit is one task; with
  fewer tasks than workers the biggest unit is planned again in halves), metrics streamed to the
  driver, ASHA's decisions made as results arrive.
* ``tridens-ray-separate`` -- the same with ``optimize=False``: each trial its own Ray task.
* ``tune``            -- Ray Tune: ``tune.Tuner`` over a function trainable that trains with the
  same trainer and ``tune.report``s ``val_acc`` each epoch, ``ASHAScheduler(time_attr=
  "training_iteration", grace_period=1, max_t=9, reduction_factor=3, brackets=1)``,
  ``num_samples=32``, ``max_concurrent_trials=2``, one CPU per trial; Tune's defaults otherwise
  (a new actor, i.e. a new worker process, per trial).
* ``tune-reuse``      -- the same with ``reuse_actors=True`` (trials reuse the two actors).

For both Ray systems ``ray.init(num_cpus=2)`` is timed apart ("init s"); "search s" is the search
itself. CPU-seconds are those of the whole process tree of the measured run (driver, Ray's daemons
and workers), sampled from /proc every 0.1 s; the benchmark driver is a child subreaper, so Ray's
orphaned processes stay in that tree. Every run is a fresh process with
``OMP_NUM_THREADS=1``; systems are interleaved, medians reported.

    .venv/bin/python bench/asha_ray.py                  # 3 interleaved rounds
    .venv/bin/python bench/asha_ray.py --rounds 1       # one round
    .venv/bin/python bench/asha_ray.py --one tune       # one measurement (JSON)
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

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import tridens as td  # noqa: E402
from tridens import nn as tnn  # noqa: E402

WIDTHS = [8, 16, 24, 32]
KERNELS = [3, 5]
HIDDEN = [32, 64, 96, 128]
LRS = [1e-3, 2e-3, 5e-3, 1e-2]
BATCH_SIZE = 32
MAX_EPOCHS = 9
GRACE = 1
ETA = 3
TRIALS = 32
SYSTEMS = ["tridens-inline", "tridens-ray", "tridens-ray-separate", "tune", "tune-reuse"]


def _layers(module: nn.Module, width: int, kernel: int, hidden: int) -> None:
    module.conv1 = nn.Conv2d(1, width, kernel, padding=kernel // 2)
    module.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
    module.fc1 = nn.Linear(2 * width * 16, hidden)
    module.fc2 = nn.Linear(hidden, 10)


def _forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = F.relu(m.conv1(x))
    x = F.max_pool2d(F.relu(m.conv2(x)), 2)
    return m.fc2(F.relu(m.fc1(x.flatten(1))))


class CNN(nn.Module):
    """The plain model Ray Tune builds from a configuration."""

    def __init__(self, width: int, kernel: int, hidden: int):
        super().__init__()
        _layers(self, width, kernel, hidden)

    def forward(self, x):
        return _forward(self, x)


class CNNSpace(tnn.ModelSpace):
    """The same model as a tridens space."""

    def __init__(self):
        super().__init__()
        _layers(self, td.choice("width", WIDTHS), td.choice("kernel", KERNELS), td.choice("hidden", HIDDEN))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return _forward(self, x)


def evaluator() -> td.evaluators.Classification:
    train, val = td.datasets.digits()
    return td.evaluators.Classification(train=train, val=val, epochs=MAX_EPOCHS, batch_size=BATCH_SIZE,
                                        optimizer="adam", lr=td.choice("lr", LRS))


def warm_up() -> None:
    """The first optimizer of a process imports torch._dynamo (~1.7 s here): paid before timing
    by every driver; Ray's workers pay it in their first trial."""
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


# -- systems ------------------------------------------------------------------------------------------
def one_tridens(executor: str, optimize: bool = True) -> dict[str, Any]:
    ev = evaluator()
    warm_up()
    init_s = 0.0
    if executor == "ray":
        import ray

        t0 = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
        init_s = time.perf_counter() - t0
    strategy = td.strategy.ASHA(min_steps=GRACE, max_steps=MAX_EPOCHS, reduction_factor=ETA, batch_size=TRIALS)
    import logging

    planned: list[str] = []  # the planner's unit lines (what was fused)

    class Units(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if " unit of " in text or "planned again" in text:
                planned.append(text)

    logger = logging.getLogger("tridens")
    logger.addHandler(Units(logging.INFO))
    logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as d:
        exp = td.Experiment(CNNSpace(), ev, strategy, budget=TRIALS, store=os.path.join(d, "asha.db"),
                            name="asha", options=td.RunOptions(verbose=False, seed=0),
                            executor=td.executors.Ray(workers=2, optimize=optimize) if executor == "ray"
                            else td.executors.Inline(optimize=optimize))
        t0 = time.perf_counter()
        exp.run()
        seconds = time.perf_counter() - t0
        trials = exp.trials()
    if executor == "ray":
        import ray

        ray.shutdown()
    epochs = sum(len(t.metrics.get("val_acc", [])) for t in trials)
    return {"trials": len(trials), "epochs": epochs, "seconds": seconds, "init_s": init_s,
            "train_seconds": sum(t.info.get("train_seconds", 0.0) for t in trials),
            "best": max(t.metric for t in trials if t.metric is not None), "units": planned}


def _tune_trainable(config: dict[str, Any], ev: Any = None) -> None:
    """The training function Tune runs: the same trainer, one ``tune.report`` per epoch."""
    from ray import tune

    torch.manual_seed(config["seed"])
    model = CNN(config["width"], config["kernel"], config["hidden"])
    trainer = ev.trainer(model, {"lr": config["lr"]}, config["seed"])
    while trainer.epoch < trainer.epochs:
        t0 = time.perf_counter()
        metrics = trainer.train_epoch()
        metrics.update(trainer.validate())
        tune.report({"val_acc": metrics["val_acc"], "train_seconds": time.perf_counter() - t0})


def one_tune(reuse: bool = False) -> dict[str, Any]:
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    ev = evaluator()
    warm_up()
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    init_s = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory() as d:
            scheduler = ASHAScheduler(time_attr="training_iteration", max_t=MAX_EPOCHS, grace_period=GRACE,
                                      reduction_factor=ETA, brackets=1)
            tuner = tune.Tuner(
                tune.with_resources(tune.with_parameters(_tune_trainable, ev=ev), {"cpu": 1}),
                param_space={"width": tune.choice(WIDTHS), "kernel": tune.choice(KERNELS),
                             "hidden": tune.choice(HIDDEN), "lr": tune.choice(LRS), "seed": tune.randint(0, 2**31 - 1)},
                tune_config=tune.TuneConfig(num_samples=TRIALS, metric="val_acc", mode="max", scheduler=scheduler,
                                            max_concurrent_trials=2, reuse_actors=reuse,
                                            search_alg=BasicVariantGenerator(random_state=0)),
                run_config=tune.RunConfig(storage_path=d, name="asha", verbose=0),
            )
            t0 = time.perf_counter()
            results = tuner.fit()
            seconds = time.perf_counter() - t0
            epochs = sum(len(r.metrics_dataframe) for r in results if r.metrics_dataframe is not None)
            train_s = sum(float(r.metrics_dataframe["train_seconds"].sum()) for r in results
                          if r.metrics_dataframe is not None)
            best = max(float(r.metrics_dataframe["val_acc"].max()) for r in results if r.metrics_dataframe is not None)
            done = len(results)
    finally:
        ray.shutdown()
    return {"trials": done, "epochs": epochs, "seconds": seconds, "init_s": init_s, "train_seconds": train_s,
            "best": best}


def one(name: str) -> dict[str, Any]:
    if name == "tridens-inline":
        return one_tridens("inline")
    if name == "tridens-ray":
        return one_tridens("ray")
    if name == "tridens-ray-separate":
        return one_tridens("ray", optimize=False)
    if name == "tune":
        return one_tune()
    if name == "tune-reuse":
        return one_tune(reuse=True)
    raise SystemExit(f"unknown system {name!r}; one of {SYSTEMS}")


# -- the measuring driver -----------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--one", help="run one system once in this process and print its JSON")
    p.add_argument("--json", help="write all raw results here")
    args = p.parse_args()
    if args.one:
        C.emit(one(args.one))
        return

    C.become_subreaper()
    C.print_machine()
    systems = [s for s in args.systems.split(",") if s]
    script = os.path.abspath(__file__)
    env = {"OMP_NUM_THREADS": "1"}
    res = C.interleave(systems, args.rounds, lambda name, r: C.measure_tree(script, ["--one", name], env))
    ref = "tridens-inline" if "tridens-inline" in res else systems[0]
    base = C.median(r["seconds"] + r["init_s"] for r in res[ref])
    rows = []
    for name in systems:
        runs = res[name]
        search = C.median(r["seconds"] for r in runs)
        total = C.median(r["seconds"] + r["init_s"] for r in runs)
        rows.append([name, runs[0]["trials"], C.median(r["epochs"] for r in runs), C.median(r["init_s"] for r in runs),
                     search, total, total / base, C.median(r["seconds"] / r["epochs"] for r in runs) * 1e3,
                     C.median(r["train_seconds"] for r in runs), C.median(r["cpu_s"] for r in runs),
                     C.median(r["process_s"] for r in runs), C.median(r["best"] for r in runs)])
    print(f"\n{TRIALS}-trial ASHA (grace 1, max 9 epochs, reduction factor 3) on digits, median of "
          f"{args.rounds} interleaved rounds:")
    print(C.table(["system", "trials", "epochs", "init s", "search s", "init+search s", f"x {ref}",
                   "search ms/epoch", "sum train s", "CPU s (tree)", "process wall s", "best val_acc"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": C.machine(), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
