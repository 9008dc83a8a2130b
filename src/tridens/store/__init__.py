"""The experiment store: experiments, trials, per-step metrics and checkpoints in one SQLite file.

>>> import tempfile, os
>>> from tridens.store import Store
>>> from tridens.trial import Trial
>>> with Store(os.path.join(tempfile.mkdtemp(), "tridens.db")) as store:
...     _ = store.create_experiment("search", {"space": "models:Net", "max_trials": 8})
...     trial = store.add_trial("search", Trial(id=-1, sample={"width": 32}, seed=0))
...     store.add_metrics(trial.id, 0, {"val_acc": 0.91})
...     print(store.trials("search")[0].metrics)
{'val_acc': [0.91]}
"""

from ..errors import StorageFault, StoreError
from ._records import ExperimentRecord
from ._schema import CURRENT_VERSION
from ._sqlite import Store, info_problem, storage_fault
from ._stages import StageArchive, StageCleanup, StageHit, StagePolicy, StageRecord, clean_stages, stage_tree

__all__ = ["Store", "ExperimentRecord", "StoreError", "StorageFault", "CURRENT_VERSION", "StageArchive", "StageHit", "StagePolicy",
           "StageRecord", "StageCleanup", "stage_tree", "clean_stages", "info_problem",
           "storage_fault"]
