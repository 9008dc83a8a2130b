"""``Job``: one trial handed to the planner and the executors, with its concrete model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import nn

from ..trial import Trial

__all__ = ["Job"]


@dataclass
class Job:
    """One trial to run: its record, its concrete model (None when the evaluator needs none), the
    group's step cap, when it started (``time.monotonic()``, for ``trial_timeout``), and
    ``start_from``: a member's state (``ExecutionUnit.state_dict``) the trial continues from -- a
    fork of another trial at a step -- or None for a fresh start. ``hparams``: the sample the
    trial trains with from here on when a fork changed its hyperparameters (PBT), else None
    (its ``trial.sample``); :attr:`sample` is the one a unit builds its trainer from.

    >>> from tridens.trial import Trial
    >>> Job(Trial(id=1, sample={"lr": 0.1}, seed=0), model=None).max_steps is None
    True
    """

    trial: Trial
    model: nn.Module | None
    max_steps: int | None = None
    started: float = field(default_factory=time.monotonic)
    start_from: Mapping[str, Any] | None = None
    hparams: dict[str, Any] | None = None

    @property
    def sample(self) -> dict[str, Any]:
        """The hyperparameters the trial trains with now."""
        return self.trial.sample if self.hparams is None else self.hparams
