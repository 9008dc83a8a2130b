"""The separate unit: each trial trains with its own trainer, as training them one by one would.

What every planner leaves over trains in one; it is also the A/B baseline (``optimize=False``).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from ..evaluators import StepwiseEvaluator, Trainer
from ._job import Job
from ._unit import ExecutionUnit, UnitResult, reseeded

__all__ = ["SeparateUnit"]


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
                self.trainers[job.trial.id] = evaluator.trainer(job.model, job.sample, job.trial.seed)
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

    def state_dict(self, trial_id: int) -> dict[str, Any] | None:
        trainer = self.trainers.get(trial_id)
        return None if trainer is None else trainer.state_dict()

    def load_state_dict(self, trial_id: int, state: Mapping[str, Any]) -> None:
        trainer = self.trainers.get(trial_id)
        if trainer is None:  # its trainer could not be built: the error is its first epoch's result
            raise self.errors.get(trial_id) or KeyError(f"trial {trial_id} is not a member of this unit")
        trainer.load_state_dict(state)

    def fork(self, source: int, job: Job) -> ExecutionUnit:
        """The new member joins this unit, from ``source``'s current state."""
        state = self.state_dict(source)
        if state is None:
            raise ValueError(f"trial {source} of a separate unit has no state to fork from")
        trial_id = job.trial.id
        self.jobs[trial_id] = job
        try:
            self.trainers[trial_id] = self.evaluator.trainer(job.model, job.sample, job.trial.seed)
            self.trainers[trial_id].load_state_dict(reseeded(state, job.trial.seed))
        except Exception as err:  # reported as the trial's failure at its next epoch
            self.trainers.pop(trial_id, None)
            self.errors[trial_id] = err
        return self

    def _leave(self, trial_id: int) -> None:
        self.trainers.pop(trial_id, None)
        self.errors.pop(trial_id, None)
