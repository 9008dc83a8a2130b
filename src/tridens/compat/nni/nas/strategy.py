"""``nni.nas.strategy`` on tridens (NNI's parameter names accepted)."""

from __future__ import annotations

from typing import Any

from tridens import strategy as _s

__all__ = ["Random", "GridSearch", "RegularizedEvolution", "TPE"]


def Random(dedup: bool = True, seed: int | None = None, **_: Any) -> _s.Random:
    """tridens always deduplicates models by fingerprint; the seed is the experiment's."""
    return _s.Random()


def GridSearch(shuffle: bool = False, seed: int | None = None, **_: Any) -> _s.GridSearch:
    return _s.GridSearch()


def RegularizedEvolution(population_size: int = 100, sample_size: int = 25, mutation_prob: float = 0.05,
                         crossover: bool = False, dedup: bool = True, seed: int | None = None,
                         **_: Any) -> _s.RegularizedEvolution:
    return _s.RegularizedEvolution(population=population_size, sample_size=sample_size, mutation_prob=mutation_prob)


def TPE(**_: Any) -> _s.TPE:
    return _s.TPE()
