"""Evaluators: how a model is trained and scored.

* :class:`Classification` / :class:`Regression`: declarative supervised training that the engine
  drives epoch by epoch (``evaluator.trainer(model, sample, seed)``) and may fuse across models.
* :class:`FunctionalEvaluator`: the user's own loop, reporting with :func:`report` (``td.report``).
* :class:`Lightning`: a user's ``LightningModule`` under a Lightning ``Trainer`` (``tridens[lightning]``).
* :class:`Tabular`: results looked up in a benchmark table (:mod:`.nasbench201`; learning curves
  recorded by ``bench/record_curves.py`` in a :class:`CurveTable`, charged to a :class:`SimulatedClock`).

>>> import tridens as td
>>> ev = td.evaluators.Classification(train=None, val=None, lr=td.choice("lr", [0.01, 0.1]))
>>> ev.search_space()["lr"].domain
Categorical([0.01, 0.1])
>>> ev.objective
Objective(metric='val_acc', mode='max')
"""

from . import nasbench201
from ._base import Evaluator, NullReporter, RecordingReporter, Reporter, StepwiseEvaluator, Trainer, drive
from ._errors import InvalidParameter, NonFiniteLoss, NothingReported, TrialFailed, TrialStopped
from ._fingerprint import evaluator_fingerprint, fingerprint_changes
from ._functional import FunctionalEvaluator, report
from ._lightning import LIGHTNING_MISSING, Lightning, lightning_package
from ._replay import replay
from ._schedules import SCHEDULES, lr_factor, scheduled_lr
from ._stage_records import dataset_digest, record_digest, stage_record
from ._supervised import (CHECKPOINT_FORMAT, OPTIMIZERS, BatchSource, Classification, Regression, SupervisedEvaluator,
                          SupervisedTrainer, TrainConfig, ValidationSums, align_output, correct_count)
from ._tabular import CurveTable, MemoryTable, SimulatedClock, Table, TableTrainer, Tabular

__all__ = [
    "Evaluator", "StepwiseEvaluator", "Reporter", "NullReporter", "RecordingReporter", "Trainer", "drive",
    "Classification", "Regression", "SupervisedEvaluator", "TrainConfig", "SupervisedTrainer", "BatchSource",
    "ValidationSums",
    "CHECKPOINT_FORMAT", "correct_count", "align_output", "OPTIMIZERS", "SCHEDULES", "lr_factor", "scheduled_lr",
    "FunctionalEvaluator", "report", "replay", "Lightning", "lightning_package", "LIGHTNING_MISSING",
    "Tabular", "Table", "MemoryTable", "CurveTable", "SimulatedClock", "TableTrainer", "nasbench201",
    "InvalidParameter", "TrialFailed", "NonFiniteLoss", "NothingReported", "TrialStopped",
    "stage_record", "record_digest", "dataset_digest", "evaluator_fingerprint", "fingerprint_changes",
]
