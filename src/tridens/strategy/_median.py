"""The median stopping rule with the semantics of Optuna's ``MedianPruner``.

After step ``t`` (0-based, as ``td.report``'s steps) a trial is stopped when the best value it
reported so far is worse than the median of the values that *completed* trials reported at step
``t`` -- exactly what ``optuna.pruners.MedianPruner`` decides, parameter for parameter:

* ``n_startup_trials``: nothing is stopped until that many trials completed (the history of a
  resumed search included). Trials that were stopped, failed or are still running never count,
  so the first group the engine trains in lockstep runs in full.
* ``n_warmup_steps``: nothing is stopped at steps below it; the earliest stop is after step
  ``n_warmup_steps``.
* ``interval_steps``: a trial is judged at steps ``n_warmup_steps + k * interval_steps``; a check
  that falls on a step without a report happens at the next reported step.
* ``n_min_trials``: a step with fewer completed trials' values than that stops nothing.

A trial whose reports so far are all NaN is stopped; NaN values of completed trials are left out
of the median. Decisions are final: a stopped trial stays stopped.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..trial import Decision, Trial, TrialGroup, TrialStatus
from ._common import SearchBase, cap, check_int, curve_of

__all__ = ["MedianStopping"]


class MedianStopping(SearchBase):
    """Optuna's ``MedianPruner`` as a stopping rule (see the module docstring).

    Pass it to a proposing strategy, as Optuna passes a pruner beside a sampler::

        td.strategy.TPE(stopping=td.strategy.MedianStopping(n_startup_trials=5, n_warmup_steps=2))

    On its own (``strategy=td.strategy.MedianStopping()``) it proposes random samples,
    ``batch_size`` per group, and stops them by the same rule.

    >>> MedianStopping(n_warmup_steps=2).params()["interval_steps"]
    1
    """

    def __init__(self, n_startup_trials: int = 5, n_warmup_steps: int = 0, interval_steps: int = 1,
                 n_min_trials: int = 1, batch_size: int = 8):
        self.n_startup_trials = n_startup_trials
        self.n_warmup_steps = n_warmup_steps
        self.interval_steps = interval_steps
        self.n_min_trials = n_min_trials
        self.batch_size = batch_size

    def _check(self) -> None:
        check_int("MedianStopping", "n_startup_trials", self.n_startup_trials, 0)
        check_int("MedianStopping", "n_warmup_steps", self.n_warmup_steps, 0)
        check_int("MedianStopping", "interval_steps", self.interval_steps, 1)
        check_int("MedianStopping", "n_min_trials", self.n_min_trials, 1)
        check_int("MedianStopping", "batch_size", self.batch_size, 1)

    def as_stopping(self) -> MedianStopping:
        return self

    def _setup(self) -> None:
        self._reported: dict[int, dict[int, float]] = {}     # running trial id -> step -> value
        self._completed: dict[int, dict[int, float]] = {}    # completed trial id -> step -> value
        self._stopped: set[int] = set()

    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        self._require_started()
        return self._group(self._propose_random(cap(self.batch_size, remaining)), "median")

    def report(self, trial: Trial, step: int, value: float) -> None:
        super().report(trial, step, value)
        self._reported.setdefault(trial.id, {})[step] = math.nan if value is None else float(value)

    def _observe(self, trial: Trial, key: str | None) -> None:
        self._reported.pop(trial.id, None)
        if trial.status is TrialStatus.COMPLETED:
            curve = curve_of(trial, self.objective)
            self._completed[trial.id] = {s: v for s, v in enumerate(curve) if not math.isnan(v)}

    def decide(self, trial: Trial, step: int) -> Decision:
        if trial.id in self._stopped:
            return Decision.STOP
        if self._prune(self._reported.get(trial.id, {}), step):
            self._stopped.add(trial.id)
            return Decision.STOP
        return Decision.CONTINUE

    def _prune(self, values: dict[int, float], step: int) -> bool:
        completed = len(self._completed)
        if completed == 0 or completed < self.n_startup_trials or step not in values:
            return False
        if step < self.n_warmup_steps:
            return False
        # the first reported step at or after each check point (warm-up + k * interval) is judged
        check_point = (step - self.n_warmup_steps) // self.interval_steps * self.interval_steps + self.n_warmup_steps
        previous = max((s for s in values if s != step), default=-1)
        if previous >= check_point:
            return False
        mine: Any = np.asarray([values[s] for s in values if s <= step], dtype=float)
        if np.isnan(mine).all():
            return True
        best = float(np.nanmax(mine) if self.objective.mode == "max" else np.nanmin(mine))
        others = [curve[step] for curve in self._completed.values() if step in curve]
        if len(others) < self.n_min_trials:
            return False
        median = float(np.nanpercentile(np.asarray(others, dtype=float), 50.0))
        return not math.isnan(median) and self.objective.better(median, best)
