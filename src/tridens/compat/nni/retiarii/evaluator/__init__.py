"""``nni.retiarii.evaluator``: NNI 2.x's ``FunctionalEvaluator`` (the function gets the model class)."""

from .functional import FunctionalEvaluator

__all__ = ["FunctionalEvaluator"]
