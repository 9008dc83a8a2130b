"""The execution-unit protocol: trials of one group that train together, one epoch at a time.

A planner turns a TrialGroup's jobs into units. A unit may train its trials one after another
(:class:`~tridens.units.SeparateUnit`) or fused (:mod:`tridens.xopt`). Every unit answers this
protocol, so an executor's loop, the strategy's stop decisions and the store never see the
difference.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..evaluators import StepwiseEvaluator
from ..trial import Objective
from ._job import Job

__all__ = ["ExecutionUnit", "UnitResult"]

# One trial's outcome of an epoch: its metrics (objective first), or the error that failed it.
UnitResult = Mapping[str, float] | BaseException


class ExecutionUnit:
    """Trials trained together. Subclasses implement :meth:`train_epoch`, :meth:`weights`,
    :meth:`limit`, :meth:`epoch` and :meth:`_leave` (release a trial's state)."""

    kind = "unit"

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator):
        self.jobs = {job.trial.id: job for job in jobs}
        self.evaluator = evaluator
        self.objective: Objective = evaluator.objective
        self.reason = ""

    def active(self) -> list[Job]:
        """The trials still training, in their original order."""
        return list(self.jobs.values())

    def limit(self, trial_id: int) -> int:  # pragma: no cover - abstract
        """How many epochs the trial trains in all (its budget, capped by the group's max_steps)."""
        raise NotImplementedError

    def epoch(self, trial_id: int) -> int:  # pragma: no cover - abstract
        """Epochs the trial has finished."""
        raise NotImplementedError

    def train_epoch(self) -> dict[int, UnitResult]:  # pragma: no cover - abstract
        """Train one more epoch of every active trial that has epochs left, then validate."""
        raise NotImplementedError

    def weights(self, trial_id: int) -> dict[str, Any] | None:  # pragma: no cover - abstract
        """The trial's current weights, as its own model's state_dict would hold them (None
        when the trial has no model)."""
        raise NotImplementedError

    def drop(self, trial_id: int) -> None:
        """The trial leaves the unit (finished, stopped or failed); the others go on undisturbed."""
        if trial_id in self.jobs:
            self._leave(trial_id)
            del self.jobs[trial_id]

    def _leave(self, trial_id: int) -> None:
        """Release the trial's state."""

    def describe(self) -> str:
        """One log line: what this unit trains and why (anything not fused says why not)."""
        ids = ", ".join(str(i) for i in self.jobs)
        return f"{self.kind} unit of {len(self.jobs)} trial(s) [{ids}]" + (f": {self.reason}" if self.reason else "")

    def _limit_of(self, job: Job, epochs: int) -> int:
        return epochs if job.max_steps is None else min(epochs, job.max_steps)
