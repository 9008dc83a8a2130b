"""Learning-rate schedules as pure functions of the optimizer step.

A schedule is stateless: the lr of step ``t`` (0-based) of ``T`` total steps depends only on
``(t, T)``, and the trainer sets it before every optimizer step. Resuming therefore needs only
the step counter, and trials that share a prefix of steps share the prefix of their lr curve
(what stage trees rely on).
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_factor"]

SCHEDULES = ("constant", "step", "cosine", "linear", "rex")


def lr_factor(schedule: str, t: int, total: int) -> float:
    """The multiplier of the base lr at step ``t`` of ``total``.

    * ``constant``: 1.
    * ``step``: 1, then 0.1 from half of the steps on, then 0.01 from three quarters on.
    * ``cosine``: ``0.5 * (1 + cos(pi * z))`` with ``z = t / total``.
    * ``linear``: ``1 - z``.
    * ``rex``: ``(1 - z) / (0.5 + 0.5 * (1 - z))`` (Chen et al., REX).

    >>> lr_factor("rex", 50, 100)
    0.6666666666666666
    """
    if schedule == "constant":
        return 1.0
    z = t / total if total > 0 else 0.0
    if schedule == "step":
        return 1.0 if z < 0.5 else (0.1 if z < 0.75 else 0.01)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * z))
    if schedule == "linear":
        return 1.0 - z
    if schedule == "rex":
        return (1.0 - z) / (0.5 + 0.5 * (1.0 - z))
    raise ValueError(f"The 'schedule' parameter must be one of {sorted(SCHEDULES)!r}. Got {schedule!r} instead.")
