"""Model spaces: inline choices, search-space description, freezing (see ``tridens.nn`` too)."""

from ._choice import Choice, Expr, choice, labels_in, loguniform, randint, resolve_value, uniform
from ._model_space import BaseSpace, ModelSpace, Mutation
from ._mutator import Mutator, MutatorSpace
from ._domain import Categorical, Condition, Domain, LabelSpec, LogUniform, RandInt, SampleRule, SearchSpace, Uniform
from ._recipe import RecipeError, build_space, import_object, object_path, space_recipe

__all__ = [
    "BaseSpace", "ModelSpace", "Mutation", "Mutator", "MutatorSpace",
    "Choice", "Expr", "choice", "uniform", "loguniform", "randint", "resolve_value", "labels_in",
    "Domain", "Categorical", "Uniform", "LogUniform", "RandInt", "Condition", "LabelSpec", "SampleRule", "SearchSpace",
    "RecipeError", "build_space", "import_object", "object_path", "space_recipe",
]
