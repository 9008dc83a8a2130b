"""Model spaces: inline choices, search-space description, freezing (see ``tridens.nn`` too).

The model-space names are imported on first use: strategies and the store's readers need only
the search-space description, and should not load PyTorch.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_names
from ._choice import Choice, Expr, Placeholder, choice, labels_in, loguniform, randint, resolve_value, uniform
from ._context import FixedResolver, RecordingResolver, Resolver, active_resolver, resolve, using
from ._domain import (Categorical, Condition, Domain, LabelSpec, LogUniform, RandInt, SampleRule, SearchSpace, Uniform,
                      same_value)

if TYPE_CHECKING:
    from ._model_space import BaseSpace, ModelSpace, Mutation
    from ._mutator import Mutator, MutatorSpace
    from ._recipe import (RecipeError, build_space, check_frozen, checked_space, import_object, object_path,
                          space_recipe)

# public name -> the module that defines it (each imports torch)
_LAZY = {
    "BaseSpace": "._model_space", "ModelSpace": "._model_space", "Mutation": "._model_space",
    "Mutator": "._mutator", "MutatorSpace": "._mutator",
    "RecipeError": "._recipe", "build_space": "._recipe", "import_object": "._recipe", "object_path": "._recipe",
    "space_recipe": "._recipe", "checked_space": "._recipe", "check_frozen": "._recipe",
}

__all__ = [
    "BaseSpace", "ModelSpace", "Mutation", "Mutator", "MutatorSpace",
    "Choice", "Expr", "choice", "uniform", "loguniform", "randint", "resolve_value", "labels_in",
    "Domain", "Categorical", "Uniform", "LogUniform", "RandInt", "Condition", "LabelSpec", "SampleRule", "SearchSpace",
    "same_value", "Placeholder",
    # the one context through which a choice resolves (set by discovery and by freeze; nn's blocks read it)
    "Resolver", "FixedResolver", "RecordingResolver", "active_resolver", "resolve", "using",
    "RecipeError", "build_space", "checked_space", "check_frozen", "import_object", "object_path", "space_recipe",
]

__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals(), __all__)
