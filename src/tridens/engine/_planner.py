"""The planner: from a TrialGroup's jobs to execution units.

The cross-model optimizations are listed in one place, :data:`tridens.xopt.OPTIMIZATIONS`; the
planner asks them in order, each taking the jobs it can fuse and leaving the rest to the next, then
runs the passes of :data:`tridens.xopt.PASSES` over the planned units (the shared-pipeline pass puts
batched units that read the same data into one pipeline: mixed units). Whatever is left trains in
one :class:`~tridens.units.SeparateUnit`. With ``optimize=False`` every trial trains separately
(the A/B baseline); otherwise every optimization and pass is given the run's frozen
:class:`tridens.xopt.Settings`. Every unit is bounded by one memory value (:mod:`tridens.units`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

from ..evaluators import StepwiseEvaluator
from ..units import (ENV_MAX_UNIT_MEMORY, MAX_UNIT_MEMORY, ExecutionUnit, Job, Optimization, SeparateUnit,
                     UnitPass, default_max_unit_memory, parse_memory, resolve_max_unit_memory, unit_memory_limit)

__all__ = ["plan", "parse_memory", "resolve_max_unit_memory", "default_max_unit_memory", "unit_memory_limit",
           "ENV_MAX_UNIT_MEMORY", "MAX_UNIT_MEMORY"]

log = logging.getLogger("tridens")


def plan(jobs: Sequence[Job], evaluator: StepwiseEvaluator, optimize: Any, *,
         max_unit_memory: int | str | None = None, optimizations: Sequence[Optimization] | None = None,
         passes: Sequence[UnitPass] | None = None) -> list[ExecutionUnit]:
    """Execution units for ``jobs``: fused where the optimizations find it pays, the rest in one
    :class:`~tridens.units.SeparateUnit`. ``optimize``: a :class:`tridens.xopt.Settings`, True (the
    environment's, :meth:`~tridens.xopt.Settings.from_env`) or False (no fusion). ``optimizations`` and ``passes`` default
    to :data:`tridens.xopt.OPTIMIZATIONS` and :data:`tridens.xopt.PASSES`. Logs one line per unit.

    >>> units = plan(jobs, evaluator, optimize=True, max_unit_memory="2GiB")   # doctest: +SKIP
    """
    units: list[ExecutionUnit] = []
    rest = list(jobs)
    limit = parse_memory(max_unit_memory, "max_unit_memory", "plan")
    if optimize:
        from .. import xopt  # the optimizations' code is loaded when a group is first planned

        settings = xopt.resolve_settings(optimize)
        with contextlib.ExitStack() as stack:
            if limit is not None:
                stack.enter_context(unit_memory_limit(limit))
            for optimization in xopt.OPTIMIZATIONS if optimizations is None else optimizations:
                if not rest:
                    break
                made, rest = optimization.plan(rest, evaluator, settings=settings)
                units.extend(made)
            for unit_pass in xopt.PASSES if passes is None else passes:
                units, rest = unit_pass.run(units, rest, evaluator, settings=settings)
    if rest:
        units.append(SeparateUnit(rest, evaluator, reason="" if optimize else "optimize=False"))
    for unit in units:
        log.info("%s", unit.summary())
        described = unit.describe()   # recorded with each trial: the store and dashboard show the plan
        for job in unit.jobs.values():
            job.trial.info["unit"] = described
    return units
