"""tridens: exploratory training for PyTorch.

>>> import tridens as td
>>> lr = td.choice("lr", [0.01, 0.1])
"""

from . import space, strategy
from .errors import GraphError, InvalidSample, InvalidSpace, TridensError
from .space import choice, loguniform, randint, uniform
from .trial import Decision, Objective, Trial, TrialGroup, TrialStatus

__version__ = "0.1.0"

__all__ = [
    "choice", "uniform", "loguniform", "randint",
    "TridensError", "InvalidSpace", "InvalidSample", "GraphError",
    "Trial", "TrialGroup", "TrialStatus", "Objective", "Decision",
    "space", "strategy",
]
