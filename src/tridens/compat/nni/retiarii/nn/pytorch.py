"""``nni.retiarii.nn.pytorch``: every ``torch.nn`` name, plus the Retiarii choices on tridens.

``ValueChoice(candidates, label=)`` is ``td.choice``: inside a space's ``__init__`` it is the
chosen value itself, so it goes into any constructor argument (arithmetic on it is plain
arithmetic). ``LayerChoice``, ``InputChoice``, ``Repeat``, ``Cell`` are ``tridens.nn``'s. The
top-level class still needs ``@model_wrapper`` (``tridens.compat.nni.retiarii``).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch.nn import *  # noqa: F401,F403 -- NNI re-exports every torch.nn name here
from torch.nn import Module  # noqa: F401

import tridens as _td
from tridens.nn import ChosenInputs  # noqa: F401
from tridens.space._context import active_resolver

from ..._common import NotSupported, only_default
from ..._scope import scoped
from ..._spaces import Cell, InputChoice, LayerChoice, NasBench101Cell, NasBench201Cell, Repeat  # noqa: F401


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
