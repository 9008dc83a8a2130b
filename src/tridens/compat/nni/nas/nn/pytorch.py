"""``nni.nas.nn.pytorch``: the space primitives. ``MutableX`` modules are the plain torch modules:
in tridens a choice resolves to a value inside a space's ``__init__``, so no wrappers are needed.
``ModelSpace`` subclasses may be declared with ``label_prefix=``; ``NasBench101Cell`` and
``NasBench201Cell`` are ``tridens.hub``'s cells."""

from torch import nn as _nn

from ..._spaces import Cell, InputChoice, LayerChoice, ModelSpace, NasBench101Cell, NasBench201Cell, Repeat

__all__ = ["ModelSpace", "LayerChoice", "InputChoice", "Repeat", "Cell", "NasBench101Cell", "NasBench201Cell",
           "MutableLinear", "MutableConv1d", "MutableConv2d", "MutableConv3d", "MutableBatchNorm1d",
           "MutableBatchNorm2d", "MutableLayerNorm", "MutableDropout", "MutableMultiheadAttention",
           "ParametrizedModule"]

MutableLinear = _nn.Linear
MutableConv1d = _nn.Conv1d
MutableConv2d = _nn.Conv2d
MutableConv3d = _nn.Conv3d
MutableBatchNorm1d = _nn.BatchNorm1d
MutableBatchNorm2d = _nn.BatchNorm2d
MutableLayerNorm = _nn.LayerNorm
MutableDropout = _nn.Dropout
MutableMultiheadAttention = _nn.MultiheadAttention
ParametrizedModule = _nn.Module
