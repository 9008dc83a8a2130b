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
from typing import Any, Iterator, Mapping, Sequence

from ..errors import InvalidSample, TridensError, UnknownMetric
from ..evaluators import Evaluator
from ..space import BaseSpace, Categorical, SearchSpace
from ..strategy import Strategy
from ..trial import Objective, Trial

__all__ = ["SpaceChanged", "EvaluatorChanged", "check_same_evaluator", "MEASURED", "check_reported_names", "check_names", "check_evaluator", "check_before_run", "check_same_space", "describe_space", "explain_failure", "fill_max_steps"]

# Candidates tried per label: every categorical candidate (up to this many), and both bounds of a range.
_MAX_CANDIDATES = 64


class SpaceChanged(TridensError):
    """A resumed experiment's search space differs from the one its trials were run with."""


MEASURED = ("params", "flops", "latency", "latency_ms")
"""The facts of a model tridens measures before training it (``trial.info``): what a
:class:`~tridens.strategy.Constraint` can bound, and a second objective can name besides a metric."""


def _second_name(second_objective: Any) -> str | None:
    if second_objective is None:
        return None
    return second_objective.metric if isinstance(second_objective, Objective) else str(second_objective[0])


def check_names(constraints: Any, second_objective: Any, objective: Objective, declared: list[str] | None,
                *, measured: bool = True) -> None:
    """The constraints bound facts tridens measures before training (:data:`MEASURED`; none when
    it builds no model: ``measured`` False); the second objective is one of those or a metric in
    ``declared`` (what the evaluator reports, ``None`` when only its first report will say), and
    neither repeats the objective. Raises :class:`UnknownMetric` naming the value and the valid ones.

    >>> check_names([], ("flop", "min"), Objective(), ["val_acc", "val_loss"])
    Traceback (most recent call last):
    ...
    tridens.errors.UnknownMetric: The 'second_objective' of Experiment is 'flop', which is neither a measured fact ('params', 'flops', 'latency') nor a metric the evaluator reports ('val_acc', 'val_loss').
    """
    facts = MEASURED if measured else ()
    shown = ", ".join(repr(f) for f in facts if f != "latency_ms") or "none: there is no model to measure"
    for constraint in constraints:
        key = getattr(constraint, "key", None)
        if key not in facts:
            raise UnknownMetric(f"The 'constraints' of Experiment hold {constraint!r}, which bounds "
                                f"{getattr(constraint, 'metric', key)!r}; the facts measured before training are {shown}.")
    second = _second_name(second_objective)
    if second is None or second in facts or declared is None or second in declared:
        return
    metrics = ", ".join(map(repr, declared))
    raise UnknownMetric(f"The 'second_objective' of Experiment is {second!r}, which is neither a measured fact "
                        f"({shown}) nor a metric the evaluator reports ({metrics}).")


def check_reported_names(name: str, trial: Trial, values: Mapping[str, float], objective: Objective,
                         second_objective: Any) -> None:
    """At the first report of a run whose evaluator does not declare its metrics: the objective
    (and a second objective that is no measured fact) must be among the names reported.
    Raises :class:`UnknownMetric` naming them, which stops the run; never falls back to another metric."""
    reported = ", ".join(map(repr, values)) or "nothing"
    plain = list(values) == ["value"]
    if objective.metric not in values:
        hint = (" (a number passed to td.report is named 'value': report a dict, or give "
                f"FunctionalEvaluator(metric={objective.metric!r}))" if plain else
                ": pass objective= one of them")
        raise UnknownMetric(f"The objective of experiment {name!r} is {objective.metric!r}, which its evaluator "
                            f"does not report: trial {trial.label} reported {reported}{hint}.")
    second = _second_name(second_objective)
    if second is not None and second not in MEASURED and second not in values:
        raise UnknownMetric(f"The 'second_objective' of experiment {name!r} is {second!r}, which is neither a "
                            f"measured fact ('params', 'flops', 'latency') nor a metric its evaluator reports: "
                            f"trial {trial.label} reported {reported}.")


def fill_max_steps(strategy: Strategy, evaluator: Evaluator) -> None:
    """A multi-fidelity strategy built without ``max_steps`` (``strategy="asha"``) trains trials
    for the evaluator's ``epochs``: the most steps a trial can take."""
    epochs = getattr(evaluator, "epochs", None)
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        return
    for policy in _policies(strategy):
        if getattr(policy, "max_steps", 0) is None:
            policy.max_steps = epochs


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


def _declared_metrics(evaluator: Evaluator) -> list[str] | None:
    """The metrics the evaluator reports, checking its settings for every candidate of its
    hyperparameters (optimizer, schedule, metric names...); ``None`` when only its reports say
    (a user's loop)."""
    config = getattr(evaluator, "config", None)
    if callable(config):
        cfg = None
        check_data = getattr(evaluator, "check_data", None)
        for sample in _evaluator_samples(evaluator.search_space()):
            cfg = config(sample)
            if callable(check_data):
                check_data(sample)  # labels against the loss (a dataset may be a choice too)
        return None if cfg is None else [*getattr(cfg, "metrics", ()), "train_loss"]
    check = getattr(evaluator, "_check", None)
    if callable(check):
        check()
    return None


def check_evaluator(evaluator: Evaluator, objective: Objective, *, constraints: Sequence[Any] = (),
                    second_objective: Any = None, measured: bool = True) -> None:
    """Validate the evaluator's settings (for every candidate of its hyperparameters, its data
    against its loss) and the names the objectives and constraints read: what every search,
    multi-trial or one-shot, checks before it trains. Raises a one-line error."""
    declared = _declared_metrics(evaluator)
    if declared is not None and objective.metric not in declared:
        raise UnknownMetric(f"The 'objective' of the experiment is {objective.metric!r}, which "
                            f"{type(evaluator).__name__} does not report; it reports {declared!r}.")
    check_names(constraints, second_objective, objective, declared, measured=measured)


def check_before_run(space: BaseSpace, evaluator: Evaluator, strategy: Strategy, objective: Objective,
                     seed: int, *, constraints: Sequence[Any] = (), second_objective: Any = None,
                     measured: bool = True) -> SearchSpace:
    """Validate the evaluator's settings, the names the objectives and constraints read, and the
    strategy's settings against the merged search space and the evaluator's epochs; returns that
    space. Raises the evaluator's or strategy's one-line error.

    >>> check_before_run(space, evaluator, td.strategy.ASHA(), evaluator.objective, 0)  # doctest: +SKIP
    """
    search_space = space.search_space().merged(evaluator.search_space())
    check_evaluator(evaluator, objective, constraints=constraints, second_objective=second_objective,
                    measured=measured)
    _check_steps(strategy, evaluator)
    # Constructors only store parameters, so a copy is cheap; the run starts the strategy itself.
    try:
        copy.deepcopy(strategy).start(search_space, objective, random.Random(seed), ())
    except ValueError as err:
        unset = [policy for policy in _policies(strategy) if getattr(policy, "max_steps", 0) is None]
        if not unset or "'max_steps'" not in str(err):
            raise
        kind = type(unset[0]).__name__  # no max_steps given, and no fixed epochs to take it from
        raise ValueError(f"{err} {type(evaluator).__name__} has no fixed 'epochs' to take it from: pass "
                         f"td.strategy.{kind}(max_steps=N), N being the most steps (td.report calls) a trial "
                         "makes.") from None
    return search_space


def _check_steps(strategy: Strategy, evaluator: Evaluator) -> None:
    """A multi-fidelity strategy's (or a stopping rule's) ``max_steps`` is at most the evaluator's
    fixed ``epochs``: its rungs past the last epoch would never be reached."""
    epochs = getattr(evaluator, "epochs", None)
    if not isinstance(epochs, int) or isinstance(epochs, bool):
        return
    for policy in _policies(strategy):
        steps = getattr(policy, "max_steps", None)
        if isinstance(steps, int) and not isinstance(steps, bool) and steps > epochs:
            raise ValueError(f"The 'max_steps' parameter of {type(policy).__name__} is {steps}, more than the "
                             f"evaluator's epochs={epochs}: pass max_steps in the range [1, {epochs}] "
                             "(or leave it out to take the epochs).")


def _policies(strategy: Any) -> Iterator[Any]:
    """The strategy and the policies it composes (a sampler and a stopping rule)."""
    yield strategy
    for attr in ("sampler", "stopping"):
        inner = getattr(strategy, attr, None)
        if isinstance(inner, Strategy):
            yield from _policies(inner)


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
                       f"give this search a new name=, or pass options=td.RunOptions(resume='force') to add its trials to {name!r}")


class EvaluatorChanged(SpaceChanged):
    """A resumed experiment's evaluator computes something else than the one its trials were run
    with: other settings (``epochs``), other data, other training code."""


def check_same_evaluator(name: str, recorded: Mapping[str, str] | None, current: Mapping[str, str]) -> None:
    """Raise :class:`EvaluatorChanged` when ``current`` (from
    :func:`tridens.evaluators.evaluator_fingerprint`) differs from what experiment ``name``
    recorded (nothing is checked when it recorded none), naming what changed."""
    from ..evaluators import fingerprint_changes

    if recorded is None or dict(recorded) == dict(current):
        return
    changes = fingerprint_changes(dict(recorded), dict(current))
    raise EvaluatorChanged(f"experiment {name!r} was run with another evaluator (changed: {'; '.join(changes)}), so "
                           f"its trials would not compare: give this search a new name=, or pass options=td.RunOptions(resume='force') to add "
                           f"its trials to {name!r}")


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
