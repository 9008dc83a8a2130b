"""The engine: ``Experiment`` (ask, instantiate, dedup, run groups, store); its executors live in
:mod:`tridens.executors` (their names are importable from here too).

Names are imported on first use, so that reading a store (``tridens ls``, the dashboard, the
leftover checks) does not load PyTorch.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

from ._leftovers import find_abandoned, mark_abandoned

if TYPE_CHECKING:
    from ..executors import (DynamicFluid, Executor, FluidScheduler, InlineExecutor, ProcessExecutor, RayExecutor,
                             RunContext, StaticFluid, ThreadPlan, ThreadPolicy, TrialProtocol, Verdict, fluid_shares)
    from ._experiment import Budget, Experiment, RunOptions
    from ._export import load
    from ._retrain import Retrained, retrain
    from ._progress import trials_table

# public name -> the module that defines it (the executors' names live in tridens.executors)
_LAZY = {
    "Experiment": "._experiment", "load": "._export", "Budget": "._experiment", "RunOptions": "._experiment",
    "trials_table": "._progress", "retrain": "._retrain", "Retrained": "._retrain",
    **{name: "..executors" for name in ("Executor", "InlineExecutor", "ProcessExecutor", "RayExecutor", "RunContext",
                                        "DynamicFluid", "FluidScheduler", "StaticFluid", "fluid_shares",
                                        "TrialProtocol", "Verdict", "ThreadPlan", "ThreadPolicy")},
}

__all__ = ["Experiment", "Budget", "RunOptions", "Executor", "InlineExecutor", "ProcessExecutor", "RayExecutor", "RunContext", "load",
           "TrialProtocol", "Verdict", "find_abandoned", "mark_abandoned",
           "StaticFluid", "DynamicFluid", "FluidScheduler", "fluid_shares",
           "ThreadPolicy", "ThreadPlan", "runs_started", "trials_table", "retrain", "Retrained"]

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals(), __all__)


def runs_started() -> int:
    """How many experiments this process started (``Experiment.run`` calls); ``tridens run``
    checks that a script started one.

    >>> before = runs_started()                                       # doctest: +SKIP
    """
    from . import _experiment

    return _experiment.RUN_COUNT
