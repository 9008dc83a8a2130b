"""Cross-model optimizations: execution units that train many trials cheaper than one by one.

Each optimization registers a planner with :func:`tridens.engine._planner.register` when this
package is imported (the engine imports it before planning). Planners are asked in registration
order, each taking the jobs it can fuse and leaving the rest to the next; whatever is left trains
separately.

* operator batching (:mod:`._batching`): same-shaped models as one vectorized model.
* common sub-expression elimination (:mod:`._cse`): trials sharing a data pipeline read one
  loader (each batch augmented once), and a shared frozen prefix runs once per batch.
* mixed units (a pass over the planned units, :func:`._cse.merge_pipelines`): batched groups that
  read the same data as other units join them in one shared pipeline.
"""

from ..engine._planner import register as _register, register_pass as _register_pass
from . import _batching as batching
from ._batching import BatchedUnit, BatchingSettings, plan_batching

from . import _cse as cse
from ._cse import PipelineMember, SharedPipelineUnit, SharedPrefix, TrainerMember, plan_cse

from ._supergraph import plan_supergraph as _plan_supergraph  # weight inheritance (issue 5): first
_register("supergraph", _plan_supergraph)
_register("batching", plan_batching)
_register("cse", plan_cse)
_register_pass("mixed units", _cse.merge_pipelines)  # batched groups join shared pipelines

__all__ = ["BatchedUnit", "BatchingSettings", "plan_batching", "batching",
           "SharedPipelineUnit", "PipelineMember", "TrainerMember", "SharedPrefix", "plan_cse", "cse"]
