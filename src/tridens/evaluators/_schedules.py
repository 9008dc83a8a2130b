"""Learning-rate schedules as pure functions of the optimizer step.

A schedule is stateless: the lr of step ``t`` (0-based) of ``T`` total steps depends only on
``(lr0, t, T)`` and the schedule's parameters (step milestones, decay factor, warmup length, which
a search may tune), and the trainer sets it before every optimizer step. Resuming therefore needs
only the step counter, and trials that share a prefix of steps share the prefix of their lr curve
(what stage trees rely on).
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["SCHEDULES", "scheduled_lr", "lr_factor"]

SCHEDULES = ("constant", "step", "cosine", "linear", "rex")


def scheduled_lr(schedule: str, lr0: float, t: int, total: int, *, milestones: Sequence[int] | None = None,
                 gamma: float = 0.1, warmup: int = 0) -> float:
    """The learning rate at step ``t`` of ``total``.

    A linear warmup over the first ``warmup`` steps (``lr0 * (t + 1) / warmup``) comes first; the
    schedule then runs over the remaining steps, with ``z = (t - warmup) / (total - warmup)``:

    * ``constant``: ``lr0``.
    * ``step``: ``lr0 * gamma ** k`` with ``k`` the number of ``milestones`` (steps) at or before
      ``t``; without milestones, decays at ``z >= 0.5`` and ``z >= 0.75``.
    * ``cosine``: ``lr0 * 0.5 * (1 + cos(pi * z))``.
    * ``linear``: ``lr0 * (1 - z)``.
    * ``rex``: ``lr0 * (1 - z) / (0.5 + 0.5 * (1 - z))`` (Chen, Wolfe and Kyrillidis, REX).

    >>> scheduled_lr("rex", 0.1, 50, 100)
    0.06666666666666667
    >>> [scheduled_lr("step", 1.0, t, 10, milestones=[3, 6], gamma=0.5) for t in (0, 3, 6)]
    [1.0, 0.5, 0.25]
    """
    if t < warmup:
        return lr0 * (t + 1) / warmup
    if schedule == "constant":
        return lr0
    if schedule == "step" and milestones is not None:
        return lr0 * gamma ** sum(1 for m in milestones if t >= m)
    span = total - warmup
    z = (t - warmup) / span if span > 0 else 0.0
    if schedule == "step":
        return lr0 * gamma ** (int(z >= 0.5) + int(z >= 0.75))
    if schedule == "cosine":
        return lr0 * 0.5 * (1 + math.cos(math.pi * z))
    if schedule == "linear":
        return lr0 * (1 - z)
    if schedule == "rex":
        return lr0 * (1 - z) / (0.5 + 0.5 * (1 - z))
    raise ValueError(f"The 'schedule' parameter must be one of {sorted(SCHEDULES)!r}. Got {schedule!r} instead.")


def lr_factor(schedule: str, t: int, total: int) -> float:
    """The multiplier of the base lr at step ``t`` of ``total``: ``scheduled_lr(schedule, 1.0, t, total)``.

    >>> lr_factor("rex", 50, 100)
    0.6666666666666666
    """
    return scheduled_lr(schedule, 1.0, t, total)
