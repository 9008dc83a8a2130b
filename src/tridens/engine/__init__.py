"""The engine: ``Experiment`` (ask, instantiate, dedup, run groups, store) and its executors."""

from ._execution import Executor, InlineExecutor, ProcessExecutor
from ._experiment import Experiment
from ._fluid import DynamicFluid, FluidScheduler, StaticFluid, fluid_shares
from ._export import load
from ._threads import ThreadPlan, ThreadPolicy

__all__ = ["Experiment", "Executor", "InlineExecutor", "ProcessExecutor", "load",
           "StaticFluid", "DynamicFluid", "FluidScheduler", "fluid_shares",
           "ThreadPolicy", "ThreadPlan", "runs_started"]


def runs_started() -> int:
    """How many experiments this process started (``Experiment.run`` calls); ``tridens run``
    checks that a script started one.

    >>> before = runs_started()                                       # doctest: +SKIP
    """
    from . import _experiment

    return _experiment.RUN_COUNT
