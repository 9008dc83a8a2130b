"""``nni.nas.evaluator.FunctionalEvaluator`` on tridens."""

from __future__ import annotations

from typing import Any, Callable

from tridens.evaluators import FunctionalEvaluator as _FunctionalEvaluator

from ... import _FINAL

__all__ = ["FunctionalEvaluator"]


class _WithFinalResult:
    """Calls the user's function; ``nni.report_final_result`` inside it sets the final value."""

    def __init__(self, function: Callable[..., Any]):
        self.function = function

    def __call__(self, model: Any, **kwargs: Any) -> Any:
        holder: list[float] = []
        token = _FINAL.set(holder)
        try:
            result = self.function(model, **kwargs)
        finally:
            _FINAL.reset(token)
        return holder[-1] if holder else result


class FunctionalEvaluator(_FunctionalEvaluator):
    """``FunctionalEvaluator(function, **kwargs)``: ``function(model, **kwargs)`` trains the model and
    reports with ``nni.report_intermediate_result`` / ``nni.report_final_result``."""

    def __init__(self, function: Callable[..., Any], **kwargs: Any):
        super().__init__(_WithFinalResult(function), **kwargs)
