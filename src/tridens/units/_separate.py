"""The separate unit: each trial trains with its own trainer, as training them one by one would.

What every planner leaves over trains in one; it is also the A/B baseline (``optimize=False``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from ..evaluators import StepwiseEvaluator, Trainer
from ._job import Job
from ._unit import ExecutionUnit, UnitResult

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
