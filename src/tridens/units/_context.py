"""The plan context: everything one run's planners and units share, owned by that run.

An experiment makes one :class:`PlanContext` when its run starts and hands it to every planner
(``planner(jobs, evaluator, settings=..., context=...)``); the units a planner builds keep the
parts they need. It holds the run's cross-model optimization settings, the memory bound of a unit,
the decisions measured so far (:class:`Decisions`: fused-or-not speed-ups, one model's separate
step, traced structure keys, wide-op speed-ups), the prefix cache of stage trees and the stage
archive. Nothing of it lives in a module global, so two experiments in one process plan
independently, and a worker gets the same context as plain data (:meth:`PlanContext.for_worker`).

A unit that measures records into the context's :class:`Decisions` and also returns what it
measured as data (:class:`Measurement`, ``unit.measurements()``): a process that trained units
elsewhere hands those back and the driver adds them with :meth:`Decisions.add`.

>>> context = PlanContext(max_unit_memory=1 << 30)
>>> m = context.decisions.record_speedup(("mlp", 4), 2.5)
>>> context.decisions.speedups[("mlp", 4)], m
([2.5], Measurement(kind='speedup', key=('mlp', 4), value=2.5, replace=False))
>>> other = PlanContext()
>>> other.decisions.add([m]); other.decisions.speedups
{('mlp', 4): [2.5]}
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ._memory import resolve_max_unit_memory

__all__ = ["PlanContext", "Decisions", "Measurement", "KEPT_SPEEDUPS"]

KEPT_SPEEDUPS = 5
"""The most recent speed-ups kept per decision key."""

_TRACED_MAX = 4096
_DESCRIPTIONS_MAX = 64


@dataclass(frozen=True)
class Measurement:
    """One measurement a unit took, as data: ``kind`` is ``"speedup"`` (fused over separate
    training, for ``key``) or ``"separate step"`` (one model's separate step, CPU s); ``replace``:
    instead of the earlier ones for ``key``."""

    kind: str
    key: tuple[Any, ...]
    value: float
    replace: bool = False


class Decisions:
    """What one run's planners learned: measured speed-ups (oldest first, the latest
    :data:`KEPT_SPEEDUPS`), one model's separate step, the thread options' measured rates, step efficiency against the peak, traced
    structure keys, wide-op speed-ups, and parents' IR descriptions for weight inheritance."""

    def __init__(self) -> None:
        self.speedups: dict[tuple[Any, ...], list[float]] = {}
        self.separate_steps: dict[tuple[Any, ...], float] = {}
        self.efficiency: dict[tuple[Any, ...], tuple[float, float, float]] = {}
        self.traced: dict[tuple[Any, ...], Any] = {}
        self.wide: dict[tuple[Any, ...], float] = {}
        self.descriptions: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
        self.thread_rates: dict[tuple[Any, ...], dict[str, list[float]]] = {}

    def record_thread_rate(self, key: tuple[Any, ...], option: str, rate: float) -> None:
        """Keep a group's measured work per wall second under a thread ``option`` for later
        groups of ``key`` (the latest :data:`KEPT_SPEEDUPS`)."""
        values = self.thread_rates.setdefault(tuple(key), {}).setdefault(option, [])
        values[:] = (values + [float(rate)])[-KEPT_SPEEDUPS:]

    def record_speedup(self, key: tuple[Any, ...], speedup: float, *, replace: bool = False) -> Measurement:
        """Keep a measured speed-up for later groups of ``key`` (``replace``: instead of the earlier
        ones, e.g. 0 for models that do not vectorize); returns it as data."""
        values = [] if replace else self.speedups.get(key, [])
        self.speedups[key] = (values + [float(speedup)])[-KEPT_SPEEDUPS:]
        return Measurement("speedup", tuple(key), float(speedup), replace)

    def record_separate_step(self, key: tuple[Any, ...], seconds: float) -> Measurement:
        """Keep one model's measured separate step (CPU s) for later stacks of ``key`` that shrink."""
        self.separate_steps[key] = float(seconds)
        return Measurement("separate step", tuple(key), float(seconds), True)

    def add(self, measurements: Iterable[Measurement]) -> None:
        """Record measurements a unit took elsewhere (another process), as if taken here."""
        for m in measurements:
            if m.kind == "speedup":
                self.record_speedup(tuple(m.key), m.value, replace=m.replace)
            elif m.kind == "separate step":
                self.record_separate_step(tuple(m.key), m.value)

    def remember_traced(self, key: tuple[Any, ...], value: Any) -> None:
        if len(self.traced) >= _TRACED_MAX:
            self.traced.clear()
        self.traced[key] = value

    def description(self, key: tuple[Any, ...], make: Any) -> dict[str, Any]:
        """``make()``'s result for ``key``, made once (the latest 64 kept)."""
        if key in self.descriptions:
            self.descriptions.move_to_end(key)
            return self.descriptions[key]
        desc = self.descriptions[key] = make()
        while len(self.descriptions) > _DESCRIPTIONS_MAX:
            self.descriptions.popitem(last=False)
        return desc


@dataclass
class PlanContext:
    """One run's planning state (see the module docstring). ``settings``: the run's
    :class:`tridens.xopt.Settings` (None: each planner's defaults); ``max_unit_memory``: the bound
    of a unit's estimated bytes (None: ``$TRIDENS_MAX_UNIT_MEMORY``, else the device's default);
    ``stages``: the stage trees' prefix cache (made by :mod:`tridens.xopt` on first use);
    ``archive``: where stage trees store and find stages (a :class:`tridens.store.StageArchive`
    or a view of it; None: none).

    >>> PlanContext(max_unit_memory=4096).memory_bound("cpu")
    4096
    """

    settings: Any = None
    max_unit_memory: int | None = None
    decisions: Decisions = field(default_factory=Decisions)
    stages: Any = None
    archive: Any = None

    def memory_bound(self, device: torch.device | str = "cpu", value: int | str | None = None) -> int:
        """The bound a planner uses on ``device``: ``value``, else this run's ``max_unit_memory``,
        else ``$TRIDENS_MAX_UNIT_MEMORY``, else the device's default."""
        return resolve_max_unit_memory(value if value is not None else self.max_unit_memory, device)

    def with_archive(self, archive: Any) -> PlanContext:
        """The same context (the same decisions and prefix cache) with stages stored through ``archive``."""
        return dataclasses.replace(self, archive=archive)

    def for_worker(self) -> dict[str, Any]:
        """What a worker in another process plans with, as plain data (its decisions start empty;
        the settings as :meth:`tridens.xopt.Settings.as_dict`)."""
        settings = self.settings.as_dict() if hasattr(self.settings, "as_dict") else None
        return {"settings": settings, "max_unit_memory": self.max_unit_memory}
