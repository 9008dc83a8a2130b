"""Retrain one schedule alone: a trial's hyperparameters as a function of the epoch (PBT's lineage).

A schedule (:meth:`tridens.trial.Trial.schedule`) is a list of stages, each a first epoch, the
sample trained with from there, and the seed of the trainer that trained it. Replaying it builds
one trainer per stage and moves the state across -- weights, optimizer moments, step and random
state, the hyperparameters taken from the new stage -- exactly as a fork does, so the per-epoch
metrics equal those of the trials that trained each stage (bit-identical on CPU when they trained
separately; to float tolerance when they trained fused).
"""

from __future__ import annotations

from typing import Any

import torch
from ..space import BaseSpace
from ..trial import Schedule, Trial
from ._base import StepwiseEvaluator

__all__ = ["replay"]


def replay(evaluator: StepwiseEvaluator, model: Any, schedule: Schedule | Trial, *,
           max_steps: int | None = None) -> list[dict[str, float]]:
    """Train ``schedule`` (or a trial's schedule) alone; returns the metrics of every epoch.

    ``model`` is the model to train, initialized as the schedule's first trial's was, or the
    experiment's model space (a :class:`~tridens.space.BaseSpace`): it is then frozen with the first
    stage's sample under ``schedule.seed``, as the engine builds a trial's model. The budget is the last stage's ``epochs`` (capped by ``max_steps``).

    >>> best = exp.best()                                                       # doctest: +SKIP
    >>> curve = td.evaluators.replay(evaluator, space, best.schedule())          # doctest: +SKIP
    >>> [m["val_acc"] for m in curve][-1] == best.metric                        # doctest: +SKIP
    True
    """
    if isinstance(schedule, Trial):
        schedule = schedule.schedule()
    stages = schedule.stages
    if isinstance(model, BaseSpace):
        space = model
        torch.manual_seed(schedule.seed)
        model = space.freeze(space.restrict(stages[0].sample), check=False)
    config = getattr(evaluator, "config", None)
    last = stages[-1]
    budget = config(last.sample).epochs if callable(config) else evaluator.trainer(model, last.sample, last.seed).epochs
    if max_steps is not None:
        budget = min(budget, max_steps)
    objective = evaluator.objective.metric
    history: list[dict[str, float]] = []
    trainer = None
    for epoch in range(budget):
        stage = max((s for s in stages if s.epoch <= epoch), key=lambda s: s.epoch)
        if trainer is None or epoch == stage.epoch:
            state = None if trainer is None else trainer.state_dict()
            trainer = evaluator.trainer(model, stage.sample, stage.seed)
            if state is not None:
                trainer.load_state_dict({**state, "seed": stage.seed})
        metrics = dict(trainer.train_epoch())
        metrics = {**trainer.validate(), **metrics}
        history.append({objective: metrics[objective], **metrics})
    return history
