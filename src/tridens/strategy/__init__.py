"""Multi-trial exploration strategies behind one interface, :class:`Strategy`.

Proposing strategies (what to train next): :class:`Random`, :class:`GridSearch`,
:class:`RegularizedEvolution`, :class:`TPE`. Multi-fidelity strategies (what to train next and
which running trial to stop): :class:`Hyperband`, :class:`BOHB`, :class:`ASHA`, and the
sub-sampling bandit :class:`SS`, its asynchronous variant :class:`AsyncSS` and :class:`BOSS`. Population
Based Training, which forks running trials onto better ones' state: :class:`PBT`. Optuna's median
pruner: :class:`MedianStopping`. A proposing strategy takes a stopping rule as a policy object, as
an Optuna sampler takes a pruner: ``TPE(stopping=ASHA())``, ``Random(stopping=MedianStopping())``.
Constraints on measured facts of a model and the Pareto front of several objectives:
:class:`Constraint`, :func:`pareto_front`.
"""

from ._asha import ASHA
from ._base import Strategy
from ._bohb import BOHB
from ._boss import BOSS
from ._constraints import Constraint, best_first, pareto_front
from ._evolution import RegularizedEvolution
from ._grid import GridSearch
from ._hyperband import Hyperband
from ._median import MedianStopping
from ._pbt import PBT
from ._random import Random
from ._ss import SS, AsyncSS
from ._tpe import TPE

__all__ = [
    "Strategy",
    "Random", "GridSearch", "RegularizedEvolution", "TPE",
    "Hyperband", "BOHB", "ASHA", "SS", "AsyncSS", "BOSS", "MedianStopping", "PBT",
    "Constraint", "pareto_front", "best_first",
]
