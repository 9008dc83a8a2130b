"""The contract between planning and execution, below both the engine and the optimizations.

* :class:`Job` -- one trial to run with its concrete model;
* :class:`ExecutionUnit` -- the protocol every unit answers (train an epoch, members, weights,
  drop a member, describe); :class:`SeparateUnit` -- trials trained one by one;
* the memory bound every planner bounds its units by (:func:`resolve_max_unit_memory`);
* the run's plan context (:class:`PlanContext`): settings, memory bound, decisions measured so far;
* the planner interface (:class:`Planner`, :class:`Pass`) that :mod:`tridens.xopt` implements.

>>> from tridens.units import Job, SeparateUnit, parse_memory
>>> parse_memory("1KiB")
1024
"""

from ._job import Job
from ._context import KEPT_SPEEDUPS, Decisions, Measurement, PlanContext
from ._memory import (ENV_MAX_UNIT_MEMORY, configured_max_unit_memory, default_max_unit_memory, parse_memory,
                      resolve_max_unit_memory)
from ._planning import Optimization, Pass, Planner, UnitPass
from ._separate import SeparateUnit
from ._unit import ExecutionUnit, UnitResult, numbered, numbered_text

__all__ = ["Job", "ExecutionUnit", "UnitResult", "SeparateUnit", "numbered", "numbered_text",
           "parse_memory", "resolve_max_unit_memory", "default_max_unit_memory",
           "configured_max_unit_memory", "ENV_MAX_UNIT_MEMORY", "PlanContext", "Decisions", "Measurement", "KEPT_SPEEDUPS",
           "Planner", "Pass", "Optimization", "UnitPass"]
