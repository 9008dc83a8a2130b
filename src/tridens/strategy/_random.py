"""Random search."""

from __future__ import annotations

from ..trial import TrialGroup
from ._base import Strategy
from ._common import SearchBase, cap, check_int

__all__ = ["Random"]


class Random(SearchBase):
    """Random samples of the space, never the same sample twice.

    Each :meth:`ask` hands over one group of ``batch_size`` samples (fewer at the end of a finite
    space or of the engine's budget). A sample the engine reports as a ``DUPLICATE`` (same model
    as an earlier trial) costs a slot and is simply not proposed again; the next group replaces
    it. The search ends when every sample of a finite space has been proposed. ``stopping``: a
    rule that stops running trials early (:class:`ASHA`, :class:`Hyperband`,
    :class:`MedianStopping`), as an Optuna pruner beside the sampler.

    >>> import random
    >>> from tridens import Objective
    >>> from tridens.space import Categorical, LabelSpec, SearchSpace
    >>> s = Random(batch_size=2)
    >>> s.start(SearchSpace([LabelSpec("w", Categorical([16, 32, 64]))]), Objective(), random.Random(0))
    >>> len(s.ask()), len(s.ask()), s.ask()
    (2, 1, None)
    """

    def __init__(self, batch_size: int = 8, stopping: Strategy | None = None):
        self.batch_size = batch_size
        self.stopping = stopping

    def _check(self) -> None:
        check_int("Random", "batch_size", self.batch_size, 1)

    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        self._require_started()
        return self._group(self._propose_random(cap(self.batch_size, remaining)), "random")
