"""The median stopping rule (Golovin et al., "Google Vizier", KDD 2017), as a wrapper."""

from __future__ import annotations

import math
import random
import statistics
from typing import Sequence

from ..space import SearchSpace
from ..trial import Decision, Objective, Trial, TrialGroup
from ._base import Strategy
from ._common import check_int, curve_of

__all__ = ["MedianStopping"]


class MedianStopping(Strategy):
    """Wraps a proposing strategy and adds early stopping (decorator pattern: what to try next
    stays ``base``'s business, whether a running trial continues is this rule's).

    After step ``t`` (0-based, ``t >= grace_steps``) a trial is stopped when its best value so far
    is worse than the median, over the other trials that reached step ``t``, of their running
    averages ``mean(values[0..t])``; at least ``min_trials`` such trials are needed. Other trials
    include finished ones, the history of a resumed search, and, when the engine trains a group in
    lockstep, the group's other trials at the same step. ``base`` (default: ``Random()``) is also
    asked: its ``STOP`` wins. ``ask`` and the groups are ``base``'s.
    """

    def __init__(self, base: Strategy | None = None, grace_steps: int = 1, min_trials: int = 3):
        self.base = base
        self.grace_steps = grace_steps
        self.min_trials = min_trials

    def _check(self) -> None:
        if self.base is not None and not isinstance(self.base, Strategy):
            raise ValueError(f"The 'base' parameter of MedianStopping must be a Strategy or None. "
                             f"Got {self.base!r} instead.")
        if isinstance(self.base, MedianStopping):
            raise ValueError("The 'base' parameter of MedianStopping must not be another MedianStopping.")
        check_int("MedianStopping", "grace_steps", self.grace_steps, 0)
        check_int("MedianStopping", "min_trials", self.min_trials, 1)

    def start(self, space: SearchSpace, objective: Objective, rng: random.Random,
              history: Sequence[Trial] = ()) -> None:
        from ._random import Random

        self._check()
        self.space, self.objective, self.rng = space, objective, rng
        self._base = self.base if self.base is not None else Random()
        self._curves: dict[int, list[float]] = {}
        self._stopped: set[int] = set()
        for trial in history:
            self._curves[trial.id] = curve_of(trial, objective)
        self._base.start(space, objective, rng, history)

    def objective_named(self, objective: Objective) -> None:
        self.objective = objective
        self._base.objective_named(objective)

    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        if not hasattr(self, "_base"):
            raise RuntimeError("MedianStopping.start(space, objective, rng) must be called before ask()")
        return self._base.ask(remaining)

    def report(self, trial: Trial, step: int, value: float) -> None:
        curve = self._curves.setdefault(trial.id, [])
        while len(curve) <= step:
            curve.append(math.nan)
        curve[step] = float(value) if value is not None else math.nan
        self._base.report(trial, step, value)

    def tell(self, trial: Trial) -> None:
        recorded = curve_of(trial, self.objective)
        if recorded or trial.id not in self._curves:
            self._curves[trial.id] = recorded
        self._base.tell(trial)

    def decide(self, trial: Trial, step: int) -> Decision:
        if self._base.decide(trial, step) is Decision.STOP or trial.id in self._stopped:
            self._stopped.add(trial.id)
            return Decision.STOP
        if step < self.grace_steps:
            return Decision.CONTINUE
        mine = [v for v in self._curves.get(trial.id, [])[:step + 1] if not math.isnan(v)]
        if not mine:
            return Decision.CONTINUE
        best = max(mine, key=self.objective.score)
        averages = []
        for tid, curve in self._curves.items():
            if tid == trial.id or len(curve) <= step:
                continue
            prefix = curve[:step + 1]
            if not any(math.isnan(v) for v in prefix):
                averages.append(sum(prefix) / len(prefix))
        if len(averages) < self.min_trials:
            return Decision.CONTINUE
        if self.objective.better(statistics.median(averages), best):
            self._stopped.add(trial.id)
            return Decision.STOP
        return Decision.CONTINUE
