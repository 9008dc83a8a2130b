"""Hyperband, BOHB and ASHA: groups, rungs, and which trials they stop."""

from __future__ import annotations

import statistics

import pytest

from tridens.space import Categorical, LabelSpec, SearchSpace, Uniform
from tridens.strategy import ASHA, BOHB, Hyperband
from tridens.trial import TrialStatus

from .harness import ACC, LOSS, Bench, key, mixed_space, run


def ladder(n: int = 60, epochs: int = 9) -> Bench:
    """Trial quality is its label ``x``; curves are monotone and never cross (no noise), so the
    right decision at every rung is known."""
    space = SearchSpace([LabelSpec("x", Categorical(list(range(n))))])
    return Bench(space, final=lambda s: 0.2 + 0.7 * s["x"] / n, epochs=epochs, noise=0.0)


def expected_stop(trials, trial, budget, eta, scope):
    """Independent oracle for the asynchronous rule: the values the rung holds when ``trial``'s
    decision is due (``scope``: the trials that can be in the rung by then)."""
    def at(t):
        return t.metrics["val_acc"][budget - 1]

    seen = [t for t in trials if t.steps >= budget and scope(t)]
    better = sum(at(t) > at(trial) for t in seen)
    return better > (len(seen) - 1) / eta


def test_schedule_and_groups() -> None:
    assert Hyperband(max_steps=27).schedule() == [(27, [1, 3, 9, 27]), (12, [3, 9, 27]), (6, [9, 27]), (4, [27])]
    assert Hyperband(min_steps=2, max_steps=20).schedule() == [(9, [2, 6, 20]), (5, [6, 20]), (3, [20])]
    assert Hyperband(min_steps=5, max_steps=5).schedule() == [(1, [5])]
    result = run(Hyperband(max_steps=9), ladder(), max_trials=40)
    assert [len(g) for g in result.groups] == [9, 5, 3, 9, 5, 3, 6]  # the last bracket is cut by the budget
    assert [g.name for g in result.groups[:4]] == ["hyperband-0-s2", "hyperband-1-s1", "hyperband-2-s0",
                                                   "hyperband-3-s2"]
    assert all(g.max_steps == 9 for g in result.groups)


@pytest.mark.parametrize("objective", [ACC, LOSS], ids=["max", "min"])
def test_hyperband_in_lockstep_keeps_the_top_third_of_each_rung(objective) -> None:
    result = run(Hyperband(max_steps=9), ladder(), max_trials=17, objective=objective)
    brackets = [[t for t in result.trials if t.group == g] for g in range(3)]
    x = lambda t: t.sample["x"]  # noqa: E731
    # bracket s=2: 9 trials, rungs at 1 and 3 steps: 6 stopped after 1 step, 2 after 3, 1 trained to 9
    ranked = sorted(brackets[0], key=x)
    assert [t.steps for t in ranked] == [1] * 6 + [3] * 2 + [9]
    assert [t.status for t in ranked] == [TrialStatus.STOPPED] * 8 + [TrialStatus.COMPLETED]
    # bracket s=1: 5 trials, rung at 3 steps keeps floor(5/3) = 1
    assert [t.steps for t in sorted(brackets[1], key=x)] == [3] * 4 + [9]
    # bracket s=0: 3 trials trained fully
    assert [t.steps for t in brackets[2]] == [9, 9, 9]


def test_hyperband_one_trial_at_a_time_decides_with_what_the_rung_has_seen() -> None:
    """A user loop reports one trial at a time: a rung's decisions use the values it has so far."""
    result = run(Hyperband(max_steps=27), ladder(epochs=27), max_trials=27 + 12, lockstep=False)
    decisions = 0
    for group, (n, budgets) in enumerate(Hyperband(max_steps=27).schedule()[:2]):
        trials = [t for t in result.trials if t.group == group]
        assert len(trials) == n and trials[0].steps == 27  # alone at every rung: it goes on
        for trial in trials:
            for budget in budgets[:-1]:
                if trial.steps >= budget:
                    scope = lambda t: t.group == group and t.id <= trial.id  # noqa: E731
                    assert (trial.steps == budget) == expected_stop(result.trials, trial, budget, 3, scope)
                    decisions += 1
        survivors = [sum(t.steps > b for t in trials) for b in budgets[:-1]]
        assert survivors == sorted(survivors, reverse=True) and survivors[-1] >= 1
    assert decisions > 39


def test_hyperband_duplicates_shrink_the_rung() -> None:
    bench = ladder()
    bench.fingerprint = lambda s: str(s["x"] // 2)  # two samples per model
    result = run(Hyperband(max_steps=9), bench, max_trials=9)
    live = [t for t in result.trials if t.status is not TrialStatus.DUPLICATE]
    assert len(live) < 9
    assert sum(t.steps > 1 for t in live) == max(1, len(live) // 3)


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "one-at-a-time"])
def test_asha_stops_exactly_by_its_rule(lockstep: bool) -> None:
    bench = ladder()
    result = run(ASHA(max_steps=9, batch_size=7), bench, max_trials=42, lockstep=lockstep)
    assert ASHA(max_steps=9).rungs() == [1, 3]
    decisions = 0
    for trial in result.trials:
        for budget in (1, 3):
            if trial.steps < budget:
                continue
            if lockstep:  # the whole group reports before any decision
                scope = lambda t: t.group <= trial.group  # noqa: E731
            else:
                scope = lambda t: t.id <= trial.id  # noqa: E731
            assert (trial.steps == budget) == expected_stop(result.trials, trial, budget, 3, scope), (trial, budget)
            decisions += 1
    assert decisions > 42 and any(t.status is TrialStatus.STOPPED for t in result.trials)
    assert any(t.steps == 9 for t in result.trials[7:])


def test_asha_brackets_and_min_trials() -> None:
    result = run(ASHA(max_steps=9, brackets=2, batch_size=8), ladder(), max_trials=40)
    odd = [t for i, t in enumerate(result.trials) if i % 2 == 1]  # dealt to bracket 1: first rung at 3
    assert all(t.steps != 1 for t in odd) and any(t.steps == 3 for t in odd)
    result = run(ASHA(max_steps=9, min_trials=11, batch_size=5), ladder(), max_trials=10, lockstep=False)
    assert all(t.steps == 9 for t in result.trials)  # no rung ever held 11 values


def test_bohb_with_only_random_samples_is_hyperband() -> None:
    bench = Bench(mixed_space())
    hb = run(Hyperband(max_steps=9), bench, seed=4, max_trials=40)
    bohb = run(BOHB(max_steps=9, random_fraction=1.0), bench, seed=4, max_trials=40)
    assert bohb.signature() == hb.signature()
    assert [g.name.replace("bohb", "hyperband") for g in bohb.groups] == [g.name for g in hb.groups]


def test_bohb_proposes_better_samples_than_hyperband() -> None:
    """Once a budget has enough observations, BOHB's TPE samples beat Hyperband's random ones."""
    space = SearchSpace([LabelSpec("x", Uniform(0.0, 1.0)), LabelSpec("y", Uniform(0.0, 1.0))])
    bench = Bench(space, final=lambda s: 0.9 - (s["x"] - 0.7) ** 2 - (s["y"] - 0.2) ** 2, epochs=9, noise=0.005)

    def later_quality(strategy, seed):
        result = run(strategy, bench, seed=seed, max_trials=51)
        return statistics.mean(bench.final(t.sample) for t in result.trials[17:])

    bohb = [later_quality(BOHB(max_steps=9), s) for s in range(4)]
    hb = [later_quality(Hyperband(max_steps=9), s) for s in range(4)]
    assert statistics.mean(bohb) > statistics.mean(hb) + 0.05
    assert all(b > h for b, h in zip(bohb, hb))


def test_stopping_counts_the_whole_group_in_lockstep_only() -> None:
    """Same samples, two engines: lockstep Hyperband equals ranking each rung; a user loop differs."""
    lock = run(Hyperband(max_steps=9), ladder(), max_trials=9)
    seq = run(Hyperband(max_steps=9), ladder(), max_trials=9, lockstep=False)
    assert [key(t.sample) for t in lock.trials] == [key(t.sample) for t in seq.trials]
    best3 = sorted(lock.trials, key=lambda t: -t.sample["x"])[:3]
    assert {t.id for t in lock.trials if t.steps > 1} == {t.id for t in best3}
