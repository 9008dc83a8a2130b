"""Benchmark: the engine's bookkeeping per trial, against Optuna and Ray Tune.

Each system runs N trivial trials over the same kind of space: four categorical labels of 16
values each (65,536 samples, so random samples never repeat), an objective that returns 0.5 at once.

* ``tridens``          -- ``td.Experiment`` over a ``tnn.ModelSpace`` (an MLP whose four widths are
                          the labels), ``FunctionalEvaluator(lambda model, **hp: 0.5)``,
                          ``td.strategy.Random()``, a real SQLite store in a temporary directory.
                          Per trial the engine builds the model under the trial's seed (once),
                          traces it (torch.fx), fingerprints it, dedups, runs the function, saves
                          its weights and writes the trial to the store (FLOPs only when a
                          constraint or objective reads them; a sample seen before would skip
                          the build and trace, but random samples here never repeat).
* ``tridens-nomodel``  -- the same with an evaluator that declares ``needs_model = False`` (like
                          ``Tabular``): no model is built, so this is the store + strategy + dedup
                          cost alone, the part comparable to what Optuna does.
* ``optuna-memory``    -- ``study.optimize`` with ``RandomSampler``, in-memory storage.
* ``optuna-sqlite``    -- the same with ``sqlite:///`` storage in a temporary directory.
* ``tridens-omp1``     -- ``tridens`` in a process started with ``OMP_NUM_THREADS=1``.
* ``tridens-before``   -- ``tridens`` importing the package from ``--before-src DIR`` (e.g. a
                          ``git archive`` snapshot of an older commit), to measure a change.
* ``ray``              -- Ray Tune: ``ray.init(num_cpus=2)`` (timed apart), ``tune.Tuner`` with a
                          function trainable returning ``{"score": 0.5}``, ``num_samples=N``,
                          ``reuse_actors=True`` (its best setting for short trials).
* ``ray-default``      -- the same with Tune's default (one new actor process per trial): about
                          2.5 s per trial here, so it runs ``--ray-default-trials`` (25) per round.

Every (system, round) is a fresh process; rounds are interleaved and the table shows medians of
wall time and of the driver process's CPU time (``time.process_time``: all its threads; Ray's
worker processes are not in it).
Then ``--memory`` runs 5,000 tridens trials in one process and reports RSS before, during, after.

    .venv/bin/python bench/bookkeeping.py                  # 5 rounds, 500 trials (ray-default: 25), memory run
    .venv/bin/python bench/bookkeeping.py --quick          # 2 rounds, 100 trials (ray-default: 10), no memory run
    .venv/bin/python bench/bookkeeping.py --breakdown      # where tridens' time per trial goes
    .venv/bin/python bench/bookkeeping.py --one tridens --trials 500   # one measurement (JSON)
    .venv/bin/python bench/bookkeeping.py --before-src /tmp/old/src   # adds tridens-before
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

WIDTHS = list(range(4, 68, 4))   # 16 values
LABELS = [f"w{i}" for i in range(4)]
TARGET_MS = 5.0
TARGET_MB = 50.0
SYSTEMS = ["tridens", "tridens-omp1", "tridens-nomodel", "optuna-memory", "optuna-sqlite", "ray", "ray-default"]
# tridens-omp1: the same run with OMP_NUM_THREADS=1 (see BENCHMARKS.md: on a loaded 2-core machine the
# tiny forward pass of shape propagation stalls on OpenMP's barrier when the second thread is descheduled).
WORKER_ENV = {"tridens-omp1": {"OMP_NUM_THREADS": "1"}}


# The spaces live at module level so the store can name them by import path (as users are told to).
import torch  # noqa: E402
from torch import nn  # noqa: E402

import tridens as td  # noqa: E402
from tridens import nn as tnn  # noqa: E402
from tridens.evaluators import FunctionalEvaluator  # noqa: E402


class TinyMLP(tnn.ModelSpace):
    """Four width labels, 16 values each."""

    def __init__(self):
        super().__init__()
        a, b, c, d = (td.choice(label, WIDTHS) for label in LABELS)
        self.body = nn.Sequential(nn.Linear(4, a), nn.ReLU(), nn.Linear(a, b), nn.ReLU(),
                                  nn.Linear(b, c), nn.ReLU(), nn.Linear(c, d), nn.ReLU(), nn.Linear(d, 1))
        self.example_inputs = (torch.zeros(2, 4),)

    def forward(self, x):
        return self.body(x)


class Empty(tnn.ModelSpace):
    """No labels (they are the evaluator's in the no-model variant)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(1, 1)
        self.example_inputs = (torch.zeros(1, 1),)

    def forward(self, x):
        return self.fc(x)


class NoModelEvaluator(FunctionalEvaluator):
    """A FunctionalEvaluator that tells the engine not to build the model (like Tabular)."""

    needs_model = False


# -- tridens ----------------------------------------------------------------------------------------
def _tridens_space():
    return TinyMLP()


def _trivial(model, **hp):
    return 0.5


def _tridens_experiment(n: int, store: str, *, model: bool, fn=_trivial):
    if model:
        space = _tridens_space()
        evaluator = FunctionalEvaluator(fn)
    else:
        # The labels live on the evaluator; the space holds none, and no model is ever built.
        space = Empty()
        evaluator = NoModelEvaluator(fn, **{label: td.choice(label, WIDTHS) for label in LABELS})
    return td.Experiment(space, evaluator, td.strategy.Random(), budget=n, store=store, name="bookkeeping",
                         options=td.RunOptions(verbose=False))


def one_tridens(n: int, *, model: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        exp = _tridens_experiment(n, os.path.join(d, "bench.db"), model=model)
        t0, c0 = time.perf_counter(), time.process_time()
        exp.run()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        statuses = Counter(t.status.name for t in exp.trials())
    return {"trials": n, "seconds": seconds, "ms_per_trial": seconds / n * 1e3, "cpu_ms_per_trial": cpu / n * 1e3,
            "statuses": dict(statuses), "source": C.source()}


# -- optuna -----------------------------------------------------------------------------------------
def one_optuna(n: int, *, sqlite: bool) -> dict[str, Any]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def objective(trial):
        for label in LABELS:
            trial.suggest_categorical(label, WIDTHS)
        return 0.5

    with tempfile.TemporaryDirectory() as d:
        storage = f"sqlite:///{os.path.join(d, 'optuna.db')}" if sqlite else None
        t0, c0 = time.perf_counter(), time.process_time()
        study = optuna.create_study(direction="maximize", storage=storage, study_name="bookkeeping",
                                    sampler=optuna.samplers.RandomSampler(seed=0))
        study.optimize(objective, n_trials=n)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        done = len(study.trials)
    return {"trials": done, "seconds": seconds, "ms_per_trial": seconds / n * 1e3, "cpu_ms_per_trial": cpu / n * 1e3}


# -- ray tune ---------------------------------------------------------------------------------------
def _ray_trainable(config):
    return {"score": 0.5}


def one_ray(n: int, *, reuse: bool) -> dict[str, Any]:
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray
    from ray import tune

    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    init_s = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory() as d:
            tuner = tune.Tuner(
                _ray_trainable,
                param_space={label: tune.choice(WIDTHS) for label in LABELS},
                tune_config=tune.TuneConfig(num_samples=n, metric="score", mode="max", reuse_actors=reuse),
                run_config=tune.RunConfig(storage_path=d, name="bookkeeping", verbose=0),
            )
            t0, c0 = time.perf_counter(), time.process_time()
            results = tuner.fit()
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            done = len(results)
    finally:
        ray.shutdown()
    return {"trials": done, "seconds": seconds, "ms_per_trial": seconds / n * 1e3, "cpu_ms_per_trial": cpu / n * 1e3,
            "init_s": init_s}


# -- memory -----------------------------------------------------------------------------------------
def memory(n: int, every: int, warmup: int = 20) -> dict[str, Any]:
    """RSS of the driver over ``n`` trivial tridens trials (model space, SQLite store), after a
    ``warmup``-trial experiment in another store has paid the one-time costs (lazy imports: the
    first shape propagation on the meta device imports sympy and torch's decompositions)."""
    samples: list[tuple[int, float]] = []
    count = [0]

    def fn(model, **hp):
        count[0] += 1
        if count[0] % every == 0:
            samples.append((count[0], C.rss_mb()))
        return 0.5

    with tempfile.TemporaryDirectory() as d:
        gc.collect()
        start = C.rss_mb()
        _tridens_experiment(warmup, os.path.join(d, "warmup.db"), model=True).run()
        gc.collect()
        before = C.rss_mb()
        exp = _tridens_experiment(n, os.path.join(d, "bench.db"), model=True, fn=fn)
        t0 = time.perf_counter()
        exp.run()
        seconds = time.perf_counter() - t0
        after = C.rss_mb()
        gc.collect()
        after_gc = C.rss_mb()
        db_mb = os.path.getsize(os.path.join(d, "bench.db")) / 2**20
    return {"trials": n, "seconds": seconds, "rss_start_mb": start, "warmup_trials": warmup,
            "rss_before_mb": before, "rss_after_mb": after, "rss_after_gc_mb": after_gc,
            "growth_mb": after_gc - before, "growth_incl_warmup_mb": after_gc - start,
            "curve": samples, "db_mb": db_mb}


# -- breakdown --------------------------------------------------------------------------------------
def breakdown(n: int) -> dict[str, Any]:
    """Wall time per trial by phase, measured by wrapping the engine's own methods."""
    import tridens.engine._experiment as E
    import tridens.graph as G
    from tridens.evaluators import FunctionalEvaluator
    from tridens.store import Store
    from tridens.strategy import Random

    spent: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()

    def wrap(owner, attr, name):
        if not hasattr(owner, attr):  # an older engine (--before-src) may lack it
            return
        original = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
                cpu[name] += time.process_time() - c0
                calls[name] += 1
        setattr(owner, attr, timed)

    space = _tridens_space()
    cls = type(space)
    # nested phases are reported inside their parent, so the top level sums to the total
    wrap(E._Run, "_instantiate", "instantiate (seeded freeze + trace + fingerprint)")
    wrap(E._Run, "_materialize", "materialize (a second, seeded freeze if the first was on meta)")
    wrap(E._Run, "_seed", "  engine's torch seeding")
    wrap(cls, "freeze", "  freeze (every call, under either phase above)")
    wrap(G, "trace", "  trace (torch.fx)")
    wrap(G.Graph, "fingerprint", "  fingerprint")
    wrap(G.Graph, "flops", "  flops (incl. shape propagation), when computed")
    wrap(FunctionalEvaluator, "evaluate", "evaluate (the user function, seeded)")
    wrap(Store, "add_trial", "store.add_trial")
    wrap(Store, "update_trial", "store.update_trial")
    wrap(Store, "add_metrics", "store.add_metrics")
    wrap(Store, "save_checkpoint", "store.save_checkpoint")
    wrap(Store, "finish_trial", "store.finish_trial (checkpoint file + one transaction)")
    wrap(Store, "_write_checkpoint_file", "  checkpoint file (torch.save, os.replace)")
    wrap(Random, "ask", "strategy.ask")
    wrap(Random, "tell", "strategy.tell")
    wrap(Random, "report", "strategy.report")
    import importlib
    try:   # where the in-process executor lives (tridens.engine in an older tree, --before-src)
        X = importlib.import_module("tridens.executors._execution")
    except ImportError:
        X = importlib.import_module("tridens.engine._execution")
    for attr in ("weights", "_weights"):   # (its name in older trees)
        wrap(X, attr, "state_dict copy for the checkpoint")
    with tempfile.TemporaryDirectory() as d:
        exp = E.Experiment(space, FunctionalEvaluator(_trivial), Random(), budget=n,
                           store=os.path.join(d, "bench.db"), name="bookkeeping",
                           options=td.RunOptions(verbose=False))
        t0, c0 = time.perf_counter(), time.process_time()
        exp.run()
        total, total_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"trials": n, "total_ms_per_trial": total / n * 1e3, "total_cpu_ms_per_trial": total_cpu / n * 1e3,
            "phases": {k: v / n * 1e3 for k, v in spent.items()},
            "cpu_phases": {k: v / n * 1e3 for k, v in cpu.items()}, "calls": dict(calls)}


# -- driver -----------------------------------------------------------------------------------------
def one(name: str, n: int) -> dict[str, Any]:
    if name in ("tridens", "tridens-omp1", "tridens-before"):
        return one_tridens(n, model=True)
    if name == "tridens-nomodel":
        return one_tridens(n, model=False)
    if name == "optuna-memory":
        return one_optuna(n, sqlite=False)
    if name == "optuna-sqlite":
        return one_optuna(n, sqlite=True)
    if name == "ray":
        return one_ray(n, reuse=True)
    if name == "ray-default":
        return one_ray(n, reuse=False)
    raise SystemExit(f"unknown system {name!r}; one of {SYSTEMS}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 rounds of 100 trials (ray-default 10), no memory run")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--trials", type=int, default=None)
    p.add_argument("--ray-trials", type=int, default=None,
                   help="trials per Ray Tune run with reuse_actors=True (default: --trials)")
    p.add_argument("--ray-default-trials", type=int, default=None,
                   help="trials per Ray Tune run with Tune's defaults, one actor per trial (default 25; 10 with --quick)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--memory-trials", type=int, default=5000)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--memory", action="store_true", help="only the memory run")
    p.add_argument("--breakdown", action="store_true", help="only the per-phase breakdown of tridens")
    p.add_argument("--one", help="run one system once in this process and print its JSON")
    p.add_argument("--json", help="write all raw results here")
    p.add_argument("--before-src", help="also run tridens-before: tridens imported from this src folder")
    args = p.parse_args()
    trials = args.trials or (100 if args.quick else 500)
    ray_trials = args.ray_trials or trials
    ray_default_trials = args.ray_default_trials or (10 if args.quick else 25)
    rounds = args.rounds or (2 if args.quick else 5)

    if args.one:
        C.emit(one(args.one, trials))
        return
    if args.memory and os.environ.get("_BENCH_WORKER"):
        C.emit(memory(args.memory_trials, max(1, args.memory_trials // 10)))
        return
    if args.breakdown and os.environ.get("_BENCH_WORKER"):
        C.emit(breakdown(trials))
        return

    C.print_machine()
    raw: dict[str, Any] = {"machine": C.machine()}
    script = os.path.abspath(__file__)
    worker_env = {"_BENCH_WORKER": "1"}
    if args.breakdown:
        res = [C.run_worker(script, ["--breakdown", "--trials", str(trials)], env=worker_env) for _ in range(rounds)]
        raw["breakdown"] = res
        phases = sorted({k for r in res for k in r["phases"]}, key=lambda k: -C.median(r["cpu_phases"].get(k, 0) for r in res))
        print(f"\ntridens, {trials} trivial trials, time per trial by phase (median of {rounds} runs, ms; "
              "nested phases are indented):")
        rows = [[k, C.median(r["phases"].get(k, 0.0) for r in res), C.median(r["cpu_phases"].get(k, 0.0) for r in res),
                 C.median(r["calls"].get(k, 0) for r in res) / trials] for k in phases]
        rows.append(["total (exp.run)", C.median(r["total_ms_per_trial"] for r in res),
                     C.median(r["total_cpu_ms_per_trial"] for r in res), 1.0])
        print(C.table(["phase", "wall ms/trial", "CPU ms/trial", "calls/trial"], rows))
    else:
        systems = [s for s in args.systems.split(",") if s]
        if args.before_src:
            WORKER_ENV["tridens-before"] = {"PYTHONPATH": os.path.abspath(args.before_src),
                                            "BENCH_SOURCE_LABEL": os.path.abspath(args.before_src)}
            if "tridens-before" not in systems:
                systems.insert(1, "tridens-before")
        if not args.memory:
            def run_one(name: str, r: int) -> dict[str, Any]:
                n = {"ray": ray_trials, "ray-default": ray_default_trials}.get(name, trials)
                return C.run_worker(script, ["--one", name, "--trials", str(n)], env=WORKER_ENV.get(name), timeout=3600)

            res = C.interleave(systems, rounds, run_one)
            raw["per_trial"] = res
            base = C.median(r["ms_per_trial"] for r in res.get("tridens", [])) if "tridens" in res else float("nan")
            base_cpu = C.median(r["cpu_ms_per_trial"] for r in res.get("tridens", [])) if "tridens" in res else float("nan")
            rows = []
            for name in systems:
                ms = [r["ms_per_trial"] for r in res[name]]
                cpu_ms = [r["cpu_ms_per_trial"] for r in res[name]]
                paired = [a["ms_per_trial"] / b["ms_per_trial"] for a, b in zip(res[name], res.get("tridens", []))]
                rows.append([name, res[name][0]["trials"], C.median(ms), min(ms), max(ms), C.median(paired),
                             C.median(cpu_ms), C.median(cpu_ms) / base_cpu])
            print(f"\nbookkeeping per trivial trial, median of {rounds} interleaved rounds:")
            print(C.table(["system", "trials/run", "wall ms/trial", "min", "max", "paired x tridens",
                           "driver CPU ms/trial", "CPU x tridens"], rows))
            for name in systems:
                if "source" in res[name][0]:
                    print(f"{name}: tridens from {res[name][0]['source']}")
            for name in ("ray", "ray-default"):
                if name in res:
                    print(f"{name}: ray.init(num_cpus=2), not counted above: median {C.median(r['init_s'] for r in res[name]):.2f} s")
            if "tridens" in res:
                verdict = "meets" if base <= TARGET_MS else "MISSES"
                print(f"tridens: {base:.2f} ms/trial wall ({base_cpu:.2f} ms CPU) -> {verdict} the {TARGET_MS} ms target")
        if (args.memory or not (args.quick or args.no_memory)) and "tridens" in systems:
            m = C.run_worker(script, ["--memory", "--memory-trials", str(args.memory_trials)], env=worker_env)
            raw["memory"] = m
            print(f"\ndriver RSS over {m['trials']} trivial tridens trials ({m['seconds']:.1f} s, "
                  f"store {m['db_mb']:.1f} MB on disk):")
            print(C.table(["point", "RSS MB"], [["start (tridens, torch imported)", m["rss_start_mb"]],
                                                [f"after a {m['warmup_trials']}-trial warm-up experiment", m["rss_before_mb"]]]
                          + [[f"after trial {k}", v] for k, v in m["curve"]]
                          + [["after run()", m["rss_after_mb"]], ["after gc.collect()", m["rss_after_gc_mb"]]]))
            verdict = "meets" if m["growth_mb"] <= TARGET_MB else "MISSES"
            print(f"growth over the {m['trials']} trials {m['growth_mb']:.1f} MB -> {verdict} the {TARGET_MB} MB target "
                  f"({m['growth_incl_warmup_mb']:.1f} MB counting the warm-up's one-time imports)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
