"""Cross-model optimizations: execution units that train many trials cheaper than one by one.

Every optimization is a planner (:class:`tridens.units.Planner`) listed in :data:`OPTIMIZATIONS`,
the one place the engine's planner reads; they are asked in that order, each taking the jobs it can
fuse and leaving the rest to the next; whatever is left trains separately. :data:`PASSES` then
rewrite the planned units.

* super-graph (:mod:`._supergraph`): a child that inherits its parent's weights trains merged with it.
* stage trees (:mod:`._stages`): trials that share a training prefix (same model, seed and weights,
  same hyperparameters up to an epoch) train it once, then fork.
* frozen prefixes (:func:`.cse.plan_frozen_prefixes`): trials whose models start with the same
  frozen subgraph (a pretrained backbone) compute it once per batch; before batching, which would
  run it once per fused model.
* operator batching (:mod:`._batching`): same-shaped models as one vectorized model.
* common sub-expression elimination (:mod:`._cse`): trials sharing a data pipeline read one
  loader (each batch augmented once), and a shared frozen prefix runs once per batch.
* mixed units (a pass, :func:`.cse.merge_pipelines`): batched groups that read the same data as
  other units join them in one shared pipeline.

Their knobs are one frozen :class:`Settings` (``td.executors.Inline(optimize=Settings(...))``; with
``optimize=True`` the defaults and the environment, :meth:`Settings.from_env`), given by the
planner to every optimization and pass as ``settings=``, with the run's
:class:`tridens.units.PlanContext` as ``context=`` (memory bound, decisions measured so far, the
stage trees' prefix cache and archive): nothing of a run is kept in a module.

>>> import tridens.xopt as xopt
>>> [optimization.name for optimization in xopt.OPTIMIZATIONS]
['supergraph', 'stage tree', 'frozen prefix', 'batching', 'cse']
"""

from ..units import Optimization, UnitPass
from . import _batching as batching
from . import _cse as cse
from ._batching import BatchedUnit, plan_batching
from ._cse import (PipelineMember, SharedPipelineUnit, SharedPrefix, TrainerMember, merge_pipelines, plan_cse,
                   plan_frozen_prefixes)
from ._stages import StageTreeUnit, plan_stage_trees, prefix_cache
from ._settings import BatchingSettings, CSESettings, Settings, resolve_settings
from ._supergraph import inherit_from_trial, plan_supergraph

OPTIMIZATIONS: tuple[Optimization, ...] = (
    Optimization("supergraph", plan_supergraph),  # first: a child merged with its parent stays with it
    Optimization("stage tree", plan_stage_trees),  # before batching: a shared prefix is not trained at all
    Optimization("frozen prefix", plan_frozen_prefixes),  # before batching: a shared backbone runs once per batch
    Optimization("batching", plan_batching),
    Optimization("cse", plan_cse),
)
"""The cross-model optimizations the planner asks, in order."""

PASSES: tuple[UnitPass, ...] = (
    UnitPass("mixed units", merge_pipelines),  # batched groups join shared pipelines
)
"""The passes over the planned units, in order."""

__all__ = ["OPTIMIZATIONS", "PASSES", "Settings", "BatchingSettings", "CSESettings", "resolve_settings", "StageTreeUnit", "plan_stage_trees", "prefix_cache", "BatchedUnit", "plan_batching", "batching",
           "SharedPipelineUnit", "PipelineMember", "TrainerMember", "SharedPrefix", "plan_cse", "plan_frozen_prefixes", "merge_pipelines",
           "plan_supergraph", "inherit_from_trial", "cse"]
