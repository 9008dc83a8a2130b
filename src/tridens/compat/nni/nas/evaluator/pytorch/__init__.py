"""``nni.nas.evaluator.pytorch``: ``Classification``, ``Regression`` and ``DataLoader`` on tridens'
declarative evaluators (see ``tridens.compat.nni._lightning``); ``Lightning(ClassificationModule(...),
Trainer(...), ...)`` becomes one of them, a custom ``LightningModule`` is refused."""

from ...._lightning import (Classification, ClassificationModule, DataLoader, Lightning, LightningModule, Regression,
                            RegressionModule, Trainer)

__all__ = ["Classification", "Regression", "DataLoader", "Lightning", "LightningModule", "Trainer",
           "ClassificationModule", "RegressionModule"]
