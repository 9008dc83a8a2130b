"""The memory bound of an execution unit: one value that every planner bounds its units by.

Resolved by :func:`resolve_max_unit_memory`: the ``max_unit_memory`` of the experiment's executor
(``td.executors.Inline(max_unit_memory="2GiB")``, carried by the run's
:class:`~tridens.units.PlanContext`), else the environment variable ``TRIDENS_MAX_UNIT_MEMORY``, else :func:`default_max_unit_memory`
(half of the physical memory for CPU training, 80% of the free memory of a CUDA device).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

__all__ = ["parse_memory", "resolve_max_unit_memory", "default_max_unit_memory", "configured_max_unit_memory",
           "ENV_MAX_UNIT_MEMORY"]

ENV_MAX_UNIT_MEMORY = "TRIDENS_MAX_UNIT_MEMORY"
"""The environment variable that bounds a unit's memory when the experiment sets no bound."""

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


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
    """The bound a planner uses: ``value`` (the run's ``max_unit_memory``), else
    ``$TRIDENS_MAX_UNIT_MEMORY``, else :func:`default_max_unit_memory` of ``device``.

    >>> resolve_max_unit_memory("1GiB")
    1073741824
    """
    resolved = parse_memory(value, "max_unit_memory", "the planner")
    if resolved is None and os.environ.get(ENV_MAX_UNIT_MEMORY):
        resolved = parse_memory(os.environ[ENV_MAX_UNIT_MEMORY], ENV_MAX_UNIT_MEMORY, "the environment")
    return default_max_unit_memory(device) if resolved is None else resolved


def configured_max_unit_memory(value: int | str | None = None) -> int | None:
    """The bound set for a run, without the device default: ``value`` (the experiment's
    ``max_unit_memory``), else ``$TRIDENS_MAX_UNIT_MEMORY``, else None (what a remote worker
    needs to resolve the same bound on its own device).

    >>> configured_max_unit_memory(4096)
    4096
    """
    bound = parse_memory(value, "max_unit_memory", "the planner")
    if bound is None and os.environ.get(ENV_MAX_UNIT_MEMORY):
        bound = parse_memory(os.environ[ENV_MAX_UNIT_MEMORY], ENV_MAX_UNIT_MEMORY, "the environment")
    return bound
