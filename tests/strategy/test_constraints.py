from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tridens.strategy import Constraint, RegularizedEvolution, pareto_front
from tridens.trial import Objective, Trial, TrialStatus

from .harness import Bench, finite_space, run


def trial(tid: int, acc: float | None, status: TrialStatus = TrialStatus.COMPLETED, **info) -> Trial:
    metrics = {} if acc is None else {"val_acc": [acc / 2, acc]}
    return Trial(tid, {}, tid, status, metric=acc, metrics=metrics, info=info)


def test_constraint_bounds_messages_and_aliases() -> None:
    c = Constraint("params", max=1e5)
    assert c.satisfied({"params": 1e5}) and not c.satisfied({"params": 100_001})
    assert c.violation({"params": 250_000}) == "params = 250000 violates params <= 100000"
    assert c.violation(trial(0, 0.9, params=10)) is None
    lat = Constraint("latency", max=20.5)
    assert lat.key == "latency_ms" and lat.satisfied({"latency_ms": 3.0})
    assert lat.violation({"latency_ms": 30.25}) == "latency = 30.25 violates latency <= 20.5"
    both = Constraint("flops", min=1e6, max=1e9)
    assert str(both) == "1000000 <= flops <= 1000000000"
    assert not both.satisfied({"flops": 10}) and both.satisfied({"flops": 1e7})
    with pytest.raises(KeyError, match=r"needs info\['flops'\], which was not measured \(info has: params\)"):
        both.satisfied({"params": 1})


@pytest.mark.parametrize("kwargs, message", [
    ({"metric": "params"}, "needs a bound"),
    ({"metric": "params", "min": 5, "max": 1}, r"`min <= max` must hold for Constraint\('params'\), but got \(min=5, max=1\)"),
    ({"metric": "", "max": 1}, "The 'metric' parameter of Constraint must be a non-empty str. Got '' instead."),
    ({"metric": "params", "max": "big"}, "The 'max' parameter of Constraint must be a number or None. Got 'big' instead."),
])
def test_constraint_validation(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        Constraint(**kwargs)


def test_pareto_front_of_accuracy_and_size() -> None:
    trials = [
        trial(0, 0.90, params=500),
        trial(1, 0.80, params=100),
        trial(2, 0.85, params=600),   # dominated by 0
        trial(3, 0.80, params=100),   # equal to 1: neither dominates
        trial(4, 0.95, params=900),
        trial(5, 0.99, TrialStatus.FAILED, params=1),     # failed: not a candidate
        trial(6, 0.70, params=50),
        trial(7, None, TrialStatus.DUPLICATE, params=10),
        trial(8, 0.95, TrialStatus.STOPPED, params=950),  # dominated by 4
        trial(9, 0.96),                                   # no params measured: left out
    ]
    front = pareto_front(trials, [Objective("val_acc", "max"), ("params", "min")])
    assert [t.id for t in front] == [0, 1, 3, 4, 6]
    # one objective: the best trials
    assert [t.id for t in pareto_front(trials, [("val_acc", "max")])] == [9]
    # three objectives, latency read from latency_ms
    trials = [trial(0, 0.9, params=1, latency_ms=5.0), trial(1, 0.9, params=1, latency_ms=4.0),
              trial(2, 0.8, params=1, latency_ms=1.0)]
    front = pareto_front(trials, [("val_acc", "max"), ("params", "min"), ("latency", "min")])
    assert [t.id for t in front] == [1, 2]
    with pytest.raises(ValueError, match="needs a list of objectives"):
        pareto_front(trials, Objective("val_acc", "max"))
    with pytest.raises(ValueError, match="'mode' parameter of Objective"):
        pareto_front(trials, [("val_acc", "maximize")])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=25),
       st.lists(st.sampled_from(["max", "min"]), min_size=3, max_size=3))
def test_pareto_front_properties(points, modes) -> None:
    trials = [Trial(i, {}, i, TrialStatus.COMPLETED, metrics={"a": [float(a)], "b": [float(b)]}, info={"c": c})
              for i, (a, b, c) in enumerate(points)]
    objectives = [Objective(name, mode) for name, mode in zip("abc", modes)]
    front = pareto_front(trials, objectives)
    vec = {t.id: [o.score(v) for o, v in zip(objectives, points[t.id])] for t in trials}

    def dominates(p, q):
        return all(x >= y for x, y in zip(p, q)) and any(x > y for x, y in zip(p, q))

    ids = {t.id for t in front}
    assert front and [t.id for t in front] == sorted(ids)
    for t in trials:
        beaten = any(dominates(vec[o.id], vec[t.id]) for o in trials)
        assert (t.id in ids) == (not beaten)
        if not beaten:
            continue
        assert any(dominates(vec[f], vec[t.id]) for f in ids)  # every other trial is beaten by the front


def test_infeasible_trials_never_become_parents() -> None:
    bench = Bench(finite_space(), final=lambda s: s["width"] / 100 + s["depth"] / 10,  # bigger is better...
                  info=lambda s: {"params": s["width"] ** 2 * s["depth"]},
                  constraints=[Constraint("params", max=32 ** 2 * 3)])                # ...up to a size
    strategy = RegularizedEvolution(population=6, sample_size=3, batch_size=2)
    result = run(strategy, bench, max_trials=30)
    trials = {t.id: t for t in result.trials}
    failed = [t for t in result.trials if t.status is TrialStatus.FAILED]
    assert failed and all("violates params <= 3072" in t.error for t in failed)
    parents = {strategy.parent_of(t.sample) for t in result.trials} - {None}
    assert parents and all(trials[p].status is TrialStatus.COMPLETED for p in parents)
    assert all(bench.constraints[0].satisfied(t) for t in pareto_front(result.trials, [("val_acc", "max"),
                                                                                       ("params", "min")]))
