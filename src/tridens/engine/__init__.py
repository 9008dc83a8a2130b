"""The engine: ``Experiment`` (ask, instantiate, dedup, run groups, store) and its executors."""

from ._execution import Executor, InlineExecutor, ProcessExecutor
from ._experiment import Experiment
from ._fluid import DynamicFluid, FluidScheduler, StaticFluid, fluid_shares
from ._export import load
from ._threads import ThreadPlan, ThreadPolicy

__all__ = ["Experiment", "Executor", "InlineExecutor", "ProcessExecutor", "load",
           "StaticFluid", "DynamicFluid", "FluidScheduler", "fluid_shares",
           "ThreadPolicy", "ThreadPlan"]
