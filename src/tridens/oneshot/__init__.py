"""One-shot NAS: train one supernet holding every model of a space, then search its subnets.

The supernet is built from the same :class:`~tridens.ModelSpace` the multi-trial strategies use
(``LayerChoice`` -> every candidate, ``InputChoice`` -> every input, int choices in constructor
arguments -> one largest weight sliced per sample, a ``Repeat`` depth -> the largest depth cut
per sample). Pass a strategy to ``td.Experiment`` like a multi-trial one::

    exp = td.Experiment(space, td.evaluators.Classification(train, val, epochs=5),
                        td.oneshot.DARTS(retrain=True), store="tridens.db", name="darts")
    exp.run()
    exp.top(5)        # architectures scored with inherited weights, and the retrained best

Strategies: :class:`RandomOneShot` (SPOS), :class:`DARTS`, :class:`GumbelDARTS`, :class:`ENAS`.
:func:`build_supernet` gives the supernet itself (``set_path(sample)``, ``extract(sample)``).
"""

from ._strategies import DARTS, ENAS, Controller, GumbelDARTS, OneShotStrategy, RandomOneShot, gumbel_softmax
from ._supernet import ArchState, MixedCell, MixedDepth, MixedEdge, MixedInput, MixedLayer, Supernet, build_supernet
from ._run import OneShotTrials, TrialLife, note_training, run_oneshot
from ._training import SupernetLoop, SupernetTraining

__all__ = [
    "OneShotStrategy", "RandomOneShot", "DARTS", "GumbelDARTS", "ENAS", "Controller", "gumbel_softmax",
    "Supernet", "build_supernet", "ArchState", "MixedLayer", "MixedInput", "MixedDepth",
    "MixedEdge", "MixedCell", "run_oneshot", "OneShotTrials", "TrialLife", "SupernetLoop", "SupernetTraining",
    "note_training",
]
