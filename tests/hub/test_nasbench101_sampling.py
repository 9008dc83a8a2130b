"""NAS-Bench-101's edge budget as a sample rule: random samples and evolution's children are valid
wirings, drawn uniformly among the valid ones; searches on digits train every trial they propose."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch
from torch.utils.data import Subset

import tridens as td
from tridens import hub
from tridens.trial import TrialStatus


def _space(**kwargs):
    return hub.NasBench101(stem_out_channels=8, num_stacks=1, num_modules_per_stack=1, in_channels=1, **kwargs)


def test_random_samples_are_valid_and_freeze() -> None:
    space = _space()
    search = space.search_space()
    assert [type(r).__name__ for r in search.rules] == ["NasBench101EdgeBudget"]
    rng = random.Random(0)
    edges = Counter()
    for _ in range(300):
        sample = search.random_sample(rng)
        assert search.violation(sample) is None
        edges[sum(len(sample[f"cell/input{d}"]) for d in range(1, 7))] += 1
    assert set(edges) <= set(range(6, 10)) and edges[9] > 0 and edges[6] > 0
    x = torch.randn(2, 1, 8, 8)
    for seed in range(3):
        with torch.no_grad():
            assert space.freeze(space.random_sample(random.Random(seed))).eval()(x).shape == (2, 10)
    too_many = {**space.random_sample(random.Random(1)), **{f"cell/input{d}": list(range(d)) for d in range(1, 7)}}
    assert "21 edges, more than max_num_edges=9" in search.violation(too_many)


def test_wirings_are_drawn_uniformly_among_the_valid_ones() -> None:
    """5 nodes, at most 5 edges: 96 valid wirings (of 315), each drawn about as often."""
    rule = hub.NasBench101EdgeBudget("cell", 5, 5)
    valid = [w for w in itertools.product(*[[list(c) for r in range(1, d + 1) for c in itertools.combinations(range(d), r)]
                                             for d in range(1, 5)]) if sum(map(len, w)) <= 5]
    assert len(valid) == 96
    rng = random.Random(7)
    draws = 19200
    counts = Counter(repr(list(rule.draw(rng, {}).values())) for _ in range(draws))
    assert set(counts) == {repr(list(w)) for w in valid}
    expected = draws / len(valid)  # 200
    assert all(abs(n - expected) < 5 * expected ** 0.5 for n in counts.values())
    with pytest.raises(td.InvalidSpace, match="need at least 4 edges"):
        hub.NasBench101EdgeBudget("cell", 5, 3).draw(rng, {})


@pytest.mark.parametrize("strategy", [td.strategy.Random(), td.strategy.RegularizedEvolution(population=2, sample_size=2),
                                      td.strategy.TPE(batch_size=2, n_startup_trials=2)],
                         ids=["random", "evolution", "tpe"])
def test_searches_train_every_trial_they_propose(tmp_path, strategy) -> None:
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(Subset(train, range(256)), Subset(val, range(128)), epochs=1, batch_size=64)
    exp = td.Experiment(_space(), ev, strategy, budget=6, store=tmp_path / "nb101.db", name="nb101",
                        options=td.RunOptions(verbose=False))
    exp.run()
    trials = exp.trials()
    # samples that differ only on nodes off every path are one architecture: recorded as duplicates
    trained = [t for t in trials if "duplicate_of" not in t.info]
    assert len(trained) == 6
    assert all(t.status in (TrialStatus.COMPLETED, TrialStatus.DUPLICATE) for t in trials), [t.error for t in trials]


def test_model_based_suggestions_that_break_the_edge_budget_are_repaired() -> None:
    """TPE's and BOHB's proposals (Optuna's sampler, which knows the domains but not the rule): a
    suggestion over the budget has its wiring drawn again by the rule, its ops kept."""
    from tridens.strategy._tpe import _Observation, _OptunaBridge
    from tridens.trial import Objective

    search = _space().search_space()
    rng = random.Random(0)
    raw = [{label: spec.domain.sample(rng) for label, spec in search.items()} for _ in range(200)]
    assert sum(search.violation(s) is not None for s in raw) > 100  # most unconstrained draws break it
    fixed = [search.repaired(s, rng) for s in raw]
    assert all(search.violation(s) is None for s in fixed)
    assert all({k: v for k, v in f.items() if "op" in k} == {k: v for k, v in s.items() if "op" in k}
               for f, s in zip(fixed, raw))
    seen = [search.random_sample(rng) for _ in range(24)]
    observations = [_Observation(s, "complete", float(i % 7)) for i, s in enumerate(seen)]
    bridge = _OptunaBridge(search, Objective("val_acc", "max"), n_startup_trials=4, n_ei_candidates=8,
                           multivariate=True)
    proposed = bridge.propose(observations, [], 12, seed=3, is_new=lambda s: True)
    assert len(proposed) == 12 and all(p is not None and search.violation(p) is None for p in proposed)
