"""``nni.nas.strategy`` on tridens (NNI's parameter names accepted).

Multi-trial: ``Random``, ``GridSearch``, ``RegularizedEvolution``, ``TPE`` -> ``td.strategy.*``.
One-shot: ``DARTS``, ``GumbelDARTS``, ``ENAS``, ``RandomOneShot`` -> ``td.oneshot.*`` (see
``tridens.compat.nni._oneshot`` for each argument); ``Proxyless`` and ``PolicyBasedRL`` raise,
naming the tridens alternative.
"""

from __future__ import annotations

from typing import Any

from tridens import strategy as _s

from .._common import NotSupported
from .._oneshot import DARTS, ENAS, GumbelDARTS, Proxyless, RandomOneShot

__all__ = ["Random", "GridSearch", "RegularizedEvolution", "TPE", "PolicyBasedRL",
           "DARTS", "GumbelDARTS", "ENAS", "RandomOneShot", "Proxyless"]


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


def PolicyBasedRL(**_: Any) -> Any:
    """NNI's multi-trial PPO strategy is not provided: this raises, suggesting the alternatives."""
    raise NotSupported("PolicyBasedRL (a PPO policy proposing trials) is not provided by tridens. Use "
                       "td.strategy.TPE or td.strategy.RegularizedEvolution for a multi-trial search, or "
                       "ENAS (td.oneshot.ENAS: an LSTM controller trained by REINFORCE on a supernet).")
