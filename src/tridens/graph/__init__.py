"""The graph IR: a concrete model as a data-flow graph (from ``torch.fx``).

``trace(model, example_inputs)`` captures a model; the :class:`Graph` has edit primitives for
mutators, code generation back to an ``nn.Module`` (``to_module``), structural fingerprints (whole
graph and per-node prefix), parameter and FLOP counts, and prints like code. :mod:`.meta` names the ``node.meta`` keys passes write.

>>> import torch, torch.nn as nn, tridens as td
>>> g = td.graph.trace(nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU()), torch.randn(1, 1, 8, 8))
>>> print(g)
graph Sequential(%input_1):
    %input_1 : input -> [1, 1, 8, 8]
    %_0 : Conv2d(1, 8, kernel_size=(3, 3), stride=(1, 1)) -> [1, 8, 6, 6]  (%input_1)
    %_1 : ReLU() -> [1, 8, 6, 6]  (%_0)
    return %_1
"""

from . import _meta as meta
from ._flops import forward_flops
from ._graph import Graph, Node
from ._trace import OpaqueModuleWarning, ShapeSpecializedWarning, trace

__all__ = ["trace", "Graph", "Node", "OpaqueModuleWarning", "ShapeSpecializedWarning", "meta", "forward_flops"]
