from __future__ import annotations

import random

from tridens.space import Categorical, LabelSpec, SearchSpace
from tridens.strategy import Hyperband, MedianStopping, Random
from tridens.trial import Decision, Objective, Trial, TrialStatus

from .harness import ACC, LOSS, Bench, run


def space() -> SearchSpace:
    return SearchSpace([LabelSpec("x", Categorical(list(range(100))))])


def finished(tid: int, curve: list[float]) -> Trial:
    return Trial(tid, {"x": tid}, tid, TrialStatus.COMPLETED, metric=curve[-1], metrics={"val_acc": list(curve)})


HISTORY = [finished(0, [0.5, 0.6, 0.7]), finished(1, [0.4, 0.5, 0.6]), finished(2, [0.6, 0.7, 0.8])]
# running averages: step 0: 0.5, 0.4, 0.6 (median 0.5); step 1: 0.55, 0.45, 0.65 (median 0.55)


def started(objective: Objective = ACC, **kwargs) -> MedianStopping:
    strategy = MedianStopping(**kwargs)
    strategy.start(space(), objective, random.Random(0), HISTORY)
    return strategy


def feed(strategy: MedianStopping, tid: int, curve: list[float]) -> list[Decision]:
    trial = Trial(tid, {"x": tid}, tid, TrialStatus.RUNNING)
    out = []
    for step, value in enumerate(curve):
        trial.metrics.setdefault("val_acc", []).append(value)
        strategy.report(trial, step, value)
        out.append(strategy.decide(trial, step))
        if out[-1] is Decision.STOP:
            break
    return out


def test_stops_when_best_so_far_is_below_the_median_of_running_averages() -> None:
    strategy = started(grace_steps=1, min_trials=3)
    # step 0 is in the grace period; at step 1 its best (0.52) is below the median 0.55
    assert feed(strategy, 10, [0.3, 0.52, 0.9]) == [Decision.CONTINUE, Decision.STOP]
    # its best (0.56) beats 0.55: goes on; at step 2 the median is 0.6, and 0.65 beats it
    strategy = started(grace_steps=1, min_trials=3)
    assert feed(strategy, 11, [0.2, 0.56, 0.65]) == [Decision.CONTINUE] * 3
    # the others' running averages, not their last values (0.7, 0.6, 0.8): 0.62 goes on
    assert feed(started(grace_steps=2, min_trials=3), 12, [0.0, 0.0, 0.62])[-1] is Decision.CONTINUE
    # trials seen earlier in the run count too: with trial 11 (avg 0.47) the median drops
    strategy = started(grace_steps=2, min_trials=3)
    feed(strategy, 11, [0.2, 0.56, 0.65])
    assert feed(strategy, 13, [0.0, 0.0, 0.58])[-1] is Decision.CONTINUE


def test_best_so_far_not_the_last_value() -> None:
    strategy = started(grace_steps=0, min_trials=3)
    assert feed(strategy, 12, [0.7, 0.3, 0.2]) == [Decision.CONTINUE] * 3


def test_grace_steps_and_min_trials() -> None:
    assert feed(started(grace_steps=3, min_trials=1), 13, [0.0, 0.0, 0.0]) == [Decision.CONTINUE] * 3
    assert feed(started(grace_steps=0, min_trials=4), 14, [0.0, 0.0, 0.0]) == [Decision.CONTINUE] * 3
    assert feed(started(grace_steps=0, min_trials=3), 15, [0.0]) == [Decision.STOP]


def test_minimizing() -> None:
    history = [Trial(t.id, t.sample, t.seed, t.status, metric=1 - t.metric,
                     metrics={"val_loss": [1 - v for v in t.metrics["val_acc"]]}) for t in HISTORY]
    strategy = MedianStopping(grace_steps=0, min_trials=3)
    strategy.start(space(), LOSS, random.Random(0), history)
    trial = Trial(20, {"x": 20}, 20, TrialStatus.RUNNING)
    strategy.report(trial, 0, 0.45)  # median loss at step 0 is 0.5: better
    assert strategy.decide(trial, 0) is Decision.CONTINUE
    trial = Trial(21, {"x": 21}, 21, TrialStatus.RUNNING)
    strategy.report(trial, 0, 0.55)
    assert strategy.decide(trial, 0) is Decision.STOP


def test_stops_bad_trials_and_wraps_any_proposer() -> None:
    bench = Bench(space(), final=lambda s: 0.1 + 0.8 * s["x"] / 100, epochs=6, noise=0.0)
    plain = run(Random(batch_size=6), bench, seed=2, max_trials=30)
    wrapped = run(MedianStopping(Random(batch_size=6), min_trials=3), bench, seed=2, max_trials=30)
    # same proposals: the rule only decides about running trials
    assert [t.sample for t in plain.trials] == [t.sample for t in wrapped.trials]
    stopped = [t for t in wrapped.trials if t.status is TrialStatus.STOPPED]
    kept = [t for t in wrapped.trials if t.status is TrialStatus.COMPLETED]
    assert stopped and kept
    assert sum(t.steps for t in wrapped.trials) < sum(t.steps for t in plain.trials)
    assert max(t.metric for t in kept) == max(t.metric for t in plain.trials)  # the best survives


def test_base_stop_wins() -> None:
    bench = Bench(space(), final=lambda s: 0.1 + 0.8 * s["x"] / 100, epochs=9, noise=0.0)
    hb = run(Hyperband(max_steps=9), bench, seed=1, max_trials=17)
    both = run(MedianStopping(Hyperband(max_steps=9), min_trials=100), bench, seed=1, max_trials=17)
    assert hb.signature() == both.signature()  # never enough trials for the median: Hyperband's stops only
