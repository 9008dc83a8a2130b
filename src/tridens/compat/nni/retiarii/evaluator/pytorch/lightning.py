"""``nni.retiarii.evaluator.pytorch.lightning`` (the same names as ``nni.retiarii.evaluator.pytorch``)."""

from ...._lightning import Classification, DataLoader, Lightning, LightningModule, Regression, Trainer

__all__ = ["Classification", "Regression", "DataLoader", "Lightning", "LightningModule", "Trainer"]
