"""Benchmark: multi-fidelity strategies on recorded learning curves, compared by simulated time.

Part 1 -- the recorded tables (``bench/record_curves.py``: every configuration of a real space
trained by tridens for the full budget, per-epoch validation accuracy and CPU-seconds, several
seeds). Each strategy searches the table through ``td.evaluators.Tabular(CurveTable, clock=
SimulatedClock())``: every epoch a strategy trains is one query, replaying the epoch of one recorded
run (the trial's seed picks the run) and charging the CPU-seconds recorded for it. A search runs
until its simulated budget is spent (the group in progress finishes). Strategies: Random, TPE
(both train every trial to the full budget), Hyperband, ASHA, BOHB, SS, AsyncSS, BOSS (tridens,
default parameters, ``max_steps`` = the table's epochs), and Optuna's own ``TPESampler`` +
``HyperbandPruner`` run trial by trial through the same evaluator and clock (Optuna may suggest
a configuration twice; it is then trained, and charged, again).

The driver is the engine's lockstep loop in miniature (ask a group; train its trials epoch by
epoch, reporting every trial's value before asking any decision; stop on ``Decision.STOP``; tell
every finished trial), with no store or model building: tens of thousands of simulated runs.

Reported over ``--seeds`` searches (seeds 0..N-1, strategies interleaved per seed; a seed gives
every strategy the same random stream, so the random first bracket of Hyperband, BOHB, SS and BOSS
holds the same configurations and their comparison is paired):

* ``incumbent``: the configuration with the best validation accuracy seen so far (any epoch, one
  recorded run); its value is that configuration's **final-epoch accuracy averaged over the
  table's recorded seeds** (what the search would hand over), mean +- std at fractions of the
  budget;
* ``time to within 0.5`` (and 0.25): simulated CPU-seconds until the incumbent's value is within
  0.5 (0.25) points of the table's best (the best configuration by the same averaged final
  accuracy), also in full trainings of an average configuration, so tables of different cost
  compare. The median over all searches with a bootstrap 95% interval (a search that is not
  there by the end of the budget counts as longer than the budget; so does one that gets there
  only in the group that overran it), and how many got there. This time is bimodal -- a random
  first bracket of 27 holds one of the few near-best configurations in a good share of the seeds
  -- so the median of 20 searches moves by a factor of two from one set of seeds to the next;
  hence 100 seeds by default and the intervals;
* paired, for BOSS vs BOHB, SS vs Hyperband and AsyncSS vs ASHA: the ratio of the median times
  with a bootstrap interval (seeds resampled together), how often the first gets there earlier
  (ties, both never included, count half), and the mean difference of the incumbents at the end
  of the budget +- its standard error;
* the run's own cost (CPU-seconds of this process per search), beside it.

A table still being recorded (``"complete": false``) is refused unless ``--partial``, a dry run
on the largest complete sub-grid of what it holds (printed; its figures are not the table's).

Part 2 -- NAS-Bench-201 (``--nb201``; final values only, so one query = one architecture):
BOSS's proposals (its TPE surrogate with a random fraction, brackets of one trial since
``max_steps = 1``) against TPE and regularized evolution at 100 and 300 queries, best validation
accuracy seen, mean +- std over the seeds.

    /work/bin/cpuslot .venv/bin/python bench/multifidelity.py --seeds 3 --budget 0.2     # a quick look
    /work/bin/quiet .venv/bin/python bench/multifidelity.py                             # 100 seeds
    /work/bin/quiet .venv/bin/python bench/multifidelity.py --tables mnist5k-cnn
    /work/bin/cpuslot .venv/bin/python bench/multifidelity.py --tables mnist5k-cnn --partial --seeds 3
    /work/bin/quiet .venv/bin/python bench/multifidelity.py --nb201 --seeds 20
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from typing import Any, Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

import tridens as td  # noqa: E402
from tridens.evaluators import CurveTable, SimulatedClock, Tabular  # noqa: E402
from tridens.trial import Decision, Objective, Trial, TrialStatus  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TABLES = {"digits-mlp": os.path.join(HERE, "data", "digits-mlp.json.gz"),
          "mnist5k-cnn": os.path.join(HERE, "data", "mnist5k-cnn.json.gz")}
OBJECTIVE = Objective("val_acc", "max")
FRACTIONS = (0.05, 0.1, 0.25, 0.5, 1.0)
GAPS = (0.005, 0.0025)


def strategies(epochs: int) -> dict[str, Callable[[], Any]]:
    s = td.strategy
    return {
        "Random": lambda: s.Random(),
        "TPE": lambda: s.TPE(),
        "Hyperband": lambda: s.Hyperband(max_steps=epochs),
        "ASHA": lambda: s.ASHA(max_steps=epochs),
        "BOHB": lambda: s.BOHB(max_steps=epochs),
        "SS": lambda: s.SS(max_steps=epochs),
        "AsyncSS": lambda: s.AsyncSS(max_steps=epochs),
        "BOSS": lambda: s.BOSS(max_steps=epochs),
        "Optuna TPE+HB": None,  # run by optuna_search
    }


class Trace:
    """(simulated seconds, incumbent's averaged final accuracy) after every query that changed it."""

    def __init__(self, table: CurveTable, clock: SimulatedClock):
        self.table, self.clock = table, clock
        self.best_seen = -math.inf
        self.points: list[tuple[float, float]] = []
        self.trials = 0

    def saw(self, sample: dict[str, Any], value: float) -> None:
        if value > self.best_seen:
            self.best_seen = value
            self.points.append((self.clock.seconds, self.table.final_mean(sample)))

    def at(self, seconds: float) -> float:
        value = math.nan
        for t, v in self.points:
            if t > seconds:
                break
            value = v
        return value

    def reached(self, target: float, budget: float) -> float:
        """When the incumbent first came within ``target``; ``inf`` if not within ``budget``."""
        t = next((t for t, v in self.points if v >= target), math.inf)
        return t if t <= budget else math.inf


def search(make: Callable[[], Any], table: CurveTable, seed: int, budget: float) -> Trace:
    """One search through the strategy protocol, lockstep per group, until ``budget`` seconds."""
    clock = SimulatedClock()
    evaluator = Tabular(table, metric="val_acc", clock=clock)
    trace = Trace(table, clock)
    strategy = make()
    rng = random.Random(seed)
    strategy.start(table.search_space(), OBJECTIVE, random.Random(seed))
    next_id = 0
    group_index = 0
    while clock.seconds < budget:
        group = strategy.ask(None)
        if group is None:
            break
        trials, trainers = [], {}
        for sample in group.samples:
            trial = Trial(next_id, dict(sample), seed=rng.getrandbits(31), status=TrialStatus.RUNNING,
                          group=group_index, max_steps=group.max_steps)
            next_id += 1
            trials.append(trial)
            trainers[trial.id] = evaluator.trainer(None, trial.sample, trial.seed)
        group_index += 1
        running = list(trials)
        step = 0
        while running:
            alive = []
            for trial in running:
                trainer = trainers[trial.id]
                trainer.train_epoch()
                value = trainer.validate()["val_acc"]
                trial.metrics.setdefault("val_acc", []).append(value)
                trial.metric = value
                strategy.report(trial, step, value)
                trace.saw(trial.sample, value)
                alive.append(trial)
            running = []
            for trial in alive:
                limit = trainers[trial.id].epochs if trial.max_steps is None else min(trial.max_steps,
                                                                                      trainers[trial.id].epochs)
                if step + 1 >= limit:
                    trial.status = TrialStatus.COMPLETED
                    strategy.tell(trial)
                elif strategy.decide(trial, step) is Decision.STOP:
                    trial.status = TrialStatus.STOPPED
                    strategy.tell(trial)
                else:
                    running.append(trial)
            step += 1
        trace.trials += len(trials)
    return trace


def optuna_search(table: CurveTable, seed: int, budget: float) -> Trace:
    """Optuna's TPESampler + HyperbandPruner, Optuna's own loop, the same evaluator and clock."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    clock = SimulatedClock()
    evaluator = Tabular(table, metric="val_acc", clock=clock)
    trace = Trace(table, clock)
    space = table.search_space()
    choices = {label: spec.domain.values() for label, spec in space.items()}
    rng = random.Random(seed)

    def objective(trial: "optuna.Trial") -> float:
        sample = {label: trial.suggest_categorical(label, values) for label, values in choices.items()}
        trainer = evaluator.trainer(None, sample, rng.getrandbits(31))
        value = math.nan
        for step in range(trainer.epochs):
            trainer.train_epoch()
            value = trainer.validate()["val_acc"]
            trace.saw(sample, value)
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned()
        return value

    def stop(study: "optuna.Study", _: Any) -> None:
        if clock.seconds >= budget:
            study.stop()

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed),
                                pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=table.epochs,
                                                                      reduction_factor=3))
    study.optimize(objective, n_trials=100_000, callbacks=[stop])
    trace.trials = len(study.trials)
    return trace


def complete_subgrid(table: CurveTable, limit: int = 200_000) -> CurveTable:
    """The largest complete grid inside a partly recorded table (a dry run's space: a strategy may
    propose any combination of the values left). Every choice of a non-empty subset of values per
    label is tried, largest first, when there are at most ``limit`` such choices; otherwise values
    are dropped one at a time, each time the one that loses the fewest recorded configurations."""
    keys = set(table.curves)
    values = [sorted({k[i] for k in keys}, key=lambda v: (str(type(v)), v)) for i in range(len(table.labels))]
    missing = [k for k in itertools.product(*values) if k not in keys]

    def complete(vals: Sequence[Sequence[Any]]) -> bool:
        sets = [set(v) for v in vals]
        return not any(all(x in s for x, s in zip(k, sets)) for k in missing)

    def subsets(vs: list[Any]) -> list[tuple[Any, ...]]:
        return [c for r in range(1, len(vs) + 1) for c in itertools.combinations(vs, r)]

    if math.prod(2 ** len(v) - 1 for v in values) <= limit:
        grids = sorted(itertools.product(*(subsets(v) for v in values)),
                       key=lambda g: -math.prod(len(v) for v in g))
        values = [list(v) for v in next(g for g in grids if complete(g))]
    else:
        def inside(vals: list[list[Any]]) -> int:
            sets = [set(v) for v in vals]
            return sum(all(x in s for x, s in zip(k, sets)) for k in keys)

        while not complete(values):
            options = [[v if j != i else [x for x in v if x != drop] for j, v in enumerate(values)]
                       for i, vs in enumerate(values) if len(vs) > 1 for drop in vs]
            values = max(options, key=lambda vals: (inside(vals), math.prod(len(v) for v in vals)))
    sets = [set(v) for v in values]
    rows = {k: table.curves[k] for k in keys if all(x in s for x, s in zip(k, sets))}
    return CurveTable(table.labels, rows, {**table.info, "subgrid": dict(zip(table.labels, values))})


def load_table(name: str, partial: bool) -> CurveTable:
    """The recorded table ``name``; one still being recorded only with ``partial`` (its largest
    complete sub-grid)."""
    table = CurveTable.load(TABLES[name])
    complete = table.info.get("cost", {}).get("complete", table.info.get("complete", True))
    if complete:
        return table
    if not partial:
        raise SystemExit(f"{TABLES[name]} is still being recorded (\"complete\": false, {len(table)} configurations "
                         f"so far); pass --partial for a dry run on what it holds")
    sub = complete_subgrid(table)
    print(f"DRY RUN on a partly recorded table: {len(sub)} of its {len(table)} configurations form a complete "
          f"grid, {sub.info['subgrid']}; these figures are not the table's", flush=True)
    return sub


def _median_ci(values: list[float], rng: random.Random, rounds: int = 2000) -> tuple[float, float, float]:
    """Median of ``values`` (``inf`` allowed) and a bootstrap 95% interval."""
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return statistics.median(values), medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def _paired_ratio(a: list[float], b: list[float], rng: random.Random,
                  rounds: int = 2000) -> tuple[float, float, float]:
    """median(a) / median(b) and a bootstrap 95% interval, seeds resampled together."""
    def ratio(idx: list[int]) -> float:
        ma, mb = statistics.median(a[i] for i in idx), statistics.median(b[i] for i in idx)
        if math.isinf(ma) and math.isinf(mb):
            return math.nan
        return ma / mb if mb > 0 else math.inf

    n = len(a)
    draws = sorted((r for r in (ratio(rng.choices(range(n), k=n)) for _ in range(rounds)) if not math.isnan(r)))
    if not draws:
        return ratio(list(range(n))), math.nan, math.nan
    return ratio(list(range(n))), draws[int(0.025 * len(draws))], draws[max(int(0.975 * len(draws)) - 1, 0)]


def _t(seconds: float, full: float) -> str:
    return "> budget" if math.isinf(seconds) else f"{seconds:.3g} s ({seconds / full:.2g} ft)"


PAIRS = (("BOSS", "BOHB"), ("SS", "Hyperband"), ("AsyncSS", "ASHA"))


def _ms(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values) * scale:.{digits}f} +- {sd * scale:.{digits}f}"


def run_table(name: str, seeds: int, budget_configs: float, only: list[str] | None,
              partial: bool = False) -> dict[str, Any]:
    table = load_table(name, partial)
    best_sample, best = table.best()
    full = statistics.mean(sum(r["cpu_seconds"] for r in runs[0]) for runs in table.curves.values())
    budget = budget_configs * full
    makers = {k: v for k, v in strategies(table.epochs).items() if only is None or k in only}
    near = [sum(table.final_mean(dict(zip(table.labels, k))) >= best - gap for k in table.curves) for gap in GAPS]
    print(f"\n== {name}: {len(table)} configurations x {len(table.info.get('seeds', [0]))} recorded seeds, "
          f"{table.epochs} epochs; a full training costs {full:.3f} CPU-s on average (recorded); budget "
          f"{budget:.1f} simulated CPU-s = {budget_configs:g} full trainings (ft); table's best (mean over seeds, "
          f"final epoch) {best * 100:.2f} % {best_sample}; configurations within 0.5 / 0.25 points of it: "
          f"{near[0]} / {near[1]}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in makers}
    for seed in range(seeds):
        for label, make in makers.items():  # interleaved: every strategy for a seed, then the next seed
            c0 = time.process_time()
            trace = optuna_search(table, seed, budget) if make is None else search(make, table, seed, budget)
            cost = time.process_time() - c0
            results[label].append({"at": [trace.at(f * budget) for f in FRACTIONS],
                                   "reach": [trace.reached(best - gap, budget) for gap in GAPS],
                                   "trials": trace.trials, "cpu": cost, "spent": trace.clock.seconds})
        if seed < 3 or (seed + 1) % 10 == 0:
            print(f"  seed {seed}: " + ", ".join(f"{k} {v[-1]['at'][-1] * 100:.2f}" for k, v in results.items()),
                  flush=True)
    rng = random.Random(0)
    headers = ["strategy"] + [f"@{f * budget:.2g} s" for f in FRACTIONS] + [
        f"to within {gap * 100:g}: median [95% CI] (got there)" for gap in GAPS] + [
        "trials", "sim s used", "bench CPU-s/search"]
    rows = []
    for label, rs in results.items():
        reached = []
        for g in range(len(GAPS)):
            times = [r["reach"][g] for r in rs]
            median, lo, hi = _median_ci(times, rng)
            got = sum(math.isfinite(t) for t in times)
            reached.append(f"{_t(median, full)} [{_t(lo, full).split(' (')[0]}, {_t(hi, full).split(' (')[0]}] "
                           f"({got}/{len(rs)})")
        rows.append([label] + [_ms([r["at"][i] for r in rs]) for i in range(len(FRACTIONS))] + reached + [
            f"{statistics.mean(r['trials'] for r in rs):.0f}", f"{statistics.mean(r['spent'] for r in rs):.3g}",
            f"{statistics.median(r['cpu'] for r in rs):.2f}"])
    print(f"\nincumbent's final validation accuracy (%; mean over the table's seeds), mean +- std over {seeds} searches; "
          f"time to within 0.5 / 0.25 points of the best in simulated CPU-s (and full trainings, ft):")
    print(C.table(headers, rows))
    pair_rows = []
    for a, b in PAIRS:
        if a not in results or b not in results:
            continue
        ta = [r["reach"][0] for r in results[a]]
        tb = [r["reach"][0] for r in results[b]]
        ratio, lo, hi = _paired_ratio(ta, tb, rng)
        earlier = sum(1.0 if x < y else 0.5 if x == y else 0.0 for x, y in zip(ta, tb)) / len(ta)
        diff = [(x["at"][-1] - y["at"][-1]) * 100 for x, y in zip(results[a], results[b])]
        se = statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else 0.0
        pair_rows.append([f"{a} / {b}", f"{ratio:.2f} [{lo:.2f}, {hi:.2f}]", f"{earlier * 100:.0f} %",
                          f"{statistics.mean(diff):+.2f} +- {se:.2f}"])
    if pair_rows:
        print(f"\npaired over the {seeds} seeds:")
        print(C.table(["A / B", "median time to within 0.5, A / B [95% CI]", "A there first",
                       "end-of-budget incumbent, A - B (points, +- s.e.)"], pair_rows))
    return {"table": name, "best": best, "budget": budget, "full": full, "results": results}


def run_nb201(seeds: int) -> dict[str, Any]:
    from tridens.evaluators import nasbench201

    table = nasbench201.table("cifar10")
    space = nasbench201.search_space()
    makers = {"BOSS (surrogate)": lambda: td.strategy.BOSS(max_steps=1), "TPE": lambda: td.strategy.TPE(),
              "RegularizedEvolution": lambda: td.strategy.RegularizedEvolution()}
    out: dict[str, list[dict[str, float]]] = {k: [] for k in makers}
    for seed in range(seeds):
        for label, make in makers.items():
            evaluator = Tabular(table, metric="val_acc")
            strategy = make()
            strategy.start(space, OBJECTIVE, random.Random(seed))
            rng = random.Random(seed)
            values: list[float] = []
            c0 = time.process_time()
            while len(values) < 300:
                group = strategy.ask(300 - len(values))
                if group is None:
                    break
                for sample in group.samples:
                    trial = Trial(len(values), dict(sample), seed=rng.getrandbits(31), status=TrialStatus.RUNNING,
                                  group=seed * 10_000 + len(values))
                    trainer = evaluator.trainer(None, sample, trial.seed)
                    trainer.train_epoch()
                    value = trainer.validate()["val_acc"]
                    trial.metrics["val_acc"] = [value]
                    trial.metric = value
                    strategy.report(trial, 0, value)
                    trial.status = TrialStatus.COMPLETED
                    strategy.tell(trial)
                    values.append(value)
            out[label].append({"best@100": max(values[:100]), "best@300": max(values[:300]),
                               "cpu": time.process_time() - c0})
        print(f"  seed {seed}: " + ", ".join(f"{k} {v[-1]['best@300'] * 100:.2f}" for k, v in out.items()), flush=True)
    rows = [[k, _ms([r["best@100"] for r in rs]), _ms([r["best@300"] for r in rs]),
             f"{statistics.median(r['cpu'] for r in rs):.1f}"] for k, rs in out.items()]
    print(f"\nNAS-Bench-201 CIFAR-10 (cifar10-valid), best validation accuracy seen (%), mean +- std over {seeds} seeds:")
    print(C.table(["strategy", "@100 queries", "@300 queries", "CPU-s/search"], rows))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", default="digits-mlp", help="comma-separated: " + ", ".join(TABLES))
    p.add_argument("--seeds", type=int, default=100)
    p.add_argument("--budget", type=float, default=20.0,
                   help="simulated budget, in full trainings of an average configuration (default 20)")
    p.add_argument("--strategies", default=None, help="comma-separated subset")
    p.add_argument("--nb201", action="store_true", help="part 2 only: NAS-Bench-201, 100 and 300 queries")
    p.add_argument("--partial", action="store_true",
                   help="accept a table still being recorded: a dry run on its largest complete sub-grid")
    p.add_argument("--json", help="write the raw results here")
    args = p.parse_args()
    C.print_machine()
    t0 = time.perf_counter()
    if args.nb201:
        out: Any = run_nb201(args.seeds)
    else:
        only = args.strategies.split(",") if args.strategies else None
        out = [run_table(name, args.seeds, args.budget, only, args.partial) for name in args.tables.split(",") if name]
    print(f"\n{time.perf_counter() - t0:.0f} s wall")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, default=str)


if __name__ == "__main__":
    main()
