"""Constructors store, ``start`` validates, with one error template."""

from __future__ import annotations

import random
import re

import pytest

from tridens.strategy import (ASHA, BOHB, TPE, GridSearch, Hyperband, MedianStopping, Random,
                              RegularizedEvolution)

from .harness import ACC, finite_space

CASES = [
    (RegularizedEvolution(population=1),
     "The 'population' parameter of RegularizedEvolution must be an int in the range [2, inf). Got 1 instead."),
    (RegularizedEvolution(population=10, sample_size=11),
     "The 'sample_size' parameter of RegularizedEvolution must be an int in the range [1, population=10]. "
     "Got 11 instead."),
    (RegularizedEvolution(mutation_prob=1.5),
     "The 'mutation_prob' parameter of RegularizedEvolution must be a float in the range [0.0, 1.0]. "
     "Got 1.5 instead."),
    (RegularizedEvolution(batch_size=True),
     "The 'batch_size' parameter of RegularizedEvolution must be an int in the range [1, inf). Got True instead."),
    (Random(batch_size=0), "The 'batch_size' parameter of Random must be an int in the range [1, inf). Got 0 instead."),
    (GridSearch(batch_size=2.0),
     "The 'batch_size' parameter of GridSearch must be an int in the range [1, inf). Got 2.0 instead."),
    (TPE(n_startup_trials=-1),
     "The 'n_startup_trials' parameter of TPE must be an int in the range [0, inf). Got -1 instead."),
    (TPE(multivariate="yes"), "The 'multivariate' parameter of TPE must be a bool. Got 'yes' instead."),
    (Hyperband(), "The 'max_steps' parameter of Hyperband must be an int in the range [1, inf). Got None instead."),
    (Hyperband(min_steps=10, max_steps=9),
     "`min_steps <= max_steps` must hold for Hyperband, but got (min_steps=10, max_steps=9)."),
    (Hyperband(max_steps=9, reduction_factor=1),
     "The 'reduction_factor' parameter of Hyperband must be an int in the range [2, inf). Got 1 instead."),
    (BOHB(max_steps=9, random_fraction=2),
     "The 'random_fraction' parameter of BOHB must be a float in the range [0.0, 1.0]. Got 2 instead."),
    (BOHB(max_steps=9, min_points_in_model=0),
     "The 'min_points_in_model' parameter of BOHB must be an int or None in the range [1, inf). Got 0 instead."),
    (BOHB(), "The 'max_steps' parameter of BOHB must be an int in the range [1, inf). Got None instead."),
    (ASHA(max_steps=9, brackets=0), "The 'brackets' parameter of ASHA must be an int in the range [1, inf). Got 0 instead."),
    (MedianStopping(n_warmup_steps=-1),
     "The 'n_warmup_steps' parameter of MedianStopping must be an int in the range [0, inf). Got -1 instead."),
    (MedianStopping(interval_steps=0),
     "The 'interval_steps' parameter of MedianStopping must be an int in the range [1, inf). Got 0 instead."),
    (TPE(stopping=MedianStopping(n_min_trials=0)),
     "The 'n_min_trials' parameter of MedianStopping must be an int in the range [1, inf). Got 0 instead."),
    (RegularizedEvolution(stopping=ASHA(max_steps=9, reduction_factor=1)),
     "The 'reduction_factor' parameter of ASHA must be an int in the range [2, inf). Got 1 instead."),
]


@pytest.mark.parametrize("strategy, message", CASES, ids=[f"{type(s).__name__}-{i}" for i, (s, _) in enumerate(CASES)])
def test_start_validates_parameters(strategy, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        strategy.start(finite_space(), ACC, random.Random(0))


def test_parameters_are_kept_as_given() -> None:
    strategy = RegularizedEvolution(population=1)  # no error until start
    assert strategy.params() == {"population": 1, "sample_size": 5, "mutation_prob": 0.05, "batch_size": 4,
                                 "inherit_weights": False, "stopping": None}
    assert repr(Hyperband(max_steps=9)) == "Hyperband(min_steps=1, max_steps=9, reduction_factor=3)"
    rule = MedianStopping()
    assert TPE(stopping=rule).params()["stopping"] is rule
