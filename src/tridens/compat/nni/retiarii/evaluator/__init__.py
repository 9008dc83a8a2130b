"""``nni.retiarii.evaluator``: ``FunctionalEvaluator`` (see ``tridens.compat.nni.nas.evaluator``)."""

from ...nas.evaluator import FunctionalEvaluator

__all__ = ["FunctionalEvaluator"]
