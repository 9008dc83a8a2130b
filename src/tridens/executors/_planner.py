"""The planner: from a TrialGroup's jobs to execution units.

The cross-model optimizations are listed in one place, :data:`tridens.xopt.OPTIMIZATIONS`; the
planner asks them in order, each taking the jobs it can fuse and leaving the rest to the next, then
runs the passes of :data:`tridens.xopt.PASSES` over the planned units (the shared-pipeline pass puts
batched units that read the same data into one pipeline: mixed units). Whatever is left trains in
one :class:`~tridens.units.SeparateUnit`. With ``optimize=False`` every trial trains separately
(the A/B baseline); otherwise every optimization and pass is given the run's frozen
:class:`tridens.xopt.Settings` and its :class:`tridens.units.PlanContext` (one memory bound for
every unit, the decisions earlier groups measured, the stage archive).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from ..evaluators import StepwiseEvaluator
from ..units import (ENV_MAX_UNIT_MEMORY, ExecutionUnit, Job, Optimization, PlanContext, SeparateUnit, UnitPass,
                     default_max_unit_memory, parse_memory, resolve_max_unit_memory)

__all__ = ["plan", "spread_units", "parse_memory", "resolve_max_unit_memory", "default_max_unit_memory",
           "ENV_MAX_UNIT_MEMORY"]

log = logging.getLogger("tridens")


def plan(jobs: Sequence[Job], evaluator: StepwiseEvaluator, optimize: Any, *,
         max_unit_memory: int | str | None = None, optimizations: Sequence[Optimization] | None = None,
         passes: Sequence[UnitPass] | None = None, context: PlanContext | None = None) -> list[ExecutionUnit]:
    """Execution units for ``jobs``: fused where the optimizations find it pays, the rest in one
    :class:`~tridens.units.SeparateUnit`. ``optimize``: a :class:`tridens.xopt.Settings`, True (the
    environment's, :meth:`~tridens.xopt.Settings.from_env`) or False (no fusion). ``optimizations`` and ``passes`` default
    to :data:`tridens.xopt.OPTIMIZATIONS` and :data:`tridens.xopt.PASSES`. ``context``: the run's
    plan context (None: a fresh one; ``max_unit_memory`` replaces its bound). Logs one line per unit.

    >>> units = plan(jobs, evaluator, optimize=True, max_unit_memory="2GiB")   # doctest: +SKIP
    """
    units: list[ExecutionUnit] = []
    rest = list(jobs)
    limit = parse_memory(max_unit_memory, "max_unit_memory", "plan")
    if optimize:
        from .. import xopt  # the optimizations' code is loaded when a group is first planned

        settings = xopt.resolve_settings(optimize)
        context = context if context is not None else PlanContext(settings=settings)
        if limit is not None and limit != context.max_unit_memory:
            xopt.prefix_cache(context)  # made first, so that the copy shares it
            context = dataclasses.replace(context, max_unit_memory=limit)
        for optimization in xopt.OPTIMIZATIONS if optimizations is None else optimizations:
            if not rest:
                break
            made, rest = optimization.plan(rest, evaluator, settings=settings, context=context)
            units.extend(made)
        for unit_pass in xopt.PASSES if passes is None else passes:
            units, rest = unit_pass.run(units, rest, evaluator, settings=settings, context=context)
    if rest:
        units.append(SeparateUnit(rest, evaluator, reason="" if optimize else "optimize=False"))
    for unit in units:
        described = unit.describe()   # recorded with each trial: the store and dashboard show the plan
        log.info("%s", described["text"])
        for job in unit.jobs.values():
            job.trial.info["unit"] = described
    return units


def spread_units(units: Sequence[ExecutionUnit], evaluator: StepwiseEvaluator, optimize: Any, count: int, *,
                 separate_tasks: bool = False, by_members: bool = True, where: str = "",
                 context: PlanContext | None = None) -> list[ExecutionUnit]:
    """Units for ``count`` workers: while there are fewer than ``count``, the biggest unit that may
    be split (``splittable``, or a separate unit) is split in two: by its members as they are where
    it can (:meth:`~tridens.units.ExecutionUnit.split`), else planned again as two equal halves,
    the groups of its members (a batched model, a joint step) in order of size, so that at most
    one group is cut in two. Super-graph units stay whole (their children are tied already).
    ``separate_tasks``: a separate unit's trials count one worker each and are not split (an
    executor that gives each of them its own task). ``by_members=False``: always planned again (an
    executor whose workers plan a unit's trials again from its kind). ``where`` names the workers
    in the log line; ``context``: the run's plan context, for units planned again.
    One unit of a whole group costs nothing when units run one at a time; side by side it would
    leave workers idle.

    >>> spread_units(units, evaluator, True, 2)                  # doctest: +SKIP
    """
    units = list(units)

    def separate(unit: ExecutionUnit) -> bool:
        return unit.describe()["kind"] == "separate"

    def tasks() -> int:
        return sum(len(u.jobs) if separate_tasks and separate(u) else 1 for u in units)

    while tasks() < count:
        splittable = [u for u in units if len(u.jobs) > 1 and
                      (u.describe()["splittable"] or (separate(u) and not separate_tasks))]
        if not splittable:
            break
        unit = max(splittable, key=lambda u: len(u.jobs))
        units.remove(unit)
        parts = unit.split() if by_members else None
        if parts is not None:
            log.info("the %s unit of trials %s is split in two for the %d %s: %s", unit.kind, list(unit.jobs), count,
                     where or "workers", "; ".join(str(part.trial_ids()) for part in parts))
            for part in parts:
                described = part.describe()
                for job in part.jobs.values():
                    job.trial.info["unit"] = described
            units.extend(parts)
            continue
        groups = unit.groups() or [list(unit.jobs)]
        order = [t for group in sorted(groups, key=len, reverse=True) for t in group]
        order += [t for t in unit.jobs if t not in order]
        halves = [order[:(len(order) + 1) // 2], order[(len(order) + 1) // 2:]]
        log.info("the %s unit of trials %s is planned again as two units for the %d %s", unit.kind, list(unit.jobs),
                 count, where or "workers")
        for half in halves:
            units.extend(plan([unit.jobs[t] for t in half], evaluator, optimize, context=context))
    return units
