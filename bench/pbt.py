"""Benchmark: Population Based Training in tridens against Ray Tune's ``PopulationBasedTraining``.

The same search in both: a fixed small CNN (conv 3x3 16 -> ReLU -> conv 3x3 32 -> ReLU ->
max-pool -> linear) on ``td.datasets.digits()`` (1,438 training, 359 validation images), SGD,
batch size 64, a population of ``--population`` members trained for ``--epochs`` epochs; every
``--interval`` epochs the bottom quarter copies a top-quarter member's weights and optimizer
state and perturbs its ``lr`` (log-uniform 1e-3..0.5) and ``momentum`` (uniform 0..0.95):
resampled with probability 0.25, else multiplied by 0.8 or 1.2.

* ``tridens`` -- ``td.strategy.PBT(population, interval, quantile=0.25, resample_probability=0.25)``,
  the declarative ``Classification`` evaluator, every default (in-process, the planner fuses where
  it pays): an exploit is a fork of the running member, in memory.
* ``ray`` -- Tune 2.58, a function trainable with a plain PyTorch loop over the same tensors (one
  torch thread), ``PopulationBasedTraining(time_attr="training_iteration", perturbation_interval,
  quantile_fraction=0.25, resample_probability=0.25)``, a checkpoint (model and optimizer,
  ``torch.save``) reported every ``interval`` epochs, ``reuse_actors=True`` (what Tune advises for
  PBT: without it every exploit starts a new worker process), ``ray.init(num_cpus=<cores>)``.

Each run is its own process (``OMP_NUM_THREADS=1``), rounds interleaved (tridens, ray, ray,
tridens, ...). Measured from the start of the search (after imports, data loading and
``ray.init``) to its end: wall time and CPU-seconds -- tridens: ``time.process_time()`` of its one
process; Ray: the whole process tree (driver, raylet, GCS, agents, workers) by :class:`_common.ProcessTreeClock`
(psutil every 0.1 s, each process counted with what it had spent when last seen, so workers that
exit before the end still count) -- and the best final validation accuracy of the population.

    .venv/bin/python bench/pbt.py --quick                     # develop: 1 round, small budget
    /work/bin/quiet .venv/bin/python bench/pbt.py             # the figure: 3 rounds
    .venv/bin/python bench/pbt.py --one ray --seed 0          # one measurement (JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tridens as td  # noqa: E402
from _models import SmallCNN  # noqa: E402
from _common import ProcessTreeClock  # noqa: E402

LR, MOMENTUM = (1e-3, 0.5), (0.0, 0.95)
BATCH = 64


def run_tridens(population: int, epochs: int, interval: int, seed: int) -> dict[str, Any]:
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=epochs, batch_size=BATCH, optimizer="sgd",
                                             lr=td.loguniform("lr", *LR), momentum=td.uniform("momentum", *MOMENTUM))
    strategy = td.strategy.PBT(population=population, interval=interval, quantile=0.25, resample_probability=0.25)
    with tempfile.TemporaryDirectory() as d:
        exp = td.Experiment(SmallCNN(), evaluator, strategy, budget=population,
                            options=td.RunOptions(seed=seed, verbose=False), store=os.path.join(d, "pbt.db"),
                            name="pbt")
        cpu0, t0 = time.process_time(), time.perf_counter()
        exp.run()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        trials = exp.trials()
    return {"system": "tridens", "wall": wall, "cpu": cpu, "best": max(t.metric for t in trials),
            "exploits": sum(len(t.info.get("exploits", [])) for t in trials)}


def _ray_trainable(config: dict[str, Any], tensors: Any = None, epochs: int = 1, interval: int = 1) -> None:
    from ray import tune

    torch.set_num_threads(1)
    x, y, xv, yv = tensors
    torch.manual_seed(config["seed"])
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    start = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["epoch"])
    for group in opt.param_groups:  # the (perturbed) config's hyperparameters from here on
        group["lr"], group["momentum"] = config["lr"], config["momentum"]
    for epoch in range(start, epochs):
        model.train()
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(config["seed"] * 1000 + epoch))
        for idx in order.split(BATCH):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc = float((model(xv).argmax(1) == yv).float().mean())
        metrics = {"val_acc": acc, "epoch": epoch + 1}
        if (epoch + 1) % interval == 0 or epoch + 1 == epochs:
            with tempfile.TemporaryDirectory() as d:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch + 1},
                           os.path.join(d, "state.pt"))
                tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))
        else:
            tune.report(metrics)


def run_ray(population: int, epochs: int, interval: int, seed: int) -> dict[str, Any]:
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    import ray
    from ray import tune

    train, val = td.datasets.digits()
    tensors = (*train.tensors, *val.tensors)
    import _models

    ray.cloudpickle.register_pickle_by_value(_models)  # the trainable's SmallCNN travels with it: workers lack bench/
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    scheduler = tune.schedulers.PopulationBasedTraining(
        time_attr="training_iteration", perturbation_interval=interval, quantile_fraction=0.25,
        resample_probability=0.25, perturbation_factors=(1.2, 0.8),
        hyperparam_mutations={"lr": tune.loguniform(*LR), "momentum": tune.uniform(*MOMENTUM)})
    random.seed(seed)  # what the scheduler's explore and Tune's sampling draw from
    np.random.seed(seed)
    clock = ProcessTreeClock()
    try:
        with tempfile.TemporaryDirectory() as d:
            tuner = tune.Tuner(
                tune.with_parameters(_ray_trainable, tensors=tensors, epochs=epochs, interval=interval),
                param_space={"lr": tune.loguniform(*LR), "momentum": tune.uniform(*MOMENTUM),
                             "seed": tune.randint(0, 2**20)},
                tune_config=tune.TuneConfig(num_samples=population, metric="val_acc", mode="max", scheduler=scheduler,
                                            reuse_actors=True),
                run_config=tune.RunConfig(storage_path=d, name="pbt", verbose=0),
            )
            clock.start()
            t0 = time.perf_counter()
            results = tuner.fit()
            wall = time.perf_counter() - t0
            clock.stop()
            cpu = clock.elapsed_cpu()
            best = max(r.metrics["val_acc"] for r in results if r.metrics and "val_acc" in r.metrics)
    finally:
        ray.shutdown()
    return {"system": "ray", "wall": wall, "cpu": cpu, "best": best}


def one(system: str, population: int, epochs: int, interval: int, seed: int) -> dict[str, Any]:
    run = run_tridens if system == "tridens" else run_ray
    return run(population, epochs, interval, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--interval", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 round, population 4, 4 epochs")
    parser.add_argument("--one", choices=["tridens", "ray"], help="one measurement in this process (JSON)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.population, args.epochs = 1, 4, 4
    sizes = ["--population", str(args.population), "--epochs", str(args.epochs), "--interval", str(args.interval)]
    if args.one:
        print(json.dumps(one(args.one, args.population, args.epochs, args.interval, args.seed)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    results: dict[str, list[dict[str, Any]]] = {"tridens": [], "ray": []}
    for r in range(args.rounds):
        for system in (["tridens", "ray"] if r % 2 == 0 else ["ray", "tridens"]):
            out = subprocess.run([sys.executable, __file__, "--one", system, "--seed", str(r), *sizes], env=env,
                                 capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[system].append(result)
            print(f"round {r} {system:8s} cpu {result['cpu']:7.1f} s  wall {result['wall']:6.1f} s  "
                  f"best val_acc {result['best']:.4f}", flush=True)
    med = {s: {k: statistics.median(x[k] for x in rs) for k in ("cpu", "wall", "best")} for s, rs in results.items()}
    print(f"\npopulation {args.population}, {args.epochs} epochs, interval {args.interval}, "
          f"{args.rounds} round(s), medians:")
    for s, m in med.items():
        print(f"  {s:8s} CPU-seconds {m['cpu']:7.1f}  wall {m['wall']:6.1f} s  best val_acc {m['best']:.4f}")
    print(f"  Ray Tune / tridens CPU-seconds: {med['ray']['cpu'] / med['tridens']['cpu']:.2f}x, "
          f"wall: {med['ray']['wall'] / med['tridens']['wall']:.2f}x")


if __name__ == "__main__":
    main()
