"""``nni.retiarii.evaluator.functional`` (NNI 2.x): ``FunctionalEvaluator(function, **kwargs)`` calls
``function(model_cls, **kwargs)`` with the model's *class*, as NNI 2.x does: ``model_cls()`` gives
the trial's model (NNI 3's ``nni.nas.evaluator.FunctionalEvaluator`` hands the instance itself)."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ...nas.evaluator import FunctionalEvaluator as _FunctionalEvaluator3

__all__ = ["FunctionalEvaluator"]


class ModelClass:
    """What NNI 2.x's evaluation function receives: calling it gives the trial's model."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> nn.Module:
        return self.model

    def __repr__(self) -> str:
        return f"ModelClass({type(self.model).__name__})"


class _WithModelClass:
    def __init__(self, function: Callable[..., Any]):
        self.function = function

    def __call__(self, model: nn.Module, **kwargs: Any) -> Any:
        return self.function(ModelClass(model), **kwargs)


class FunctionalEvaluator(_FunctionalEvaluator3):
    """``FunctionalEvaluator(function, **kwargs)``: ``function(model_cls, **kwargs)`` builds the model
    with ``model_cls()``, trains it and reports with ``nni.report_intermediate_result`` /
    ``nni.report_final_result``.

    >>> def evaluate(model_cls):            # doctest: +SKIP
    ...     model = model_cls()
    """

    def __init__(self, function: Callable[..., Any], **kwargs: Any):
        super().__init__(_WithModelClass(function), **kwargs)
