"""``nni.retiarii.evaluator.pytorch``: ``Classification``, ``Regression``, ``DataLoader`` on tridens'
declarative evaluators (``tridens.compat.nni._lightning``); ``Lightning``/``Trainer`` raise."""

from ...._lightning import Classification, DataLoader, Lightning, LightningModule, Regression, Trainer

__all__ = ["Classification", "Regression", "DataLoader", "Lightning", "LightningModule", "Trainer"]
