"""NNI 2.x's Retiarii API (``nni.retiarii``) on tridens: change only the import lines.

    import nni.retiarii.nn.pytorch as nn                 ->  import tridens.compat.nni.retiarii.nn.pytorch as nn
    from nni.retiarii import model_wrapper, fixed_arch   ->  from tridens.compat.nni.retiarii import model_wrapper, fixed_arch
    import nni.retiarii.strategy as strategy             ->  import tridens.compat.nni.retiarii.strategy as strategy
    import nni.retiarii.evaluator.pytorch.lightning as pl ->  import tridens.compat.nni.retiarii.evaluator.pytorch.lightning as pl
    from nni.retiarii.experiment.pytorch import ...      ->  from tridens.compat.nni.retiarii.experiment.pytorch import ...
    from nni.retiarii.oneshot.pytorch import DartsTrainer ->  from tridens.compat.nni.retiarii.oneshot.pytorch import DartsTrainer

``@model_wrapper`` turns the decorated ``nn.Module`` class into a ``tridens.nn.ModelSpace``;
``basic_unit`` and ``serialize`` are not needed (tridens refers to code by import path).
``Mutator`` (NNI's graph mutators, ``applied_mutators``) edits tridens' graph IR through NNI's
graph names (see ``tridens.compat.nni._graph_mutator``).
"""

from __future__ import annotations

from typing import Any

from tridens.space._model_space import ModelSpace
from torch import nn as _nn

from .._common import NotSupported
from .._fixed import fixed_arch
from .._graph_mutator import Edge, Graph, InvalidMutation, Model, Mutator, Node, Operation, Placeholder, Sampler
from .._spaces import PlainModuleSpace, has_unbound_choices

__all__ = ["model_wrapper", "fixed_arch", "basic_unit", "serialize", "as_space", "Mutator", "Sampler", "InvalidMutation",
           "Model", "Graph", "Node", "Edge", "Operation", "Placeholder"]


def model_wrapper(cls: type) -> type:
    """``@model_wrapper class Net(nn.Module)``: the same class, made a ``tridens.nn.ModelSpace``
    (its choices resolve while ``__init__`` runs). Keeps the name and module, so the space can be
    rebuilt by import path (``tridens export`` / ``td.load``)."""
    if not isinstance(cls, type) or not issubclass(cls, _nn.Module):
        raise NotSupported(f"model_wrapper decorates an nn.Module class. Got {cls!r} instead.")
    if issubclass(cls, ModelSpace):
        return cls
    return type(cls.__name__, (cls, ModelSpace), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                  "__doc__": cls.__doc__})


def as_space(owner: str, model: Any) -> ModelSpace:
    """``model`` as a space: a space is itself; a plain module built from this package's ``nn.Module``
    (its arguments kept, see ``tridens.compat.nni.retiarii.nn.pytorch.Module``) is built again as
    ``@model_wrapper`` would have built it; a ``torch.nn.Module`` holding ``LayerChoice`` /
    ``InputChoice`` built outside any space becomes a :class:`~tridens.compat.nni._spaces.PlainModuleSpace`;
    anything else is an error naming ``owner``."""
    if isinstance(model, ModelSpace):
        return model
    init = getattr(model, "__dict__", {}).get("_tridens_init")
    if isinstance(model, _nn.Module) and init is not None:
        args, kwargs = init
        return model_wrapper(type(model))(*args, **kwargs)
    if has_unbound_choices(model):
        return PlainModuleSpace(model)
    raise NotSupported(f"The 'model' parameter of {owner} must be a model space: derive its class from "
                       f"tridens.compat.nni.retiarii.nn.pytorch's nn.Module, decorate it with @model_wrapper, or derive "
                       f"it from tridens.nn.ModelSpace. Got {type(model).__name__} instead.")


def basic_unit(cls: Any = None, **_: Any) -> Any:
    """Not needed in tridens (modules are not traced into a graph): returns the class unchanged."""
    return cls if cls is not None else (lambda c: c)


def serialize(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """``nni.retiarii.serialize(cls, *args)``: tridens needs no serialization wrapper; builds the object."""
    return cls(*args, **kwargs)
