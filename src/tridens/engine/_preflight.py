"""Checks an experiment passes before its first trial: the evaluator's settings for every
candidate of its hyperparameters, the objective's metric, the strategy's settings against the
search space, and a resumed experiment's search space against the one it was run with.

A mistake found here is one error before anything runs (and before the experiment is written to
the store), instead of the same failure in every trial.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any, Iterator, Mapping

from ..errors import InvalidSample, TridensError
from ..evaluators import Evaluator
from ..space import BaseSpace, Categorical, SearchSpace
from ..strategy import Strategy
from ..trial import Objective

__all__ = ["SpaceChanged", "check_before_run", "check_same_space", "describe_space", "explain_failure", "fill_max_steps"]

# Candidates tried per label: every categorical candidate (up to this many), and both bounds of a range.
_MAX_CANDIDATES = 64


class SpaceChanged(TridensError):
    """A resumed experiment's search space differs from the one its trials were run with."""


def fill_max_steps(strategy: Strategy, evaluator: Evaluator) -> None:
    """A multi-fidelity strategy built without ``max_steps`` (``strategy="asha"``) trains trials
    for the evaluator's ``epochs``: the most steps a trial can take."""
    if getattr(strategy, "max_steps", 0) is not None:
        return
    epochs = getattr(evaluator, "epochs", None)
    if isinstance(epochs, int) and not isinstance(epochs, bool) and epochs >= 1:
        strategy.max_steps = epochs  # type: ignore[attr-defined]


def _evaluator_samples(space: SearchSpace) -> Iterator[dict[str, Any]]:
    """The default sample, then each candidate (each bound of a range) of each label in turn."""
    base = space.default_sample()
    yield base
    for label, spec in space.items():
        domain = spec.domain
        if isinstance(domain, Categorical):
            values = domain.values()[:_MAX_CANDIDATES]
        else:  # a range: both bounds (a randint's are both inclusive)
            values = [getattr(domain, "low", None), getattr(domain, "high", None)]
        for value in values:
            if value is not None and value != base.get(label) and spec.active(base):
                yield {**base, label: value}


def _check_evaluator(evaluator: Evaluator, objective: Objective) -> None:
    """Every candidate of the evaluator's hyperparameters gives valid settings (optimizer,
    schedule, metric names...), and the objective's metric is one the evaluator reports."""
    config = getattr(evaluator, "config", None)
    if callable(config):
        cfg = None
        for sample in _evaluator_samples(evaluator.search_space()):
            cfg = config(sample)
        reported = [*getattr(cfg, "metrics", ()), "train_loss"]
        if cfg is not None and objective.metric not in reported:
            raise TridensError(f"The 'objective' of the experiment is {objective.metric!r}, which "
                               f"{type(evaluator).__name__} does not report; it reports {reported!r}.")
        return
    check = getattr(evaluator, "_check", None)
    if callable(check):
        check()


def check_before_run(space: BaseSpace, evaluator: Evaluator, strategy: Strategy, objective: Objective,
                     seed: int) -> SearchSpace:
    """Validate the evaluator's settings and the strategy's against the merged search space;
    returns that space. Raises the evaluator's or strategy's one-line error.

    >>> check_before_run(space, evaluator, td.strategy.ASHA(), evaluator.objective, 0)  # doctest: +SKIP
    """
    search_space = space.search_space().merged(evaluator.search_space())
    _check_evaluator(evaluator, objective)
    # Constructors only store parameters, so a copy is cheap; the run starts the strategy itself.
    try:
        copy.deepcopy(strategy).start(search_space, objective, random.Random(seed), ())
    except ValueError as err:
        if getattr(strategy, "max_steps", 0) is not None or "'max_steps'" not in str(err):
            raise
        kind = type(strategy).__name__  # no max_steps given, and no fixed epochs to take it from
        raise ValueError(f"{err} {type(evaluator).__name__} has no fixed 'epochs' to take it from: pass "
                         f"td.strategy.{kind}(max_steps=N), N being the most steps (td.report calls) a trial "
                         "makes.") from None
    return search_space


def describe_space(search_space: SearchSpace) -> dict[str, Any]:
    """The search space as JSON (labels, domains, conditions), as the store records it."""
    return json.loads(json.dumps(search_space.describe(), sort_keys=True, default=repr))


def check_same_space(name: str, recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """Raise :class:`SpaceChanged` when ``current`` (from :func:`describe_space`) differs from the
    space an experiment ``name`` recorded (nothing is checked when it recorded none)."""
    if recorded is None or dict(recorded) == dict(current):
        return
    added = sorted(set(current) - set(recorded))
    removed = sorted(set(recorded) - set(current))
    changed = sorted(k for k in set(current) & set(recorded) if current[k] != recorded[k])
    parts = [f"{what} {', '.join(map(repr, labels))}" for what, labels in
             (("new label", added), ("removed label", removed), ("changed label", changed)) if labels]
    raise SpaceChanged(f"experiment {name!r} was run with another search space ({'; '.join(parts)}): "
                       f"give this search a new name=, or pass resume='force' to add its trials to {name!r}")


def explain_failure(space: BaseSpace, sample: Mapping[str, Any], error: str | None) -> str | None:
    """A failed trial's error, with the message ``space.freeze`` gives when the sample's shapes
    don't fit the space's example inputs (the layer that failed) as its last line."""
    if error is None or space.example_inputs is None or "InvalidSample" in error:
        return error
    try:
        space.freeze(space.restrict(sample))
    except InvalidSample as err:
        return f"{error.rstrip()}\nInvalidSample: {err}"
    except Exception:  # another failure: the trial's own error says it
        return error
    return error
