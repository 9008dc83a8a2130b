"""``nni.retiarii.nn.pytorch``: every ``torch.nn`` name, plus the Retiarii choices on tridens.

``ValueChoice(candidates, label=)`` is ``td.choice``: inside a space's ``__init__`` it is the
chosen value itself, so it goes into any constructor argument (arithmetic on it is plain
arithmetic). ``LayerChoice``, ``InputChoice``, ``Repeat``, ``Cell`` are ``tridens.nn``'s. A
multi-trial search needs ``@model_wrapper`` (``tridens.compat.nni.retiarii``) on the top-level
class; the one-shot trainers also take a plain ``Module`` (see :class:`Module`).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn as _nn
from torch.nn import *  # noqa: F401,F403 -- NNI re-exports every torch.nn name here

import tridens as _td
from tridens.nn import ChosenInputs  # noqa: F401
from tridens.space._context import active_resolver

from ..._common import NotSupported, only_default
from ..._graph_mutator import Placeholder  # noqa: F401
from ..._scope import scoped
from ..._spaces import Cell, InputChoice, LayerChoice, NasBench101Cell, NasBench201Cell, Repeat  # noqa: F401


class Module(_nn.Module, metaclass=type(_td.ModelSpace)):
    """``nni.retiarii.nn.pytorch.Module``: torch's ``Module`` built as a tridens space is built.
    Constructed outside any space, its ``__init__`` runs under tridens' recording resolver (each
    choice takes its first candidate) and its arguments are kept, so a plain module holding
    choices can be given to NNI 2.x's one-shot trainers (``DartsTrainer``...) and to
    ``RetiariiExperiment``, which rebuild it as a space. Inside a space, or under ``fixed_arch``,
    it is built as any module.

    >>> class Net(Module):                     # no @model_wrapper            # doctest: +SKIP
    ...     def __init__(self, width):
    ...         super().__init__()
    ...         self.op = LayerChoice([Conv2d(1, width, 3, padding=1), Conv2d(1, width, 5, padding=2)], label="op")
    """


def ValueChoice(candidates: Sequence[Any], *, prior: Any = None, label: str | None = None) -> Any:
    """``nn.ValueChoice([16, 32], label="width")`` = ``td.choice("width", [16, 32])``."""
    only_default("ValueChoice", "prior", prior, None, "tridens' strategies sample candidates uniformly.")
    if label is None:
        resolver = active_resolver()
        if resolver is None:
            raise NotSupported("A ValueChoice outside a model space's __init__ (an evaluator hyperparameter) needs "
                               "label=...; tridens resolves it from the trial's sample by that label.")
        label = resolver.auto_label("valuechoice")
    return _td.choice(scoped(label) or label, list(candidates))
