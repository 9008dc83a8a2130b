"""``nni.nas.evaluator.pytorch.lightning`` (the same names as ``nni.nas.evaluator.pytorch``)."""

from ...._lightning import (Classification, ClassificationModule, DataLoader, Lightning, LightningModule, Regression,
                            RegressionModule, Trainer)

__all__ = ["Classification", "Regression", "DataLoader", "Lightning", "LightningModule", "Trainer",
           "ClassificationModule", "RegressionModule"]
