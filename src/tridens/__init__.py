"""tridens: exploratory training for PyTorch.

Describe a space of models (a base model plus mutations), pick a strategy, and tridens
instantiates, trains, compares and stops the models.

>>> import tridens as td
>>> lr = td.choice("lr", [0.01, 0.1])
"""

from . import datasets, evaluators, graph, nn, space, store, strategy
from . import loggers, oneshot, warmup
from . import hub
from .engine import Experiment, load
from . import executors
from .errors import GraphError, InvalidSample, InvalidSpace, StoreError, TridensError
from .evaluators import report
from .space import Mutator, choice, loguniform, randint, uniform
from .space._model_space import ModelSpace
from .trial import Decision, Objective, Trial, TrialGroup, TrialStatus

__version__ = "0.1.0"

__all__ = [
    "ModelSpace", "Mutator", "choice", "uniform", "loguniform", "randint",
    "Experiment", "load", "report",
    "TridensError", "InvalidSpace", "InvalidSample", "GraphError", "StoreError",
    "Trial", "TrialGroup", "TrialStatus", "Objective", "Decision", "hub",
    "nn", "space", "graph", "strategy", "evaluators", "datasets", "store", "warmup", "oneshot", "executors", "loggers",
    "xopt",
]


def __getattr__(name: str) -> object:
    """``td.xopt`` (the cross-model optimizations, e.g. ``td.xopt.Settings``), imported on first
    use: a run imports it when it plans its first group."""
    if name == "xopt":
        import importlib

        return importlib.import_module(".xopt", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
