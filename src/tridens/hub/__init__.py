"""The model spaces NAS users reach for first, written as ordinary tridens spaces.

Each is a ``tnn.ModelSpace`` (inline choices, ``tnn.Cell``, ``tnn.Repeat``, ``tnn.LayerChoice``):
freeze a sample, search it with any ``td.strategy``, and, where noted, train it one-shot.

========================  ===========================================  ==========================
space                     what is chosen                               one-shot (``td.oneshot``)
========================  ===========================================  ==========================
:class:`NasBench201`      the op of each of a cell's 6 edges           yes
:class:`NasBench101`      a cell's ops and DAG (<= 9 edges)            no (wiring sets)
:class:`DARTS`, :class:`PNAS`   two cells' ops and inputs (NDS)        yes at a fixed width/depth
:class:`NASNet`, :class:`ENAS`, :class:`AmoebaNet`  the same, loose ends  no (output width varies)
:class:`ProxylessNAS`     each block: kernel 3/5/7 x expansion 3/6, skip  yes
:class:`MobileNetV3Space` stage depths, kernels, expanded widths       yes
:class:`ShuffleNetSpace`  each block: ShuffleNetV2 3/5/7 or Xception   yes
:class:`AutoFormer`       ViT width, depth, heads, MLP ratios          yes
========================  ===========================================  ==========================

Reference architectures as samples: :data:`DARTS_V2` (with ``DARTS(width=36, num_cells=20)``:
3.3 M parameters) and :data:`MOBILENETV3_LARGE` (5.4 M).

>>> from tridens import hub
>>> space = hub.NasBench201(channels=4, cells=1, in_channels=1)
>>> len(space.search_space())
6
"""

from ..evaluators.nasbench201 import Cell201 as NasBench201Cell
from ..evaluators.nasbench201 import NasBench201
from ._autoformer import AutoFormer, TransformerBlock
from ._mobile import MOBILENETV3_LARGE, InvertedResidual, MobileNetV3Space, ProxylessNAS, SqueezeExcite, make_divisible
from ._nasbench101 import NASBENCH101_OPS, NasBench101, NasBench101Cell, NasBench101EdgeBudget, nasbench101_edges
from ._nds import DARTS, DARTS_V2, ENAS, NDS, PNAS, AmoebaNet, AuxiliaryHead, DropPath, NASNet
from ._ops import OPS
from ._shufflenet import ShuffleNetBlock, ShuffleNetSpace

__all__ = [
    "NasBench201", "NasBench201Cell", "NasBench101", "NasBench101Cell", "NasBench101EdgeBudget", "NASBENCH101_OPS",
    "nasbench101_edges",
    "NDS", "DARTS", "PNAS", "NASNet", "ENAS", "AmoebaNet", "DARTS_V2", "OPS", "AuxiliaryHead", "DropPath",
    "ProxylessNAS", "MobileNetV3Space", "MOBILENETV3_LARGE", "InvertedResidual", "SqueezeExcite", "make_divisible",
    "ShuffleNetSpace", "ShuffleNetBlock", "AutoFormer", "TransformerBlock",
]
