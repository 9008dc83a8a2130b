"""tridens: exploratory training for PyTorch.

Describe a space of models (a base model plus mutations), pick a strategy, and tridens
instantiates, trains, compares and stops the models.

>>> import tridens as td
>>> lr = td.choice("lr", [0.01, 0.1])

Names are imported on first use: ``import tridens`` is cheap, and commands that only read a
store (``tridens ls``, ``show``, ``top``) start without loading PyTorch.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .errors import GraphError, InvalidSample, InvalidSpace, StoreError, TridensError
from .trial import Decision, Objective, Trial, TrialGroup, TrialStatus

if TYPE_CHECKING:
    from . import datasets, evaluators, executors, graph, hub, loggers, nn, oneshot, space, store, strategy
    from . import warmup, xopt
    from .engine import Budget, Experiment, RunOptions, load, retrain
    from .evaluators import report
    from .space import ModelSpace, Mutator, choice, loguniform, randint, uniform

__version__ = "0.1.0"

_SUBMODULES = {"datasets", "evaluators", "executors", "graph", "hub", "loggers", "nn", "oneshot", "space",
               "store", "strategy", "warmup", "xopt"}
# public name -> the module that defines it
_NAMES = {
    "Experiment": ".engine", "Budget": ".engine", "RunOptions": ".engine", "load": ".engine", "retrain": ".engine", "report": ".evaluators",
    "ModelSpace": ".space", "Mutator": ".space", "choice": ".space", "loguniform": ".space",
    "randint": ".space", "uniform": ".space",
}

__all__ = [
    "ModelSpace", "Mutator", "choice", "uniform", "loguniform", "randint",
    "Experiment", "Budget", "RunOptions", "load", "retrain", "report",
    "TridensError", "InvalidSpace", "InvalidSample", "GraphError", "StoreError",
    "Trial", "TrialGroup", "TrialStatus", "Objective", "Decision", "hub",
    "nn", "space", "graph", "strategy", "evaluators", "datasets", "store", "warmup", "oneshot", "executors", "loggers",
    "xopt",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name], __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
