"""tridens: exploratory training for PyTorch.

>>> import tridens as td
>>> lr = td.choice("lr", [0.01, 0.1])
"""

from . import nn, space, strategy
from .errors import GraphError, InvalidSample, InvalidSpace, TridensError
from .space import Mutator, choice, loguniform, randint, uniform
from .space._model_space import ModelSpace
from .trial import Decision, Objective, Trial, TrialGroup, TrialStatus

__version__ = "0.1.0"

__all__ = [
    "ModelSpace", "Mutator", "choice", "uniform", "loguniform", "randint", "nn",
    "TridensError", "InvalidSpace", "InvalidSample", "GraphError",
    "Trial", "TrialGroup", "TrialStatus", "Objective", "Decision",
    "space", "strategy",
]

from . import graph  # noqa: E402  (the graph IR)

__all__ += ["graph"]
