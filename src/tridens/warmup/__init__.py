"""Warm start (ModelKeeper): a zoo of trained models, a graph matcher and a weight transformer.

>>> import tridens as td
>>> zoo = td.warmup.Zoo("tridens.db")                                  # doctest: +SKIP
>>> zoo.add(trained, torch.zeros(1, 1, 8, 8), accuracy=0.95)           # doctest: +SKIP
>>> ws = zoo.warm_start(new_model, torch.zeros(1, 1, 8, 8))            # doctest: +SKIP
>>> td.Experiment(space, evaluator, "evolution",
...               options=td.RunOptions(warm_start=True))   # doctest: +SKIP

* :func:`describe` -- the compact JSON description of a model's IR that the zoo keeps;
* :func:`score` / :func:`align` -- the DP alignment (MATCH = fraction of inheritable weight
  elements, SKIP child 0, SKIP parent -1; score = total / child nodes);
* :func:`transfer` -- parent weights onto the aligned child (copy, slice/pad, Net2Wider, Net2Deeper,
  centred kernels, BatchNorm statistics);
* :class:`Zoo` -- entries beside a tridens store; parent by similarity bucket then accuracy;
  k-medoids clusters above a size threshold; admission of accuracy outliers; eviction under a cap.
"""

from ._ir import describe
from ._match import align, node_score, score
from ._transform import replication_map, transfer
from ._zoo import Entry, WarmStart, Zoo, ZooError, ZooWarning

__all__ = ["Zoo", "ZooError", "ZooWarning", "Entry", "WarmStart", "describe", "score", "align",
           "node_score", "transfer", "replication_map", "warm_start"]


def warm_start(child, parent, child_inputs=None, parent_inputs=None, *, widen="replicate"):
    """Load ``parent``'s weights (an nn.Module) into ``child`` through alignment and transformation,
    without a zoo. Returns (score, stats). ``widen``: see :func:`transfer`.

    >>> score, stats = td.warmup.warm_start(wide_mlp, trained_mlp, x, x)   # doctest: +SKIP
    """
    cd, pd = describe(child, child_inputs), describe(parent, parent_inputs)
    s, pairs = align(cd, pd)
    new, stats = transfer(cd, pd, pairs, parent.state_dict(), child.state_dict(), widen=widen)
    child.load_state_dict(new)
    return s, stats
