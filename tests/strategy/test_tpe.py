from __future__ import annotations

import math
import statistics

from tridens.space import Categorical, Condition, LabelSpec, LogUniform, RandInt, SearchSpace, Uniform
from tridens.strategy import TPE, Random
from tridens.trial import TrialStatus

from .harness import LOSS, Bench, best, run


def hpo_space() -> SearchSpace:
    return SearchSpace([
        LabelSpec("lr", LogUniform(1e-5, 1.0)),
        LabelSpec("momentum", Uniform(0.0, 0.99)),
        LabelSpec("optimizer", Categorical(["sgd", "adam"])),
        LabelSpec("beta2", Uniform(0.9, 0.9999), [Condition("optimizer", ("adam",))]),
        LabelSpec("layers", RandInt(1, 8)),
    ])


def loss(sample) -> float:
    """A validation loss with its optimum at lr=1e-2, momentum=0.9, 3 layers, adam."""
    value = 0.1 + 0.08 * (math.log10(sample["lr"]) + 2) ** 2 + 0.5 * (sample["momentum"] - 0.9) ** 2
    value += 0.02 * abs(sample["layers"] - 3)
    value += 0.0 if sample["optimizer"] == "adam" else 0.1
    if sample["optimizer"] == "adam":
        value += 50 * (sample["beta2"] - 0.999) ** 2
    return value


def test_beats_random_on_average_minimizing() -> None:
    # the harness's "accuracy" curve reported as 1 - acc: final = 1 - (1 - loss) = loss
    bench = Bench(hpo_space(), final=lambda s: 1 - loss(s), epochs=1, noise=0.0)
    seeds = range(6)
    tpe = [best(run(TPE(batch_size=2, n_startup_trials=8), bench, seed=s, max_trials=36, objective=LOSS), LOSS)
           for s in seeds]
    rnd = [best(run(Random(), bench, seed=s, max_trials=36, objective=LOSS), LOSS) for s in seeds]
    assert statistics.mean(tpe) < statistics.mean(rnd) - 0.01
    assert sum(t < r for t, r in zip(tpe, rnd)) >= 5


def test_conditional_labels_only_when_active_and_proposals_concentrate() -> None:
    bench = Bench(hpo_space(), final=lambda s: 1 - loss(s), epochs=1, noise=0.0)
    result = run(TPE(batch_size=1, n_startup_trials=6), bench, seed=0, max_trials=30, objective=LOSS)
    for trial in result.trials:
        assert ("beta2" in trial.sample) == (trial.sample["optimizer"] == "adam")
    late = [t.sample["optimizer"] for t in result.trials[15:]]
    assert late.count("adam") > len(late) / 2


def test_stopped_and_failed_trials_inform_the_model() -> None:
    """Failures (e.g. constraint violations) are ranked worst: TPE learns to avoid the region."""
    space = SearchSpace([LabelSpec("x", Uniform(0.0, 1.0)), LabelSpec("y", Uniform(0.0, 1.0))])
    bench = Bench(space, final=lambda s: 1 - (s["x"] - 0.6) ** 2 - (s["y"] - 0.5) ** 2, epochs=1, noise=0.0,
                  fail_at=lambda s: 0 if s["x"] > 0.7 else None)
    result = run(TPE(batch_size=1, n_startup_trials=10), bench, seed=1, max_trials=50)
    early = sum(t.status is TrialStatus.FAILED for t in result.trials[:10])
    late = sum(t.status is TrialStatus.FAILED for t in result.trials[-20:])
    assert early >= 2 and late / 20 < early / 10


def test_small_categorical_space_with_repeats_is_exhausted_without_repeating() -> None:
    space = SearchSpace([LabelSpec("a", Categorical([1, 2, 3])), LabelSpec("b", Categorical([True, False]))])
    result = run(TPE(batch_size=4, n_startup_trials=2), Bench(space, final=lambda s: s["a"] / 4, epochs=1))
    assert len(result.trials) == 6
