"""The evaluator interface, the reporter it talks to, and the step-wise trainer protocol."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

import torch.nn as nn

from ..errors import TridensError
from ..space import labels_in, resolve_value
from ..space import SearchSpace
from ..trial import Decision, Objective

__all__ = ["Reporter", "NullReporter", "RecordingReporter", "Trainer", "Evaluator", "StepwiseEvaluator"]


@runtime_checkable
class Reporter(Protocol):
    """Where an evaluator sends intermediate results; the engine implements it.

    ``step`` is 0-based (the epoch for the declarative evaluators). ``metrics`` maps a metric
    name to its value and always holds the evaluator's objective metric, as its first item (an
    evaluator whose ``objective_from_reports`` is true names its objective by that first item).
    The answer is :attr:`Decision.STOP` when the strategy wants the trial stopped; the
    evaluator then stops training and returns the objective's last value.
    """

    def report(self, step: int, metrics: Mapping[str, float]) -> Decision: ...


class NullReporter:
    """Discards every report and always answers CONTINUE (what ``evaluate(..., reporter=None)`` uses)."""

    def report(self, step: int, metrics: Mapping[str, float]) -> Decision:
        return Decision.CONTINUE


class RecordingReporter:
    """Keeps every report; answers STOP once ``stop_after`` reports were made (never by default).

    >>> r = RecordingReporter(stop_after=2)
    >>> r.report(0, {"val_acc": 0.5}), r.report(1, {"val_acc": 0.6})
    (<Decision.CONTINUE: 'continue'>, <Decision.STOP: 'stop'>)
    >>> r.metrics
    {'val_acc': [0.5, 0.6]}
    """

    def __init__(self, stop_after: int | None = None):
        self.stop_after = stop_after
        self.history: list[tuple[int, dict[str, float]]] = []

    def report(self, step: int, metrics: Mapping[str, float]) -> Decision:
        self.history.append((step, dict(metrics)))
        if self.stop_after is not None and len(self.history) >= self.stop_after:
            return Decision.STOP
        return Decision.CONTINUE

    @property
    def metrics(self) -> dict[str, list[float]]:
        """Metric name -> its values in report order (the shape of ``Trial.metrics``)."""
        out: dict[str, list[float]] = {}
        for _, values in self.history:
            for name, value in values.items():
                out.setdefault(name, []).append(value)
        return out

    @property
    def steps(self) -> list[int]:
        return [step for step, _ in self.history]


@runtime_checkable
class Trainer(Protocol):
    """One trial's training, advanced an epoch at a time by its driver (the engine or ``evaluate``).

    ``epoch`` counts the epochs trained so far and ``epochs`` is the budget. ``state_dict()``
    captures everything needed to continue identically (model, optimizer, schedule position,
    epoch, random state); ``load_state_dict`` restores it into a trainer built with the same
    evaluator, sample and seed.
    """

    epoch: int

    @property
    def epochs(self) -> int: ...

    def train_epoch(self) -> dict[str, float]: ...

    def validate(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Evaluator:
    """Says how a model is trained and scored.

    Constructors only store their parameters (any of which may be a ``td.choice`` placeholder);
    work and validation happen in :meth:`evaluate`. ``needs_model`` tells the engine whether
    :meth:`evaluate` uses the model at all (a table lookup does not).

    >>> import tridens as td
    >>> ev = td.evaluators.FunctionalEvaluator(lambda model, lr: lr, lr=td.choice("lr", [0.1, 0.2]))
    >>> list(ev.search_space())
    ['lr']
    """

    needs_model: bool = True
    objective_from_reports: bool = False
    """Whether the objective's metric is named by the first key of what the evaluator reports
    (a user's loop reporting dicts), not known before the first report: the engine records the
    name it learns there."""

    def params(self) -> dict[str, Any]:
        """The constructor's parameters, as given (placeholders unresolved)."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def search_space(self) -> SearchSpace:
        """The hyperparameter labels found among the parameters."""
        return labels_in(self.params())

    def resolved(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters with every placeholder replaced by its value in ``sample``."""
        return resolve_value(self.params(), sample)

    @property
    def objective(self) -> Objective:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def fast_dev_run(self) -> bool:
        """Whether the evaluator only checks that the code runs (Lightning's ``fast_dev_run``: one
        batch of training and one of validation). A one-shot search under such an evaluator scores
        only its strategy's export (DARTS' argmax), as its result.

        >>> import tridens as td
        >>> td.evaluators.FunctionalEvaluator(lambda model: 0.5).fast_dev_run
        False
        """
        return False

    def for_objective(self, metric: str) -> "Evaluator":
        """This evaluator for an experiment whose objective is ``metric``: one whose reports name
        their metrics by what they compute returns itself (the default); a user's loop reporting
        dicts returns a copy that reports ``metric`` first (:class:`FunctionalEvaluator`)."""
        return self

    def evaluate(self, model: nn.Module | None, sample: Mapping[str, Any], seed: int,
                 reporter: Reporter | None = None, *, max_steps: int | None = None) -> float | None:
        """Train and score ``model`` under ``sample``'s hyperparameters; return the objective's
        final (or, when stopped, last) value. ``max_steps`` caps the steps (epochs) trained."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


class StepwiseEvaluator(Evaluator):
    """An evaluator whose training the driver advances one epoch at a time through a :class:`Trainer`.

    :meth:`evaluate` is the plain driver: train an epoch, validate, report, obey STOP.
    """

    def trainer(self, model: nn.Module | None, sample: Mapping[str, Any], seed: int) -> Trainer:  # pragma: no cover
        raise NotImplementedError

    def trial_info(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """What the engine records in the trial's ``info`` about how it is trained (e.g. its
        ``precision``) before it trains; nothing by default."""
        return {}

    def evaluate(self, model: nn.Module | None, sample: Mapping[str, Any], seed: int,
                 reporter: Reporter | None = None, *, max_steps: int | None = None) -> float | None:
        trainer = self.trainer(model, sample, seed)
        return drive(trainer, self.objective, reporter, max_steps=max_steps)


def drive(trainer: Trainer, objective: Objective, reporter: Reporter | None = None, *,
          max_steps: int | None = None) -> float | None:
    """Run ``trainer`` from its current epoch to its budget (or ``max_steps`` epochs in all),
    reporting ``{objective, validation metrics..., train metrics...}`` after each epoch.

    Returns the objective's last value (``None`` when no epoch was left to train).
    """
    reporter = reporter if reporter is not None else NullReporter()
    limit = trainer.epochs if max_steps is None else min(trainer.epochs, max_steps)
    last: float | None = None
    while trainer.epoch < limit:
        step = trainer.epoch
        metrics = trainer.train_epoch()
        metrics = {**trainer.validate(), **metrics}
        if objective.metric not in metrics:
            raise TridensError(f"the objective metric {objective.metric!r} is not among the metrics "
                               f"{sorted(metrics)} that {type(trainer).__name__} produced")
        metrics = {objective.metric: metrics[objective.metric], **metrics}
        last = float(metrics[objective.metric])
        if reporter.report(step, metrics) is Decision.STOP:
            break
    return last


def _short(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."

