"""``nni.nas.evaluator.pytorch``: ``Classification``, ``Regression`` and ``DataLoader`` on tridens'
declarative evaluators (see ``tridens.compat.nni._lightning``); ``Lightning``, ``LightningModule``
and ``Trainer`` raise, naming the alternative."""

from ...._lightning import Classification, DataLoader, Lightning, LightningModule, Regression, Trainer

__all__ = ["Classification", "Regression", "DataLoader", "Lightning", "LightningModule", "Trainer"]
