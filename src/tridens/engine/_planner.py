"""The planner: from a TrialGroup's jobs to execution units.

Each cross-model optimization in :mod:`tridens.xopt` offers ``plan(jobs, evaluator) -> (units,
leftover jobs)``; the planner asks them in order and trains whatever is
left separately. Passes registered with :func:`register_pass` then rewrite the planned units (the
shared-pipeline pass puts batched units that read the same data into one pipeline: mixed units).
With ``optimize=False`` every trial trains separately (the A/B baseline).

**Memory.** Every optimization bounds a unit's estimated bytes by ONE value, resolved by
:func:`resolve_max_unit_memory`: the ``max_unit_memory`` of the experiment (``td.Experiment(...,
max_unit_memory="2GiB")``, or ``plan(..., max_unit_memory=)``), else the environment variable
``TRIDENS_MAX_UNIT_MEMORY``, else :func:`default_max_unit_memory` (half of the physical memory for
CPU training, 80% of the free memory of a CUDA device).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
from typing import Any, Callable, Iterator, Sequence

import torch

from ..evaluators._base import StepwiseEvaluator
from ._execution import Job
from ._units import ExecutionUnit, SeparateUnit

__all__ = ["plan", "register", "register_pass", "parse_memory", "resolve_max_unit_memory",
           "default_max_unit_memory", "unit_memory_limit"]

log = logging.getLogger("tridens")

Planner = Callable[..., tuple[list[ExecutionUnit], list[Job]]]
Pass = Callable[..., tuple[list[ExecutionUnit], list[Job]]]
_OPTIMIZATIONS: list[tuple[str, Planner]] = []
_PASSES: list[tuple[str, Pass]] = []

ENV_MAX_UNIT_MEMORY = "TRIDENS_MAX_UNIT_MEMORY"

# The experiment's max_unit_memory while it runs (set by Experiment.run through unit_memory_limit()).
_MAX_UNIT_MEMORY: contextvars.ContextVar[int | None] = contextvars.ContextVar("tridens_max_unit_memory",
                                                                                default=None)

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def register(name: str, planner: Planner) -> None:
    """Add a cross-model optimization (tried in registration order), called as ``planner(jobs,
    evaluator)``; it bounds its units by ``resolve_max_unit_memory(None, device)``."""
    _OPTIMIZATIONS.append((name, planner))


def register_pass(name: str, fn: Pass) -> None:
    """Add a pass over the planned units, called as ``fn(units, leftover jobs, evaluator)`` and
    returning the units to run and the jobs still left (e.g. units and jobs merged into one)."""
    _PASSES.append((name, fn))


def parse_memory(value: Any, parameter: str = "max_unit_memory", owner: str = "Experiment") -> int | None:
    """Bytes from ``None``, a positive int, or a string such as ``"2GiB"``, ``"512 MiB"``,
    ``"1.5GB"`` or ``"4096"`` (K/M/G/T alone are binary units).

    >>> parse_memory("2GiB"), parse_memory(1024), parse_memory(None)
    (2147483648, 1024, None)
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            count = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if count > 0:
                return count
    raise ValueError(f"The '{parameter}' parameter of {owner} must be None, a positive number of bytes or a "
                     f"string like '2GiB' or '512MB'. Got {value!r} instead.")


def default_max_unit_memory(device: torch.device | str = "cpu") -> int:
    """The default bound of a unit's memory on ``device``: half of the physical memory for the
    CPU, 80% of the free memory of a CUDA device."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 8 << 30


def resolve_max_unit_memory(value: int | str | None, device: torch.device | str = "cpu") -> int:
    """The bound a planner uses: ``value``, else the running experiment's ``max_unit_memory``,
    else ``$TRIDENS_MAX_UNIT_MEMORY``, else :func:`default_max_unit_memory` of ``device``."""
    resolved = parse_memory(value, "max_unit_memory", "the planner")
    if resolved is None:
        resolved = _MAX_UNIT_MEMORY.get()
    if resolved is None and os.environ.get(ENV_MAX_UNIT_MEMORY):
        resolved = parse_memory(os.environ[ENV_MAX_UNIT_MEMORY], ENV_MAX_UNIT_MEMORY, "the environment")
    return default_max_unit_memory(device) if resolved is None else resolved


@contextlib.contextmanager
def unit_memory_limit(value: int | str | None) -> Iterator[None]:
    """Plan with ``value`` as the bound of every unit (None: the default) inside the block.

    >>> with unit_memory_limit("1GiB"):
    ...     resolve_max_unit_memory(None)
    1073741824
    """
    token = _MAX_UNIT_MEMORY.set(parse_memory(value))
    try:
        yield
    finally:
        _MAX_UNIT_MEMORY.reset(token)


def plan(jobs: Sequence[Job], evaluator: StepwiseEvaluator, optimize: bool, *,
         max_unit_memory: int | str | None = None) -> list[ExecutionUnit]:
    """Execution units for ``jobs``: fused where the registered optimizations find it pays (with
    ``optimize``), the rest in one :class:`SeparateUnit`. Logs one line per unit."""
    units: list[ExecutionUnit] = []
    rest = list(jobs)
    limit = parse_memory(max_unit_memory, "max_unit_memory", "plan")
    if optimize:
        from .. import xopt  # noqa: F401  (importing it registers the optimizations)
        with contextlib.ExitStack() as stack:
            if limit is not None:
                stack.enter_context(unit_memory_limit(limit))
            for _name, planner in _OPTIMIZATIONS:
                if not rest:
                    break
                made, rest = planner(rest, evaluator)
                units.extend(made)
            for _name, fn in _PASSES:
                units, rest = fn(units, rest, evaluator)
    if rest:
        units.append(SeparateUnit(rest, evaluator, reason="" if optimize else "optimize=False"))
    for unit in units:
        log.info("%s", unit.describe())
    return units
