"""Grid search."""

from __future__ import annotations

from typing import Any, Iterator

from ..errors import InvalidSpace
from ..trial import TrialGroup
from ._base import Strategy
from ._common import SearchBase, cap, check_int, sample_key

__all__ = ["GridSearch"]


class GridSearch(SearchBase):
    """Every sample of ``space.grid()``, in that order, ``batch_size`` per group; then done.

    The grid does not adapt to results, so groups are larger than the adaptive strategies' (16):
    the planner shares work within a group (a frozen backbone computed once per batch for all of
    its trials, one data pipeline), and splits a group into units within ``max_unit_memory``.

    Needs a finite space (categorical and randint labels); a continuous label is an error in
    :meth:`start`. Samples already in the history (a resumed search) are skipped, so the grid
    continues where it stopped. No randomness. ``stopping``: a rule that stops running trials
    early (:class:`ASHA`, :class:`Hyperband`, :class:`MedianStopping`).
    """

    finite = True   # every sample once

    def __init__(self, batch_size: int = 16, stopping: Strategy | None = None):
        self.batch_size = batch_size
        self.stopping = stopping

    def _check(self) -> None:
        check_int("GridSearch", "batch_size", self.batch_size, 1)

    def _setup(self) -> None:
        continuous = [(label, spec.domain) for label, spec in self.space.items() if not spec.domain.finite]
        if continuous:
            label, domain = continuous[0]
            raise InvalidSpace(
                f"GridSearch needs a finite search space, but label {label!r} is continuous ({domain!r}). "
                f"Make it a choice of values, or use Random or TPE.")
        self._grid: Iterator[dict[str, Any]] = self.space.grid()

    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        self._require_started()
        samples: list[dict[str, Any]] = []
        n = cap(self.batch_size, remaining)
        while len(samples) < n:
            sample = next(self._grid, None)
            if sample is None:
                break
            if sample_key(sample) not in self._seen:
                samples.append(self._accept(sample))
        return self._group(samples, "grid")
