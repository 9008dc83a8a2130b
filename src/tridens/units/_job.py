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
    fork of another trial at a step -- or None for a fresh start.

    >>> from tridens.trial import Trial
    >>> Job(Trial(id=1, sample={"lr": 0.1}, seed=0), model=None).max_steps is None
    True
    """

    trial: Trial
    model: nn.Module | None
    max_steps: int | None = None
    started: float = field(default_factory=time.monotonic)
    start_from: Mapping[str, Any] | None = None
