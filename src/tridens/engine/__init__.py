"""The engine: ``Experiment`` (ask, instantiate, dedup, run groups, store) and its executors.

Names are imported on first use, so that reading a store (``tridens ls``, the dashboard, the
leftover checks) does not load PyTorch.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

from ._leftovers import find_abandoned, mark_abandoned

if TYPE_CHECKING:
    from ._execution import Executor, InlineExecutor, ProcessExecutor, RunContext
    from ._experiment import Budget, Experiment, RunOptions
    from ._export import load
    from ._retrain import Retrained, retrain
    from ._fluid import DynamicFluid, FluidScheduler, StaticFluid, fluid_shares
    from ._progress import trials_table
    from ._protocol import TrialProtocol, Verdict
    from ._ray import RayExecutor
    from ._threads import ThreadPlan, ThreadPolicy

# public name -> the module that defines it
_LAZY = {
    "Executor": "._execution", "InlineExecutor": "._execution", "ProcessExecutor": "._execution",
    "RunContext": "._execution", "Experiment": "._experiment", "load": "._export",
    "Budget": "._experiment", "RunOptions": "._experiment",
    "DynamicFluid": "._fluid", "FluidScheduler": "._fluid", "StaticFluid": "._fluid", "fluid_shares": "._fluid",
    "TrialProtocol": "._protocol", "Verdict": "._protocol", "ThreadPlan": "._threads", "ThreadPolicy": "._threads",
    "RayExecutor": "._ray",  # Ray is optional: imported when asked for
    "trials_table": "._progress", "retrain": "._retrain", "Retrained": "._retrain",
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
