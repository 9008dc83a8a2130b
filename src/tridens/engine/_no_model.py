"""The space of a hyperparameter-only search: ``td.Experiment(None, FunctionalEvaluator(fn, ...))``.

There is no model to build: the user's function builds its own, and the evaluator's
hyperparameters are the whole search space. Trials have no fingerprint and no parameter count
(nothing the engine built could be counted), and two trials are the same when their
hyperparameters are.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..space import BaseSpace, SearchSpace

__all__ = ["NoModelSpace"]


class NoModelSpace(BaseSpace):
    """A space with no labels and no model; :meth:`freeze` returns ``None``.

    >>> NoModelSpace().search_space().describe()
    {}
    """

    example_inputs = None

    def search_space(self) -> SearchSpace:
        return SearchSpace([])

    def restrict(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def freeze(self, sample: Mapping[str, Any], **_: Any) -> Any:
        return None

    def __repr__(self) -> str:
        return "NoModelSpace()"
