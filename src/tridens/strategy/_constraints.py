"""Constraints on measured facts of a model, and the Pareto front of several objectives.

The engine measures ``trial.info["params"]``, ``["flops"]`` and ``["latency_ms"]`` before
training a model; a trial that violates a :class:`Constraint` is told to the strategy as
``FAILED`` with :meth:`Constraint.violation` as its error, without being trained. Strategies
treat it like any failure (no value: evolution never picks it as a parent, TPE ranks it worst so
it learns to avoid the region). Strategies and users can check trials themselves with
:meth:`Constraint.satisfied`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..trial import Objective, Trial, TrialStatus

__all__ = ["Constraint", "pareto_front"]

#: Names that stand for another ``trial.info`` key.
_ALIASES = {"latency": "latency_ms"}


def _info_key(name: str) -> str:
    return _ALIASES.get(name, name)


@dataclass(frozen=True)
class Constraint:
    """``min <= info[key] <= max`` for a measured fact of a model.

    ``metric`` is a ``trial.info`` key: ``"params"``, ``"flops"``, ``"latency"`` (read from
    ``info["latency_ms"]``) or any other key the engine or an evaluator fills.

    >>> c = Constraint("params", max=1e5)
    >>> c.satisfied({"params": 50_000}), c.violation({"params": 250_000})
    (True, 'params = 250000 violates params <= 100000')
    """

    metric: str
    max: float | None = None
    min: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"The 'metric' parameter of Constraint must be a non-empty str. Got {self.metric!r} instead.")
        for name in ("max", "min"):
            bound = getattr(self, name)
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                      or math.isnan(bound)):
                raise ValueError(f"The {name!r} parameter of Constraint must be a number or None. Got {bound!r} instead.")
        if self.max is None and self.min is None:
            raise ValueError(f"Constraint({self.metric!r}) needs a bound: give max=..., min=... or both.")
        if self.max is not None and self.min is not None and not self.min <= self.max:
            raise ValueError(f"`min <= max` must hold for Constraint({self.metric!r}), "
                             f"but got (min={self.min!r}, max={self.max!r}).")

    @property
    def key(self) -> str:
        """The ``trial.info`` key this constraint reads."""
        return _info_key(self.metric)

    def value(self, trial_or_info: Trial | Mapping[str, Any]) -> float:
        info = trial_or_info.info if isinstance(trial_or_info, Trial) else trial_or_info
        if self.key not in info or info[self.key] is None:
            raise KeyError(f"constraint {self} needs info[{self.key!r}], which was not measured "
                           f"(info has: {', '.join(sorted(info)) or 'nothing'})")
        return float(info[self.key])

    def satisfied(self, trial_or_info: Trial | Mapping[str, Any]) -> bool:
        """Does the trial (or its ``info``) meet the bound? Raises ``KeyError`` when unmeasured."""
        v = self.value(trial_or_info)
        return not math.isnan(v) and (self.max is None or v <= self.max) and (self.min is None or v >= self.min)

    def violation(self, trial_or_info: Trial | Mapping[str, Any]) -> str | None:
        """``None`` when satisfied, else the error message the engine gives the failed trial."""
        if self.satisfied(trial_or_info):
            return None
        return f"{self.metric} = {_num(self.value(trial_or_info))} violates {self}"

    def __str__(self) -> str:
        if self.min is not None and self.max is not None:
            return f"{_num(self.min)} <= {self.metric} <= {_num(self.max)}"
        if self.max is not None:
            return f"{self.metric} <= {_num(self.max)}"
        return f"{self.metric} >= {_num(self.min)}"


def _num(v: float | None) -> str:
    if v is not None and float(v).is_integer() and abs(v) < 1e16:
        return str(int(v))
    return repr(v)


def _objectives(objectives: Sequence[Objective | tuple[str, str]]) -> list[Objective]:
    if isinstance(objectives, (Objective, str)) or not objectives:
        raise ValueError("pareto_front needs a list of objectives, e.g. "
                         "[Objective('val_acc', 'max'), Objective('params', 'min')]")
    return [o if isinstance(o, Objective) else Objective(*o) for o in objectives]


def _objective_value(trial: Trial, name: str) -> float | None:
    """``trial.info[name]`` (measured facts), else the last value of ``trial.metrics[name]``."""
    for key in (name, _info_key(name)):
        if key in trial.info and trial.info[key] is not None:
            return float(trial.info[key])
    values = trial.metrics.get(name)
    if values:
        return float(values[-1])
    return None


def pareto_front(trials: Sequence[Trial], objectives: Sequence[Objective | tuple[str, str]]) -> list[Trial]:
    """The trials no other trial dominates, in their given order.

    Each objective is an :class:`~tridens.Objective` (or a ``(name, "max"|"min")`` pair) naming a
    metric (last value of ``trial.metrics[name]``) or a measured fact (``trial.info[name]``;
    ``"latency"`` reads ``latency_ms``). Only completed and early-stopped trials with a value for
    every objective take part. A trial dominates another if it is at least as good on every
    objective and better on one; trials with equal values do not dominate each other.

    >>> a = Trial(0, {}, 0, TrialStatus.COMPLETED, metrics={"acc": [0.9]}, info={"params": 100})
    >>> b = Trial(1, {}, 0, TrialStatus.COMPLETED, metrics={"acc": [0.8]}, info={"params": 200})
    >>> [t.id for t in pareto_front([a, b], [("acc", "max"), ("params", "min")])]
    [0]
    """
    objs = _objectives(objectives)
    points: list[tuple[Trial, list[float]]] = []
    for trial in trials:
        if trial.status not in (TrialStatus.COMPLETED, TrialStatus.STOPPED):
            continue
        values = [_objective_value(trial, o.metric) for o in objs]
        if any(v is None or math.isnan(v) for v in values):
            continue
        points.append((trial, [o.score(v) for o, v in zip(objs, values)]))

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x >= y for x, y in zip(a, b)) and any(x > y for x, y in zip(a, b))

    return [t for t, p in points if not any(dominates(q, p) for _, q in points)]


def best_first(trials: Sequence[Trial], objective: Objective,
               second_objective: Objective | tuple[str, str] | None = None) -> list[Trial]:
    """The finished trials (completed or early-stopped, with a value) best first by ``objective``,
    ties by id. With ``second_objective`` the Pareto front of the two comes first, ordered by the
    objective, then the others. What ``Experiment.top`` and ``tridens top`` show. Subnets a one-shot
    run scored with the supernet's weights (``role == "supernet-scored"``) come after every trained
    model: their value is a proxy, not comparable with a model trained from scratch.

    >>> a = Trial(0, {}, 0, TrialStatus.COMPLETED, metric=0.8)
    >>> b = Trial(1, {}, 0, TrialStatus.STOPPED, metric=0.9)
    >>> [t.id for t in best_first([a, b, Trial(2, {}, 0, TrialStatus.FAILED)], Objective("val_acc", "max"))]
    [1, 0]
    """
    scored = [t for t in trials if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED)
              and t.metric is not None and not math.isnan(t.metric)]
    scored.sort(key=lambda t: (-objective.score(t.metric), t.id))  # type: ignore[arg-type]
    trained = [t for t in scored if t.role != "supernet-scored"]
    proxies = [t for t in scored if t.role == "supernet-scored"]
    if second_objective is None:
        return trained + proxies
    out: list[Trial] = []
    for tier in (trained, proxies):
        front = pareto_front(tier, [objective, second_objective])
        front_ids = {t.id for t in front}
        out += front + [t for t in tier if t.id not in front_ids]
    return out
