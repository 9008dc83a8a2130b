"""MedianStopping decides as Optuna's MedianPruner does, step by step, on real learning curves.

The curves are the recorded table of bench/record_curves.py (an MLP on scikit-learn's digits,
27 epochs per configuration, trained by tridens): each replay feeds the same curves, in the same
order, to an Optuna study with ``MedianPruner`` and to ``MedianStopping``, and compares every
decision.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import optuna
import pytest

from tridens.evaluators import CurveTable
from tridens.space import Categorical, LabelSpec, SearchSpace
from tridens.strategy import Hyperband, MedianStopping, Random
from tridens.trial import Decision, Objective, Trial, TrialStatus

from .harness import Bench, run

RECORDED = Path(__file__).resolve().parents[2] / "bench" / "data" / "digits-mlp.json.gz"


@pytest.fixture(scope="module")
def curves() -> dict[str, list[list[float]]]:
    """40 configurations drawn at random from the recorded table, one recorded run each."""
    table = CurveTable.load(RECORDED)
    samples = table.search_space().grid()
    chosen = random.Random(36).sample(list(samples), 40)
    out: dict[str, list[list[float]]] = {"val_acc": [], "val_loss": []}
    for i, sample in enumerate(chosen):
        records = table.lookup(sample, seed=i)
        for metric in out:
            out[metric].append([r[metric] for r in records])
    return out


def replay(curves: list[list[float]], objective: Objective, batch: int, **params: int) -> tuple[list, list]:
    """Every decision of Optuna's MedianPruner and of MedianStopping, trial by trial and step by
    step; ``batch`` trials train in lockstep (1: one after another)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize" if objective.mode == "max" else "minimize",
                                pruner=optuna.pruners.MedianPruner(**params),
                                sampler=optuna.samplers.RandomSampler(seed=0))
    rule = MedianStopping(**params)
    rule.start(SearchSpace([LabelSpec("config", Categorical(list(range(len(curves)))))]), objective,
               random.Random(0))
    theirs: list[tuple[int, int, bool]] = []
    ours: list[tuple[int, int, bool]] = []
    for first in range(0, len(curves), batch):
        ids = list(range(first, min(first + batch, len(curves))))
        asked = {i: study.ask() for i in ids}
        trials = {i: Trial(i, {"config": i}, i, TrialStatus.RUNNING, metrics={objective.metric: []}) for i in ids}
        running = list(ids)
        for step in range(len(curves[0])):
            for i in running:  # every value of the step reported before any decision (lockstep)
                value = curves[i][step]
                asked[i].report(value, step)
                trials[i].metrics[objective.metric].append(value)
                rule.report(trials[i], step, value)
            still = []
            for i in running:
                pruned = asked[i].should_prune()
                stopped = rule.decide(trials[i], step) is Decision.STOP
                theirs.append((i, step, pruned))
                ours.append((i, step, stopped))
                if pruned:
                    study.tell(asked[i], state=optuna.trial.TrialState.PRUNED)
                if stopped:
                    trials[i].status = TrialStatus.STOPPED
                    trials[i].metric = trials[i].metrics[objective.metric][-1]
                    rule.tell(trials[i])
                if not (pruned or stopped):
                    still.append(i)
            running = still
        for i in running:
            study.tell(asked[i], curves[i][-1])
            trials[i].status, trials[i].metric = TrialStatus.COMPLETED, curves[i][-1]
            rule.tell(trials[i])
    return theirs, ours


SETTINGS = [
    {},                                                             # Optuna's defaults: 5, 0, 1, 1
    {"n_startup_trials": 3, "n_warmup_steps": 4, "interval_steps": 3},
    {"n_startup_trials": 8, "n_warmup_steps": 1, "interval_steps": 5, "n_min_trials": 6},
    {"n_startup_trials": 0, "n_warmup_steps": 10},
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "defaults")
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("objective", [Objective("val_acc", "max"), Objective("val_loss", "min")], ids=str)
def test_same_decisions_as_optunas_median_pruner(curves, params, batch, objective) -> None:
    theirs, ours = replay(curves[objective.metric], objective, batch, **params)
    assert ours == theirs
    stops = sum(pruned for _, _, pruned in theirs)
    assert 0 < stops < 40  # the replay exercises both decisions


def test_warmup_and_interval_decide_where_stops_happen(curves) -> None:
    theirs, ours = replay(curves["val_acc"], Objective("val_acc", "max"), 1,
                          n_startup_trials=3, n_warmup_steps=4, interval_steps=3)
    stopped_at = {step for _, step, stopped in ours if stopped}
    assert stopped_at and all(step >= 4 and (step - 4) % 3 == 0 for step in stopped_at)


def test_as_a_strategy_and_a_stopping_rule() -> None:
    """On its own it proposes random samples; as ``stopping=`` the proposals are the sampler's."""
    space = SearchSpace([LabelSpec("x", Categorical(list(range(100))))])
    bench = Bench(space, final=lambda s: 0.1 + 0.8 * s["x"] / 100, epochs=6, noise=0.0)
    plain = run(Random(batch_size=6), bench, seed=2, max_trials=30)
    with_rule = run(Random(batch_size=6, stopping=MedianStopping(n_startup_trials=3)), bench, seed=2, max_trials=30)
    assert [t.sample for t in plain.trials] == [t.sample for t in with_rule.trials]
    stopped = [t for t in with_rule.trials if t.status is TrialStatus.STOPPED]
    assert stopped and all(t.group != with_rule.trials[0].group for t in stopped)  # the first group runs in full
    assert max(t.metric for t in with_rule.trials) == max(t.metric for t in plain.trials)
    alone = run(MedianStopping(n_startup_trials=3, batch_size=6), bench, seed=2, max_trials=30)
    assert any(t.status is TrialStatus.STOPPED for t in alone.trials)


def test_a_strategy_that_stops_nothing_is_refused_as_stopping() -> None:
    space = SearchSpace([LabelSpec("x", Categorical(list(range(100))))])
    with pytest.raises(ValueError, match=r"^The 'stopping' parameter of Random must be a stopping rule "
                                         r"\(td.strategy.ASHA, Hyperband, BOHB or MedianStopping\) or None. "
                                         r"Got Random\(batch_size=8, stopping=None\) instead.$"):
        Random(stopping=Random()).start(space, Objective("val_acc", "max"), random.Random(0))
    with pytest.raises(ValueError, match="Got 'asha' instead"):
        Random(stopping="asha").start(space, Objective("val_acc", "max"), random.Random(0))
    with pytest.raises(ValueError, match="The 'max_steps' parameter of Hyperband must be an int"):
        Random(stopping=Hyperband()).start(space, Objective("val_acc", "max"), random.Random(0))


def test_nan_reports() -> None:
    """All-NaN reports stop the trial (as Optuna prunes it); NaN values of completed trials are left out."""
    space = SearchSpace([LabelSpec("x", Categorical(list(range(10))))])
    rule = MedianStopping(n_startup_trials=1)
    done = Trial(0, {"x": 0}, 0, TrialStatus.COMPLETED, metric=0.5, metrics={"val_acc": [0.5, math.nan]})
    rule.start(space, Objective("val_acc", "max"), random.Random(0), [done])
    trial = Trial(1, {"x": 1}, 1, TrialStatus.RUNNING)
    rule.report(trial, 0, math.nan)
    assert rule.decide(trial, 0) is Decision.STOP
    trial = Trial(2, {"x": 2}, 2, TrialStatus.RUNNING)
    rule.report(trial, 0, 0.6)
    rule.report(trial, 1, 0.1)
    assert rule.decide(trial, 1) is Decision.CONTINUE  # no completed value at step 1
