"""Execution units: the trials of a group that train together, one epoch at a time.

The planner (:mod:`._planner`) turns a TrialGroup's jobs into units. A unit may train its trials
one after another (:class:`SeparateUnit`, what training them one by one means), or fused — a
shared data pipeline, one vectorized model for many same-shaped models (:mod:`tridens.xopt`).
Every unit answers the same small protocol, so the executor's lockstep loop, the strategy's
stop decisions and the store never see the difference.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from ..evaluators._base import StepwiseEvaluator, Trainer
from ..trial import Objective
from ._execution import Job

__all__ = ["ExecutionUnit", "SeparateUnit", "UnitResult"]

# One trial's outcome of an epoch: its metrics (objective first), or the error that failed it.
UnitResult = Mapping[str, float] | BaseException


class ExecutionUnit:
    """Trials trained together. Subclasses implement :meth:`train_epoch`, :meth:`weights`,
    :meth:`limit` and :meth:`_leave` (release a trial's state)."""

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


class SeparateUnit(ExecutionUnit):
    """Each trial trains with its own trainer, one after another within an epoch."""

    kind = "separate"

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, reason: str = ""):
        super().__init__(jobs, evaluator)
        self.reason = reason
        self.trainers: dict[int, Trainer] = {}
        self.errors: dict[int, BaseException] = {}
        for job in jobs:
            try:
                self.trainers[job.trial.id] = evaluator.trainer(job.model, job.trial.sample, job.trial.seed)
            except Exception as err:  # reported as the trial's failure at its first epoch
                self.errors[job.trial.id] = err

    def limit(self, trial_id: int) -> int:
        trainer = self.trainers.get(trial_id)
        return 0 if trainer is None else self._limit_of(self.jobs[trial_id], trainer.epochs)

    def epoch(self, trial_id: int) -> int:
        trainer = self.trainers.get(trial_id)
        return 0 if trainer is None else trainer.epoch

    def train_epoch(self) -> dict[int, UnitResult]:
        results: dict[int, UnitResult] = {}
        for trial_id in list(self.jobs):
            if trial_id in self.errors:
                results[trial_id] = self.errors.pop(trial_id)
                continue
            trainer = self.trainers[trial_id]
            if trainer.epoch >= self.limit(trial_id):
                continue
            t0 = time.monotonic()
            try:
                metrics = dict(trainer.train_epoch())
                metrics = {**trainer.validate(), **metrics}
                results[trial_id] = {self.objective.metric: metrics[self.objective.metric], **metrics}
            except Exception as err:
                results[trial_id] = err
            info = self.jobs[trial_id].trial.info
            info["train_seconds"] = info.get("train_seconds", 0.0) + time.monotonic() - t0
        return results

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        model = self.jobs[trial_id].model
        if model is None:  # an evaluator that needs no model (Tabular): nothing to checkpoint
            return None
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def _leave(self, trial_id: int) -> None:
        self.trainers.pop(trial_id, None)
        self.errors.pop(trial_id, None)
