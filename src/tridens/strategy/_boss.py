"""BOSS (Huang et al., arXiv 2007.05670): Bayesian optimization proposes, sub-sampling evaluates.

Each bracket is Hyperband's (one TrialGroup, ``n`` configurations, rung budgets
``R // eta**(s - i)``) run with :class:`SS`'s rule at its rungs instead of successive halving;
its configurations come from the same surrogate as :class:`BOHB`'s: **Optuna's TPESampler**,
fitted on the objective's values at the largest budget that has at least ``min_points_in_model``
of them (every trial that reached the budget counts, stopped ones included), with a fraction
``random_fraction`` of each bracket drawn at random. The paper refits its surrogate after every
bracket on the SS outputs near the next bracket's smallest budget (vega's ``boss.py`` fits a
random forest there); we fit before every bracket on everything observed so far, as BOHB does,
so both model-based strategies differ only in how a bracket is evaluated.
"""

from __future__ import annotations

from ._bohb import BOHB
from ._common import check_bool, check_float, check_int
from ._hyperband import Hyperband
from ._ss import SS

__all__ = ["BOSS"]


class BOSS(SS, BOHB):
    """SS brackets with TPE proposals (see the module docstring).

    Parameters as :class:`BOHB`: ``min_steps``, ``max_steps`` (required), ``reduction_factor``,
    ``random_fraction``, ``min_points_in_model`` (default ``max(d + 1, 20)`` for ``d`` labels),
    ``n_ei_candidates``, ``multivariate``.

    >>> BOSS(max_steps=9).schedule()
    [(9, [1, 3, 9]), (5, [3, 9]), (3, [9])]
    """

    _kind = "boss"

    def _check(self) -> None:
        Hyperband._check(self)
        check_float("BOSS", "random_fraction", self.random_fraction, 0.0, 1.0)
        check_int("BOSS", "min_points_in_model", self.min_points_in_model, 1, optional=True)
        check_int("BOSS", "n_ei_candidates", self.n_ei_candidates, 1)
        check_bool("BOSS", "multivariate", self.multivariate)
