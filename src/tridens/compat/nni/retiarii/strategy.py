"""``nni.retiarii.strategy`` (NNI 2.x) on tridens: ``Random``, ``GridSearch``,
``RegularizedEvolution``, ``TPE``/``TPEStrategy`` -> ``td.strategy.*``; ``DARTS``, ``GumbelDARTS``,
``ENAS``, ``RandomOneShot`` -> ``td.oneshot.*`` with NNI 2.x's argument names
(``tridens.compat.nni._oneshot``); ``Proxyless`` and ``PolicyBasedRL`` raise, naming the alternative."""

from ..nas.strategy import TPE, GridSearch, PolicyBasedRL, Random, RegularizedEvolution
from .._oneshot import DARTS_v2 as DARTS
from .._oneshot import ENAS_v2 as ENAS
from .._oneshot import GumbelDARTS_v2 as GumbelDARTS
from .._oneshot import Proxyless_v2 as Proxyless
from .._oneshot import RandomOneShot_v2 as RandomOneShot

TPEStrategy = TPE

__all__ = ["Random", "GridSearch", "RegularizedEvolution", "TPE", "TPEStrategy", "PolicyBasedRL",
           "DARTS", "GumbelDARTS", "ENAS", "RandomOneShot", "Proxyless"]
