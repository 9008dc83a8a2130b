"""The messages between the driver and the processes that train its trials (pool workers, forked
children, Ray tasks), as small classes: one module for every backend.

>>> Outcome("error", error="boom").kind
'error'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Outcome"]


@dataclass(frozen=True)
class Outcome:
    """How a trial left the process that trained it: ``kind`` is ``"done"`` (or ``"stopped"``:
    its final ``value``, None for the last recorded one, and ``weights``: ``torch.save`` bytes
    through a pipe, a file under Ray's storage), ``"error"`` (``error``: the text), ``"dropped"``
    (past its timeout: failed on the driver already) or ``"yielded"`` (Fluid: it moves to another
    share). ``info``: what its unit wrote into ``trial.info`` (the stages it went through)."""

    kind: str
    value: float | None = None
    weights: Any = None
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
