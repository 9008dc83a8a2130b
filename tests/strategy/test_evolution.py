from __future__ import annotations

import random
import statistics

from tridens.space import Categorical, Condition, LabelSpec, SearchSpace
from tridens.strategy import Random, RegularizedEvolution
from tridens.trial import TrialStatus

from .harness import ACC, Bench, best, finite_space, key, run


def separable_space_and_objective(labels: int = 8, values: int = 4):
    """Accuracy is a sum of per-label contributions: local moves pay off, as in cell search."""
    weights = random.Random(1234)
    table = [[weights.random() for _ in range(values)] for _ in range(labels)]
    space = SearchSpace([LabelSpec(f"op{i}", Categorical(list(range(values)))) for i in range(labels)])

    def final(sample):
        return sum(table[i][sample[f"op{i}"]] for i in range(labels)) / labels

    return space, final


def test_improves_over_random_on_average() -> None:
    space, final = separable_space_and_objective()
    bench = Bench(space, final=final, epochs=1, noise=0.0)
    evo = [best(run(RegularizedEvolution(population=16, sample_size=4, batch_size=2), bench, seed=s,
                    max_trials=100)) for s in range(12)]
    rnd = [best(run(Random(), bench, seed=s, max_trials=100)) for s in range(12)]
    assert statistics.mean(evo) > statistics.mean(rnd) + 0.02
    assert sum(e > r for e, r in zip(evo, rnd)) >= 9


def test_initial_population_is_one_random_group_then_generations_of_batch_size() -> None:
    result = run(RegularizedEvolution(population=10, sample_size=3, batch_size=4), Bench(finite_space()),
                 max_trials=22)
    assert [len(g) for g in result.groups] == [10, 4, 4, 4]
    assert result.groups[0].name == "evolution-init-0" and result.groups[1].name == "evolution-10"


def test_failures_are_replaced_in_the_initial_population() -> None:
    bench = Bench(finite_space(), fail_at=lambda s: 0 if s["width"] == 16 else None)
    result = run(RegularizedEvolution(population=6, sample_size=2, batch_size=3), bench, max_trials=30)
    sizes = [len(g) for g in result.groups]
    failed_first = sum(t.status is TrialStatus.FAILED for t in result.trials[:6])
    assert failed_first > 0 and sizes[1] == failed_first  # the next group refills the population


def _parents(strategy: RegularizedEvolution, result) -> list[tuple]:
    by_key = {key(t.sample): t for t in result.trials}
    return [(by_key[key(t.sample)], strategy.parent_of(t.sample)) for t in result.trials
            if strategy.parent_of(t.sample) is not None]


def test_children_mutate_at_least_one_label_and_follow_conditions() -> None:
    space = finite_space()
    strategy = RegularizedEvolution(population=6, sample_size=2, mutation_prob=0.0, batch_size=1)
    result = run(strategy, Bench(space), max_trials=30, lockstep=False)
    pairs = _parents(strategy, result)
    assert len(pairs) >= 15
    trials = {t.id: t for t in result.trials}
    for child, parent_id in pairs:
        parent = trials[parent_id].sample
        changed = [label for label in child.sample if label in parent and child.sample[label] != parent[label]]
        appeared = [label for label in child.sample if label not in parent]
        vanished = [label for label in parent if label not in child.sample]
        # mutation_prob=0: exactly one label re-drawn; labels it switches on are drawn, off are dropped
        assert len(changed) == 1
        for label in appeared:
            assert space[label].active(child.sample)
        for label in vanished:
            assert not space[label].active(child.sample)


def test_parent_is_best_of_tournament_among_youngest_population() -> None:
    """sample_size == population: the tournament is the whole population, so the parent is the best
    of the ``population`` youngest trials with a value when its generation was asked."""
    strategy = RegularizedEvolution(population=5, sample_size=5, batch_size=1)
    bench = Bench(finite_space(), fail_at=lambda s: 0 if s["depth"] == 2 and s["width"] == 32 else None)
    result = run(strategy, bench, max_trials=30, lockstep=False)
    trials = {t.id: t for t in result.trials}
    checked = 0
    for child, parent_id in _parents(strategy, result):
        scored = [t for t in result.trials if t.id < child.id and t.status is TrialStatus.COMPLETED]
        population = scored[-5:]
        assert parent_id in {t.id for t in population}  # aging: older trials are dead
        assert trials[parent_id].metric == max(t.metric for t in population)
        checked += 1
    assert checked >= 15


def test_conditional_space_with_nested_conditions() -> None:
    space = SearchSpace([
        LabelSpec("cell", Categorical(["a", "b"])),
        LabelSpec("a_op", Categorical([1, 2, 3]), [Condition("cell", ("a",))]),
        LabelSpec("a_op_k", Categorical([3, 5]), [Condition("a_op", (2, 3))]),
        LabelSpec("b_op", Categorical(["x", "y"]), [Condition("cell", ("b",))]),
    ])
    # cell a: a_op=1, or a_op in (2, 3) with 2 kernels -> 5 samples; cell b: 2 samples
    bench = Bench(space, final=lambda s: 0.5, epochs=1)
    result = run(RegularizedEvolution(population=3, sample_size=2, batch_size=2), bench, objective=ACC)
    assert len(result.trials) == 7 == space.size()
