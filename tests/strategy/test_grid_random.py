from __future__ import annotations

from tridens.space import Categorical, LabelSpec, RandInt, SearchSpace
from tridens.strategy import GridSearch, Random
from tridens.trial import TrialStatus

from .harness import Bench, finite_space, key, run


def test_grid_visits_every_sample_in_order_then_ends() -> None:
    space = finite_space()
    result = run(GridSearch(batch_size=8), Bench(space))
    assert [t.sample for t in result.trials] == list(space.grid())
    assert [len(g) for g in result.groups] == [8, 8, 8, 8, 4]
    assert result.groups[1].name == "grid-8"


def test_grid_resumes_where_it_stopped_and_skips_history_in_any_order() -> None:
    space = SearchSpace([LabelSpec("a", RandInt(0, 3)), LabelSpec("b", Categorical(["x", "y"]))])
    grid = list(space.grid())
    first = run(GridSearch(batch_size=3), Bench(space, final=lambda s: 0.5), max_trials=5)
    history = list(reversed(first.trials))
    rest = run(GridSearch(batch_size=3), Bench(space, final=lambda s: 0.5), history=history)
    assert [t.sample for t in rest.trials[5:]] == grid[5:]


def test_random_groups_and_exhaustion() -> None:
    space = finite_space()
    result = run(Random(batch_size=10), Bench(space))
    assert [len(g) for g in result.groups] == [10, 10, 10, 6]
    assert len({key(t.sample) for t in result.trials}) == 36
    assert [t.sample for t in result.trials] != list(space.grid())


def test_random_proposes_other_samples_after_duplicates() -> None:
    space = SearchSpace([LabelSpec("a", Categorical(list(range(20))))])
    bench = Bench(space, final=lambda s: 0.5, fingerprint=lambda s: str(s["a"] % 5))  # 5 distinct models
    result = run(Random(batch_size=4), bench)
    assert len(result.trials) == 20
    assert sum(t.status is TrialStatus.COMPLETED for t in result.trials) == 5
