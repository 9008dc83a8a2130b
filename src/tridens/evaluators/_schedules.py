"""Learning-rate schedules as pure functions of the optimizer step.

A schedule is stateless: the lr of step ``t`` (0-based) of ``T`` total steps depends only on
``(lr0, t, T)``, and the trainer sets it before every optimizer step. Resuming therefore needs
only the step counter, and trials that share a prefix of steps share the prefix of their lr curve
(what stage trees rely on).
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "scheduled_lr", "lr_factor"]

SCHEDULES = ("constant", "step", "cosine", "linear", "rex")


def scheduled_lr(schedule: str, lr0: float, t: int, total: int) -> float:
    """The learning rate at step ``t`` of ``total``, with ``z = t / total``:

    * ``constant``: ``lr0``.
    * ``step``: ``lr0``, then ``lr0 * 0.1`` from ``z >= 0.5``, then ``lr0 * 0.01`` from ``z >= 0.75``.
    * ``cosine``: ``lr0 * 0.5 * (1 + cos(pi * z))``.
    * ``linear``: ``lr0 * (1 - z)``.
    * ``rex``: ``lr0 * (1 - z) / (0.5 + 0.5 * (1 - z))`` (Chen, Wolfe and Kyrillidis, REX).

    >>> scheduled_lr("rex", 0.1, 50, 100)
    0.06666666666666667
    """
    if schedule == "constant":
        return lr0
    z = t / total if total > 0 else 0.0
    if schedule == "step":
        return lr0 if z < 0.5 else (lr0 * 0.1 if z < 0.75 else lr0 * 0.01)
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
