"""Model spaces: inline choices, search-space description, freezing (see ``tridens.nn`` too)."""

from ._choice import Choice, Expr, choice, labels_in, loguniform, randint, resolve_value, uniform
from ._domain import Categorical, Condition, Domain, LabelSpec, LogUniform, RandInt, SearchSpace, Uniform

__all__ = [
    "Choice", "Expr", "choice", "uniform", "loguniform", "randint", "resolve_value", "labels_in",
    "Domain", "Categorical", "Uniform", "LogUniform", "RandInt", "Condition", "LabelSpec", "SearchSpace",
]
