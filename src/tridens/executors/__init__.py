"""Executors: where an experiment's trials train, as objects passed to ``td.Experiment(executor=...)``.

* :class:`Inline` -- in this process (the default);
* :class:`Process` -- a pool of ``workers`` long-lived worker processes;
* :class:`Ray` -- Ray tasks on a local Ray or a cluster (``pip install 'ray==2.58.0'``).

Every executor drives each trial through the one trial protocol (:class:`TrialProtocol`) and its
units through the unit protocol (:class:`tridens.units.ExecutionUnit`); :class:`Executor` is the
base a new executor implements. What trains in another process talks to the driver through a
:class:`Channel` (a pipe, the Ray hub) in typed messages (:mod:`._messages`), watched by one
watchdog (:mod:`._watchdog`: the hang check, the death message, the outcome decoder).

Names are imported on first use (PyTorch and Ray load only when an executor is asked for).

>>> import tridens as td
>>> td.executors.Process(workers=4).workers
4
>>> exp = td.Experiment(space, evaluator, executor=td.executors.Ray(address=None, storage="runs/",
...                     max_retries=2, allocation="dynamic"))                          # doctest: +SKIP
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
    from ._channel import Channel, ChannelClosed, HubChannel, PipeChannel
    from ._execution import (Executor, InlineExecutor, InlineExecutor as Inline, ProcessExecutor,
                             ProcessExecutor as Process, RunContext, check_forks, make_executor)
    from ._fluid import DynamicFluid, FluidScheduler, StaticFluid, fluid_policy, fluid_shares
    from ._protocol import GroupHooks, RunHalted, TrialProtocol, TrialTimeout, Verdict, error_text
    from ._ray import RayExecutor, RayExecutor as Ray
    from ._ray_storage import CheckpointStorage
    from ._threads import ThreadPlan, ThreadPolicy

# public name -> the module that defines it
_DEFINED = {
    "Executor": "._execution", "RunContext": "._execution", "InlineExecutor": "._execution",
    "ProcessExecutor": "._execution", "make_executor": "._execution", "check_forks": "._execution",
    "RayExecutor": "._ray",  # Ray is optional: imported when asked for
    "TrialProtocol": "._protocol", "Verdict": "._protocol", "GroupHooks": "._protocol", "TrialTimeout": "._protocol",
    "RunHalted": "._protocol", "error_text": "._protocol",
    "StaticFluid": "._fluid", "DynamicFluid": "._fluid", "FluidScheduler": "._fluid", "fluid_shares": "._fluid",
    "fluid_policy": "._fluid",
    "ThreadPolicy": "._threads", "ThreadPlan": "._threads",
    "Channel": "._channel", "ChannelClosed": "._channel", "PipeChannel": "._channel", "HubChannel": "._channel",
    "CheckpointStorage": "._ray_storage",
}
_ALIASES = {"Inline": "InlineExecutor", "Process": "ProcessExecutor", "Ray": "RayExecutor"}

__all__ = ["Executor", "RunContext", "Inline", "Process", "Ray", "InlineExecutor", "ProcessExecutor", "RayExecutor",
           "make_executor", "check_forks", "TrialProtocol", "Verdict", "GroupHooks", "TrialTimeout", "RunHalted",
           "error_text", "StaticFluid", "DynamicFluid", "FluidScheduler", "fluid_shares", "fluid_policy",
           "ThreadPolicy", "ThreadPlan", "Channel", "ChannelClosed", "PipeChannel", "HubChannel", "CheckpointStorage"]

_lazy_getattr, __dir__ = lazy_names(__name__, _DEFINED, globals(), __all__)


def __getattr__(name: str) -> object:
    if name in _ALIASES:
        value = _lazy_getattr(_ALIASES[name])
        globals()[name] = value
        return value
    return _lazy_getattr(name)
