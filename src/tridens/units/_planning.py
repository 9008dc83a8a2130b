"""The planner interface: what a cross-model optimization offers the engine.

A planner takes a TrialGroup's jobs and returns the units it fuses and the jobs it leaves to the
next planner; a pass rewrites the planned units afterwards (e.g. merges units that read the same
data). The engine asks the planners listed in :data:`tridens.xopt.OPTIMIZATIONS` in order and
trains whatever is left in a :class:`~tridens.units.SeparateUnit`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence

from ..evaluators import StepwiseEvaluator
from ._job import Job
from ._unit import ExecutionUnit

__all__ = ["Planner", "Pass", "Optimization", "UnitPass"]


class Planner(Protocol):
    """``planner(jobs, evaluator, settings=..., context=...) -> (units, leftover jobs)``.
    ``settings`` is the run's frozen :class:`tridens.xopt.Settings` (None: the planner's
    defaults); ``context`` the run's :class:`~tridens.units.PlanContext`, whose memory bound
    (:meth:`~tridens.units.PlanContext.memory_bound`) bounds the units and whose decisions the
    units read and record into (None: a fresh one). Both reach the units the planner builds through
    their constructors."""

    def __call__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, /, *, settings: Any = None,
                 context: Any = None) -> tuple[list[ExecutionUnit], list[Job]]: ...


class Pass(Protocol):
    """``fn(units, leftover jobs, evaluator, settings=..., context=...) -> (units to run, jobs still left)``."""

    def __call__(self, units: list[ExecutionUnit], jobs: list[Job], evaluator: StepwiseEvaluator, /, *,
                 settings: Any = None, context: Any = None) -> tuple[list[ExecutionUnit], list[Job]]: ...


class Optimization(NamedTuple):
    """A named planner, as listed in :data:`tridens.xopt.OPTIMIZATIONS`.

    >>> Optimization("nothing", lambda jobs, evaluator, settings=None, context=None: ([], list(jobs))).name
    'nothing'
    """

    name: str
    plan: Planner


class UnitPass(NamedTuple):
    """A named pass over the planned units, as listed in :data:`tridens.xopt.PASSES`."""

    name: str
    run: Pass
