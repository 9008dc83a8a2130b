"""Benchmark: a 64-trial random search, one epoch each on digits, against Optuna and Ray Tune.

Every system trains the same small CNN (conv k x k -> conv 3x3 -> max-pool -> MLP head) on
``td.datasets.digits()`` (1,438 train / 359 validation 8x8 images) for one epoch, batch size 32,
Adam, and scores validation accuracy. The space: ``width`` {8, 16, 24, 32}, ``kernel`` {3, 5},
``hidden`` {32, 64, 96, 128}, ``lr`` {1e-3, 2e-3, 5e-3, 1e-2} (128 configurations).

* ``tridens-classification`` -- ``td.Experiment`` with ``td.evaluators.Classification`` (the
  engine's own loop), ``td.strategy.Random()``, a SQLite store in a temporary directory.
* ``tridens-classification-noopt`` -- the same with ``optimize=False`` (no cross-model
  optimization: each trial reads its own batches; with the default, the planner may give a
  TrialGroup one shared data pipeline, CSE).
* ``tridens-functional``     -- the same experiment with ``FunctionalEvaluator(train_epoch,
  lr=td.choice(...))``: the exact training function the other systems run.
* ``tridens-process``        -- ``tridens-functional`` with ``executor=td.executors.Process(workers=2)``:
  each trial in its own spawned process, two at a time (the counterpart of Ray's two workers).
* ``optuna``                 -- ``study.optimize`` (RandomSampler, in-memory storage) of an
  objective that builds the model and calls ``train_epoch``.
* ``ray``                    -- Ray Tune: ``ray.init(num_cpus=2)`` (timed apart), ``tune.Tuner``
  over a function trainable that builds the model and calls ``train_epoch``, 64 samples, Tune's
  defaults (each trial in a new actor; two trials at a time, one CPU and one torch thread each).
* ``ray-reuse``              -- the same with ``reuse_actors=True``.

tridens (inline) and Optuna run trials one after another in the driver; Ray and the process
executor run two at a time. Every measured process is started with ``OMP_NUM_THREADS=1`` by default
(``--threads``): on this shared 2-core machine, under the load of other work, two OpenMP threads
made a small CNN's training step 10-100x slower at times (a 2.3 ms step took 10-300 ms; see
BENCHMARKS.md), which would swamp everything else measured here; Ray sets one thread per trial anyway. Besides wall time, each run reports the sum of the trials' own training time, measured
inside the training function (``train_seconds`` for the Classification evaluator), so
``wall - train`` is what the framework costs around the training.

    .venv/bin/python bench/random_search.py              # 3 interleaved rounds of 64 trials (~1 h here)
    .venv/bin/python bench/random_search.py --systems tridens-classification,tridens-functional,optuna,ray-reuse
    .venv/bin/python bench/random_search.py --quick      # 1 round of 16 trials
    .venv/bin/python bench/random_search.py --one optuna --trials 64   # one measurement (JSON)
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
SYSTEMS = ["tridens-classification", "tridens-classification-noopt", "tridens-functional", "tridens-process",
           "optuna", "ray", "ray-reuse"]


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
    """The plain model Optuna and Ray build from a configuration."""

    def __init__(self, width: int, kernel: int, hidden: int):
        super().__init__()
        _layers(self, width, kernel, hidden)

    def forward(self, x):
        return _forward(self, x)


class CNNSpace(tnn.ModelSpace):
    """The same model as a tridens space (same layers, same forward)."""

    def __init__(self):
        super().__init__()
        _layers(self, td.choice("width", WIDTHS), td.choice("kernel", KERNELS), td.choice("hidden", HIDDEN))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return _forward(self, x)


_DATA: dict[str, Any] = {}


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if "t" not in _DATA:
        train, val = td.datasets.digits()
        _DATA["t"] = (*train.tensors, *val.tensors)
    return _DATA["t"]


TRAIN_SECONDS = [0.0]


def warm_up() -> None:
    """Pay once, before any timing, what the first optimizer of a process costs: torch imports
    ``torch._dynamo`` then (about 1.7 s here). Every measured driver does this; a worker process
    that Ray or the process executor starts for a trial pays it in that trial."""
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


def train_epoch(model: nn.Module, lr: float, seed: int = 0, tensors=None) -> float:
    """One epoch of Adam (batch 32, order from ``seed``), then validation accuracy. The one
    training function every non-declarative system calls."""
    t0 = time.perf_counter()
    x, y, xv, yv = tensors if tensors is not None else data()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for idx in order.split(BATCH_SIZE):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        acc = float((model(xv).argmax(1) == yv).float().mean())
    TRAIN_SECONDS[0] += time.perf_counter() - t0
    return acc


def train_epoch_reported(model: nn.Module, lr: float, seed: int = 0) -> None:
    """``train_epoch`` plus a ``td.report`` of its own duration (the process executor's workers
    run it, so the driver cannot read their clocks)."""
    before = TRAIN_SECONDS[0]
    acc = train_epoch(model, lr, seed)
    td.report({"val_acc": acc, "train_seconds": TRAIN_SECONDS[0] - before})


# -- systems ------------------------------------------------------------------------------------------
def one_tridens(n: int, *, declarative: bool, executor: str = "inline", optimize: bool = True) -> dict[str, Any]:
    train, val = td.datasets.digits()
    data()
    warm_up()
    if declarative:
        evaluator = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=BATCH_SIZE,
                                                 optimizer="adam", lr=td.choice("lr", LRS))
    elif executor == "process":
        evaluator = td.evaluators.FunctionalEvaluator(train_epoch_reported, metric="val_acc", lr=td.choice("lr", LRS))
    else:
        evaluator = td.evaluators.FunctionalEvaluator(train_epoch, lr=td.choice("lr", LRS))
    with tempfile.TemporaryDirectory() as d:
        exp = td.Experiment(CNNSpace(), evaluator, td.strategy.Random(), budget=n,
                            store=os.path.join(d, "rs.db"), name="random-search", options=td.RunOptions(verbose=False),
                            executor=td.executors.Process(workers=2, optimize=optimize) if executor == "process"
                            else td.executors.Inline(optimize=optimize))
        t0 = time.perf_counter()
        exp.run()
        seconds = time.perf_counter() - t0
        trials = [t for t in exp.trials() if t.metric is not None]
        best = max(t.metric for t in trials)
        if declarative:
            train_s = sum(t.info.get("train_seconds", 0.0) for t in trials)
        elif executor == "process":  # the workers' clocks: each reports its training time as a metric
            train_s = sum(t.metrics.get("train_seconds", [0.0])[-1] for t in trials)
        else:
            train_s = TRAIN_SECONDS[0]
    return {"trials": len(trials), "seconds": seconds, "train_seconds": train_s, "best": best}


def one_optuna(n: int) -> dict[str, Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    data()
    warm_up()

    def objective(trial):
        model = CNN(trial.suggest_categorical("width", WIDTHS), trial.suggest_categorical("kernel", KERNELS),
                    trial.suggest_categorical("hidden", HIDDEN))
        return train_epoch(model, trial.suggest_categorical("lr", LRS), seed=trial.number)

    t0 = time.perf_counter()
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(objective, n_trials=n)
    seconds = time.perf_counter() - t0
    return {"trials": len(study.trials), "seconds": seconds, "train_seconds": TRAIN_SECONDS[0],
            "best": study.best_value}


def _ray_trainable(config, tensors=None):
    t0 = time.perf_counter()
    model = CNN(config["width"], config["kernel"], config["hidden"])
    before = TRAIN_SECONDS[0]
    acc = train_epoch(model, config["lr"], seed=config["seed"], tensors=tensors)
    return {"val_acc": acc, "train_seconds": TRAIN_SECONDS[0] - before, "build_seconds": time.perf_counter() - t0}


def one_ray(n: int, *, reuse: bool) -> dict[str, Any]:
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    import ray
    from ray import tune

    warm_up()  # the driver does not train; for symmetry only
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    init_s = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory() as d:
            tuner = tune.Tuner(
                tune.with_parameters(_ray_trainable, tensors=data()),
                param_space={"width": tune.choice(WIDTHS), "kernel": tune.choice(KERNELS),
                             "hidden": tune.choice(HIDDEN), "lr": tune.choice(LRS), "seed": tune.randint(0, 2**31 - 1)},
                tune_config=tune.TuneConfig(num_samples=n, metric="val_acc", mode="max", reuse_actors=reuse),
                run_config=tune.RunConfig(storage_path=d, name="random-search", verbose=0),
            )
            t0 = time.perf_counter()
            results = tuner.fit()
            seconds = time.perf_counter() - t0
            frame = results.get_dataframe()
            train_s = float(frame["train_seconds"].sum())
            best = float(frame["val_acc"].max())
            done = len(frame)
    finally:
        ray.shutdown()
    return {"trials": done, "seconds": seconds, "train_seconds": train_s, "best": best, "init_s": init_s}


def one(name: str, n: int) -> dict[str, Any]:
    if name == "tridens-classification":
        return one_tridens(n, declarative=True)
    if name == "tridens-classification-noopt":
        return one_tridens(n, declarative=True, optimize=False)
    if name == "tridens-functional":
        return one_tridens(n, declarative=False)
    if name == "tridens-process":
        return one_tridens(n, declarative=False, executor="process")
    if name == "optuna":
        return one_optuna(n)
    if name == "ray":
        return one_ray(n, reuse=False)
    if name == "ray-reuse":
        return one_ray(n, reuse=True)
    raise SystemExit(f"unknown system {name!r}; one of {SYSTEMS}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round of 16 trials")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS for every measured process (default 1; 0: torch's default). See the module doc.")
    p.add_argument("--one", help="run one system once in this process and print its JSON")
    p.add_argument("--json", help="write all raw results here")
    args = p.parse_args()
    trials = args.trials or (16 if args.quick else 64)
    rounds = args.rounds or (1 if args.quick else 3)
    if args.one:
        C.emit(one(args.one, trials))
        return

    C.print_machine()
    systems = [s for s in args.systems.split(",") if s]
    script = os.path.abspath(__file__)
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads > 0 else {}
    print(f"measured processes run with {env or 'torch default threads'}")
    res = C.interleave(systems, rounds,
                       lambda name, r: C.run_worker(script, ["--one", name, "--trials", str(trials)], env=env, timeout=3600))
    ref = "tridens-functional" if "tridens-functional" in res else systems[0]
    base = C.median(r["seconds"] for r in res[ref])
    rows = []
    for name in systems:
        runs = res[name]
        wall = C.median(r["seconds"] for r in runs)
        train = C.median(r["train_seconds"] for r in runs)
        over = C.median(r["seconds"] - r["train_seconds"] for r in runs)
        rows.append([name, runs[0]["trials"], wall, min(r["seconds"] for r in runs), max(r["seconds"] for r in runs),
                     train, over / trials * 1e3, wall / base, C.median(r["best"] for r in runs)])
    print(f"\n{trials}-trial random search, 1 epoch each on digits, median of {rounds} interleaved rounds:")
    print(C.table(["system", "trials", "wall s (median)", "min", "max", "sum of train s", "(wall-train)/trial ms",
                   f"x {ref}", "best val_acc"], rows))
    for name in ("ray", "ray-reuse"):
        if name in res:
            print(f"{name}: ray.init(num_cpus=2), not counted above: median {C.median(r['init_s'] for r in res[name]):.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": C.machine(), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
