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


class RegularizedEvolution(_s.RegularizedEvolution):
    """NNI's ``RegularizedEvolution`` as ``td.strategy.RegularizedEvolution``. ``optimize_mode``
    (NNI 2.x: ``'maximize'`` or ``'minimize'``) is the direction of the run's objective: the
    evolution, the live line's best and the views follow it.

    >>> RegularizedEvolution(optimize_mode="minimize", population_size=8, sample_size=4).mode
    'min'
    """

    def __init__(self, optimize_mode: str = "maximize", population_size: int = 100, sample_size: int = 25,
                 mutation_prob: float = 0.05, crossover: bool = False, dedup: bool = True, seed: int | None = None,
                 **_: Any) -> None:
        if optimize_mode not in ("maximize", "minimize"):
            raise NotSupported(f"The 'optimize_mode' parameter of RegularizedEvolution must be 'maximize' or "
                               f"'minimize'. Got {optimize_mode!r} instead.")
        super().__init__(population=population_size, sample_size=sample_size, mutation_prob=mutation_prob)
        self.optimize_mode = optimize_mode

    @property
    def mode(self) -> str:
        """The objective's mode ``optimize_mode`` names (``"max"`` or ``"min"``)."""
        return "min" if self.optimize_mode == "minimize" else "max"


def TPE(**_: Any) -> _s.TPE:
    return _s.TPE()


def PolicyBasedRL(**_: Any) -> Any:
    """NNI's multi-trial PPO strategy is not provided: this raises, suggesting the alternatives."""
    raise NotSupported("PolicyBasedRL (a PPO policy proposing trials) is not provided by tridens. Use "
                       "td.strategy.TPE or td.strategy.RegularizedEvolution for a multi-trial search, or "
                       "ENAS (td.oneshot.ENAS: an LSTM controller trained by REINFORCE on a supernet).")
