"""The planner: from a TrialGroup's jobs to execution units.

Each cross-model optimization in :mod:`tridens.xopt` offers ``plan(jobs, evaluator) ->
(units, leftover jobs)``; the planner asks them in order and trains whatever is left separately.
With ``optimize=False`` every trial trains separately (the A/B baseline).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from ..evaluators._base import StepwiseEvaluator
from ._execution import Job
from ._units import ExecutionUnit, SeparateUnit

__all__ = ["plan", "register"]

log = logging.getLogger("tridens")

Planner = Callable[[Sequence[Job], StepwiseEvaluator], tuple[list[ExecutionUnit], list[Job]]]
_OPTIMIZATIONS: list[tuple[str, Planner]] = []


def register(name: str, planner: Planner) -> None:
    """Add a cross-model optimization (tried in registration order)."""
    _OPTIMIZATIONS.append((name, planner))


def plan(jobs: Sequence[Job], evaluator: StepwiseEvaluator, optimize: bool) -> list[ExecutionUnit]:
    units: list[ExecutionUnit] = []
    rest = list(jobs)
    if optimize:
        from .. import xopt  # noqa: F401  (importing it registers the optimizations)
        for _name, planner in _OPTIMIZATIONS:
            if not rest:
                break
            made, rest = planner(rest, evaluator)
            units.extend(made)
    if rest:
        units.append(SeparateUnit(rest, evaluator, reason="" if optimize else "optimize=False"))
    for unit in units:
        log.info("%s", unit.describe())
    return units
