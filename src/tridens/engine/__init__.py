"""The engine: ``Experiment`` (ask, instantiate, dedup, run groups, store) and its executors."""

from typing import Any

from ._execution import Executor, InlineExecutor, ProcessExecutor, RunContext
from ._experiment import Experiment
from ._fluid import DynamicFluid, FluidScheduler, StaticFluid, fluid_shares
from ._export import load
from ._leftovers import find_abandoned, mark_abandoned
from ._protocol import TrialProtocol, Verdict
from ._threads import ThreadPlan, ThreadPolicy

__all__ = ["Experiment", "Executor", "InlineExecutor", "ProcessExecutor", "RayExecutor", "RunContext", "load",
           "TrialProtocol", "Verdict", "find_abandoned", "mark_abandoned",
           "StaticFluid", "DynamicFluid", "FluidScheduler", "fluid_shares",
           "ThreadPolicy", "ThreadPlan", "runs_started"]


def __getattr__(name: str) -> Any:
    if name == "RayExecutor":  # Ray is optional: imported when asked for
        from ._ray import RayExecutor

        return RayExecutor
    raise AttributeError(f"module 'tridens.engine' has no attribute {name!r}")


def runs_started() -> int:
    """How many experiments this process started (``Experiment.run`` calls); ``tridens run``
    checks that a script started one.

    >>> before = runs_started()                                       # doctest: +SKIP
    """
    from . import _experiment

    return _experiment.RUN_COUNT
