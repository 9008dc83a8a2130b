"""``FunctionalEvaluator``: the user's own training loop, and ``td.report`` that it calls.

``td.report`` finds the running trial through one :mod:`contextvars` variable that
:meth:`FunctionalEvaluator.evaluate` sets around the call of the user's function and resets after
it; outside any trial it warns and does nothing. (Threads the function starts do not inherit the
variable: report from the thread that ``evaluate`` called, or run the thread in
``contextvars.copy_context()``.)
"""

from __future__ import annotations

import contextlib
import copy
import contextvars
import inspect
import warnings
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn

from ..trial import Decision, Objective
from ._base import Evaluator, NullReporter, Reporter
from ._errors import InvalidParameter, NothingReported, TrialStopped
from ._params import Interval, Options, Satisfies, check

__all__ = ["FunctionalEvaluator", "report"]

_DEFAULT_METRIC = "value"


class _Sink:
    """Routes one trial's ``td.report`` calls to its reporter."""

    def __init__(self, reporter: Reporter, metric: str | None, max_steps: int | None, first: str | None = None):
        self.reporter, self.metric, self.max_steps = reporter, metric, max_steps
        self.first = first  # the experiment's objective: reported first where present
        self.last: float | None = None
        self.next_step = 0
        self.reports = 0
        self.stopped = False

    def metrics_of(self, value: Any, where: str) -> dict[str, float]:
        """``{objective name: objective value, other metrics...}`` from a number (named
        ``metric``, else ``"value"``) or a dict (its first key is the objective unless ``metric`` names it)."""
        name = self.metric or self.first or _DEFAULT_METRIC
        if isinstance(value, Mapping):
            if not value:
                raise InvalidParameter(f"{where} got an empty dict; report a number or a dict of metrics")
            metrics = {str(k): _number(v, f"{where} metric {k!r}") for k, v in value.items()}
            if self.metric is None:
                if self.first in metrics:
                    return {self.first: metrics[self.first], **metrics}
                return metrics  # (the engine refuses an objective that is not reported, at the first report)
            if self.metric not in metrics:
                raise InvalidParameter(f"{where} got metrics {sorted(metrics)} without the objective metric "
                                       f"{self.metric!r} (the evaluator's 'metric' parameter)")
            return {self.metric: metrics[self.metric], **metrics}
        return {name: _number(value, where)}

    def report(self, value: Any, step: int | None) -> None:
        if self.stopped:
            raise TrialStopped("the strategy already stopped this trial; return from the training function")
        if step is None:
            step = self.next_step
        elif not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidParameter(f"The 'step' parameter of tridens.report must be None or an int in the range "
                                   f"[0, inf). Got {step!r} instead.")
        metrics = self.metrics_of(value, "tridens.report()")
        self.last = next(iter(metrics.values()))
        self.next_step = step + 1
        self.reports += 1
        decision = self.reporter.report(step, metrics)
        if decision is Decision.STOP or (self.max_steps is not None and self.reports >= self.max_steps):
            self.stopped = True
            raise TrialStopped(f"trial stopped after step {step}")


_SINK: contextvars.ContextVar[_Sink | None] = contextvars.ContextVar("tridens_report_sink", default=None)


def _number(value: Any, where: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        import numpy as np
        if isinstance(value, np.generic) and value.size == 1:
            return float(value)
    except ImportError:  # pragma: no cover
        pass
    raise InvalidParameter(f"{where} needs a number (or a dict of numbers). Got {value!r} instead.")


def report(value: float | Mapping[str, float], step: int | None = None) -> None:
    """Report an intermediate result of the running trial from a :class:`FunctionalEvaluator` loop.

    ``value`` is the objective's value, or a dict of metrics whose objective is the first key
    (or the evaluator's ``metric=``). ``step`` (0-based) defaults to one past the previous report.
    If the strategy stops the trial, this raises :class:`TrialStopped`, which the evaluator
    catches: don't catch it in the loop. Outside any trial it warns and does nothing.

    >>> import tridens as td
    >>> def train(model, lr):
    ...     for epoch in range(3):
    ...         td.report({"val_acc": 0.5 + epoch * lr, "loss": 1.0 - epoch * lr}, step=epoch)
    >>> td.evaluators.FunctionalEvaluator(train, lr=0.25).evaluate(None, {}, seed=0)
    1.0
    """
    sink = _SINK.get()
    if sink is None:
        warnings.warn("tridens.report() was called outside a trial (no evaluator is running it); "
                      f"the value {value!r} is ignored", RuntimeWarning, stacklevel=2)
        return
    sink.report(value, step)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class FunctionalEvaluator(Evaluator):
    """Evaluate with the user's own loop: ``fn(model, **hparams)``, or ``fn(**hparams)`` when every
    parameter of ``fn`` is a hyperparameter (a search with no model space, ``td.Experiment(None,
    FunctionalEvaluator(fn, lr=td.loguniform("lr", 1e-4, 1e-1)))``, where ``fn`` builds its own model).

    ``hparams`` are ``params`` with every ``td.choice`` placeholder resolved from the trial's
    sample (plus ``seed=`` when ``fn`` has a ``seed`` parameter that ``params`` don't set).
    ``fn`` reports with :func:`tridens.report`; the trial's final value is what ``fn`` returns,
    else its last report. ``torch.manual_seed(seed)`` is set for the call (the caller's random
    state is restored afterwards). ``metric`` names the objective (default: the first key of
    reported dicts, or ``"value"`` for reported numbers; a run records the name from the first
    report) and ``mode`` is ``"max"`` or ``"min"``.

    >>> import tridens as td
    >>> def train(model, lr, epochs):
    ...     acc = 0.0
    ...     for epoch in range(epochs):
    ...         acc += lr                 # a real loop trains `model` here
    ...         td.report(acc)
    ...     return acc
    >>> ev = td.evaluators.FunctionalEvaluator(train, lr=td.choice("lr", [0.1, 0.2]), epochs=2)
    >>> ev.evaluate(None, {"lr": 0.2}, seed=0)
    0.4
    """

    def __init__(self, fn: Callable[..., Any], *, metric: str | None = None, mode: str = "max", **params: Any):
        self.fn = fn
        self.metric = metric
        self.mode = mode
        self.hparams = params
        self._objective: str | None = None  # set by for_objective

    def params(self) -> dict[str, Any]:
        return {"fn": self.fn, "metric": self.metric, "mode": self.mode, **self.hparams}

    @property
    def objective(self) -> Objective:
        """The objective: ``metric`` (``"value"`` until a report names it) and ``mode``."""
        return Objective(self.metric or _DEFAULT_METRIC, self.mode)

    @property
    def objective_from_reports(self) -> bool:  # type: ignore[override]
        """With no ``metric`` given, the first report names the objective (a dict's first key)."""
        return self.metric is None

    def for_objective(self, metric: str) -> "FunctionalEvaluator":
        """A copy whose reports put ``metric`` first when they hold it (the trial's value is then
        that metric's, never a dict's first key), and name a reported number ``metric``."""
        if self.metric is not None:
            return self
        other = copy.copy(self)
        other._objective = metric
        return other

    def _check(self) -> None:
        check(type(self).__name__, {"fn": self.fn, "metric": self.metric, "mode": self.mode}, {
            "fn": [Satisfies(callable, "a callable fn(model, **hparams)")],
            "metric": [Satisfies(lambda v: v is None or (isinstance(v, str) and v != ""), "None or a metric name")],
            "mode": [Options(["max", "min"])],
        })

    def evaluate(self, model: nn.Module | None, sample: Mapping[str, Any], seed: int,
                 reporter: Reporter | None = None, *, max_steps: int | None = None) -> float | None:
        """Call ``fn`` with the sample's hyperparameters and return the trial's final value.

        Raises :class:`NothingReported` when ``fn`` neither reported nor returned a value.
        """
        self._check()
        check(type(self).__name__, {"max_steps": max_steps}, {
            "max_steps": [Satisfies(lambda v: v is None, "None"), Interval("int", 1, None)]})
        hparams = self.resolved(sample)
        for name in ("fn", "metric", "mode"):
            hparams.pop(name)
        if "seed" not in hparams and _accepts(self.fn, "seed"):
            hparams["seed"] = seed
        sink = _Sink(reporter if reporter is not None else NullReporter(), self.metric, max_steps,
                     self._objective)
        result: Any = None
        token = _SINK.set(sink)
        try:
            with _seeded(seed):
                result = self.fn(model, **hparams) if _takes_model(self.fn, hparams) else self.fn(**hparams)
        except TrialStopped:
            if not sink.stopped:
                raise
            result = None
        finally:
            _SINK.reset(token)
        if result is not None and not sink.stopped:
            return next(iter(sink.metrics_of(result, f"the value returned by {_name(self.fn)}").values()))
        if sink.last is not None:
            return sink.last
        raise NothingReported(
            f"the evaluator reported nothing: {_name(self.fn)} returned None and never called tridens.report(); "
            "report with td.report(value) in the loop or return the final metric")


def _takes_model(fn: Callable[..., Any], hparams: Mapping[str, Any]) -> bool:
    """Whether ``fn`` takes the model as its first argument: it has a required positional
    parameter the hyperparameters don't fill (or ``*args``, or a signature Python cannot read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return True
        if (p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                and p.name not in hparams and p.default is inspect.Parameter.empty):
            return True
    return False


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return p is not None and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__qualname__', None) or repr(fn)}()"
