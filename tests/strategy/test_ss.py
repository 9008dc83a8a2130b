"""SS, AsyncSS and BOSS: the duel against the leader, which trials a rung keeps, and a real
experiment whose stopped trials leave fused units."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tridens as td
from tridens import nn as tnn
from tridens.strategy import BOSS, SS, AsyncSS, Hyperband
from tridens.strategy._ss import beats_leader, forced_rungs
from tridens.trial import TrialStatus

from .harness import ACC, LOSS, Bench, mixed_space, run
from .test_multifidelity import ladder


def test_beats_leader_compares_with_every_stretch_of_the_leader() -> None:
    leader = [0.2, 0.6, 0.9, 0.95]
    assert beats_leader([0.3], leader)                # beats the leader's first epoch
    assert not beats_leader([0.1], leader)
    assert beats_leader([0.35, 0.45], leader)         # 0.40 = mean(0.2, 0.6), the weakest stretch
    assert not beats_leader([0.3, 0.45], leader)
    assert beats_leader([0.9, 0.7, 0.2], [0.9, 0.2, 0.4, 0.9])  # a dip in the middle counts too
    assert not beats_leader([0.9] * 5, leader)        # more observations than the leader: no stretch
    assert forced_rungs(9, 3) == 0 and forced_rungs(81, 3) == 1 and forced_rungs(1000, 3) == 1


def _rungs(result, group):
    return sorted((t for t in result.trials if t.group == group), key=lambda t: t.sample["x"])


@pytest.mark.parametrize("objective", [ACC, LOSS], ids=["max", "min"])
def test_ss_keeps_every_winner_of_the_duel_and_at_least_a_hyperband_rung(objective) -> None:
    """Noise-free, never-crossing curves: in the first bracket the leader is a member of the rung
    and nobody beats it, so the rung is filled to Hyperband's ``m // eta`` by mean (Hyperband's
    own choice on such curves); later rungs keep every member better than the search's leader,
    and at least ``m // eta``."""
    bench = ladder(n=200, epochs=27)
    result = run(SS(max_steps=27), bench, max_trials=27 + 12 + 6 + 4 + 27, objective=objective)
    hyperband = run(Hyperband(max_steps=27), bench, max_trials=27, objective=objective)
    assert [t.steps for t in _rungs(result, 0)] == [t.steps for t in _rungs(hyperband, 0)] == \
        [1] * 18 + [3] * 6 + [9] * 2 + [27]
    leader = max(t.sample["x"] for g in range(4) for t in _rungs(result, g) if t.steps == 27)
    fifth = _rungs(result, 4)  # the next 27-trial bracket: rungs at 1, 3 and 9 steps
    assert len(fifth) == 27
    better = {t.sample["x"] for t in fifth if t.sample["x"] > leader}
    top_ninth = {t.sample["x"] for t in fifth[-9:]}
    kept = {t.sample["x"] for t in fifth if t.steps > 1}
    assert kept == better | top_ninth
    hyperband = run(Hyperband(max_steps=27), bench, max_trials=len(result.trials), objective=objective)
    for g in range(5):  # the same samples (random proposals, same seed): never fewer steps than Hyperband
        assert sum(t.steps for t in _rungs(result, g)) >= sum(t.steps for t in _rungs(hyperband, g))


def test_ss_trains_every_winner_when_more_win_than_a_hyperband_rung() -> None:
    """A weak leader (the first bracket's samples all learn poorly): every member of the next
    bracket beats it, and all of them train on, where Hyperband keeps ``5 // 3 = 1``."""
    probe = run(SS(max_steps=9), ladder(n=100), max_trials=9)
    weak = {t.sample["x"] for t in probe.trials}
    bench = ladder(n=100)
    bench.final = lambda s: 0.1 if s["x"] in weak else 0.2 + 0.7 * s["x"] / 100
    result = run(SS(max_steps=9), bench, max_trials=9 + 5)
    assert {t.sample["x"] for t in _rungs(result, 0)} == weak
    assert [t.steps for t in _rungs(result, 1)] == [9] * 5
    hyperband = run(Hyperband(max_steps=9), bench, max_trials=9 + 5)
    assert sorted(t.steps for t in _rungs(hyperband, 1)) == [3] * 4 + [9]


def test_ss_forced_exploration_trains_a_large_bracket_past_its_first_rung() -> None:
    result = run(SS(max_steps=81), ladder(n=100, epochs=81), max_trials=81)
    assert len(result.trials) == 81 and forced_rungs(81, 3) == 1
    assert all(t.steps >= 3 for t in result.trials)                # nobody stopped at 1 step
    assert sum(t.steps > 3 for t in result.trials) <= 81 // 3      # then at most a Hyperband rung


def _leader(trials):
    """Most observations, then highest mean, then lowest id (the oracle's own implementation)."""
    return max(trials, key=lambda t: (len(t.metrics["val_acc"]), sum(t.metrics["val_acc"]) / len(t.metrics["val_acc"]),
                                      -t.id))


def test_async_ss_decides_each_trial_with_what_exists_when_it_reaches_a_rung() -> None:
    """One trial at a time: each decision must match an independent oracle built from the
    trials before it (all finished) and the trial itself up to the rung."""
    bench = Bench(mixed_space(), noise=0.02)
    result = run(AsyncSS(max_steps=9, batch_size=5), bench, max_trials=30, lockstep=False, seed=4)
    decisions = stops = 0
    for i, trial in enumerate(result.trials):
        before = result.trials[:i]
        for budget in (1, 3):
            if trial.steps < budget:
                continue
            mine = trial.metrics["val_acc"][:budget]
            rung = [sum(t.metrics["val_acc"][:budget]) / budget for t in before if t.steps >= budget]
            mean = sum(mine) / budget
            better = sum(v > mean for v in rung)
            in_quota = better <= len(rung) / 3
            now = [t for t in before] + [type(trial)(trial.id, trial.sample, trial.seed,
                                                     metrics={"val_acc": mine})]
            lead = _leader(now)
            wins = lead.id == trial.id or beats_leader(mine, lead.metrics["val_acc"])
            expected_stop = not (wins or in_quota)
            assert (trial.steps == budget and trial.status is TrialStatus.STOPPED) == expected_stop, (i, budget)
            decisions += 1
            stops += expected_stop
    assert decisions > 30 and stops > 5


def test_boss_proposes_from_the_model_once_it_has_points() -> None:
    """BOSS's brackets are SS's; with enough points its proposals come from TPE and beat random."""
    bench = Bench(mixed_space())
    boss = run(BOSS(max_steps=9, min_points_in_model=8), bench, max_trials=120, seed=1)
    ss = run(SS(max_steps=9), bench, max_trials=120, seed=1)
    assert [len(g) for g in boss.groups] == [len(g) for g in ss.groups]
    assert [g.name.replace("boss", "ss") for g in boss.groups] == [g.name for g in ss.groups]
    late = lambda r: sorted(bench.final(t.sample) for t in r.trials[60:])  # noqa: E731
    assert sum(late(boss)) > sum(late(ss))


def test_strings_name_the_strategies() -> None:
    from tridens.engine._experiment import _strategy_by_name

    assert type(_strategy_by_name("ss")) is SS
    assert type(_strategy_by_name("boss")) is BOSS
    assert type(_strategy_by_name("async_ss")) is AsyncSS


class LrMLP(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, td.choice("width", [16, 32])), nn.ReLU(),
                                 nn.Linear(td.choice("width", [16, 32]), 10))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("strategy", [lambda: SS(max_steps=4, reduction_factor=2),
                                      lambda: AsyncSS(max_steps=4, reduction_factor=2, batch_size=8)],
                         ids=["ss", "async-ss"])
def test_real_experiment_stops_trials_inside_fused_units(tmp_path, strategy) -> None:
    """Real training on digits: stopped trials leave their fused unit, the others go on, and the
    metrics equal those of the same search trained without fusion."""
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train=train, val=val, epochs=4, batch_size=128, optimizer="sgd",
                                      lr=td.choice("lr", [0.3, 0.1, 0.03, 0.01, 0.003, 0.001]))
    runs = {}
    for optimize in (True, False):
        torch.manual_seed(0)
        exp = td.Experiment(LrMLP(), ev, strategy(), budget=8, store=tmp_path / f"{optimize}.db", name="ss",
                            executor=td.executors.Inline(optimize=optimize),
                            options=td.RunOptions(verbose=False, seed=3)).run()
        runs[optimize] = {t.id: t for t in exp.trials()}
    fused, separate = runs[True], runs[False]
    assert any(t.status is TrialStatus.STOPPED for t in fused.values())
    assert [(t.sample, t.status, t.steps) for t in fused.values()] == \
           [(t.sample, t.status, t.steps) for t in separate.values()]
    for i in fused:
        assert fused[i].metrics["val_acc"] == pytest.approx(separate[i].metrics["val_acc"], abs=1e-4)
