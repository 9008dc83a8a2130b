"""The NASNet family of cell spaces (NASNet, ENAS, AmoebaNet, PNAS, DARTS) on one network, NDS.

A network is a stem, three stages of cells and a classifier. Every cell reads the outputs of the
two cells before it, and its nodes each add two operations, each on a chosen earlier state
(a ``tnn.Cell`` with ``num_predecessors=2, num_ops_per_node=2``). All normal cells share one
decision (labels ``normal/op_{n}_{k}``, ``normal/input_{n}_{k}``), all reduction cells another
(``reduce/...``); states are numbered as NNI numbers them, so NNI's architecture dicts load as
they are. The first cell of stages 2 and 3 is a reduction cell: its operations on the cell's
inputs have stride 2 and the stage doubles the channels. Widths and depths given as tuples
become the choices ``width`` and ``depth``.

>>> from tridens import hub
>>> space = hub.DARTS(width=16, num_cells=8)                      # doctest: +SKIP
>>> model = space.freeze(hub.DARTS_V2)                            # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..space import choice

from .. import nn as tnn
from ..errors import InvalidSpace
from ._ops import OPS, FactorizedReduce, ReLUConvBN

__all__ = ["NDS", "NASNet", "ENAS", "AmoebaNet", "PNAS", "DARTS", "DARTS_V2", "AuxiliaryHead", "DropPath"]


class AuxiliaryHead(nn.Module):
    """The auxiliary classifier attached after the second reduction (input 8x8 on CIFAR, 7x7 on ImageNet)."""

    def __init__(self, channels: int, num_classes: int, dataset: str):
        super().__init__()
        stride = 3 if dataset == "cifar" else 2
        self.features = nn.Sequential(
            nn.ReLU(inplace=False), nn.AvgPool2d(5, stride=stride, padding=0, count_include_pad=False),
            nn.Conv2d(channels, 128, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(inplace=False),
            nn.Conv2d(128, 768, 2, bias=False), nn.BatchNorm2d(768), nn.ReLU(inplace=False))
        self.classifier = nn.Linear(768, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class DropPath(nn.Module):
    """Drops a whole operation's output for a random subset of the batch in training (probability
    ``drop_prob``, the kept samples scaled by ``1 / (1 - drop_prob)``): DARTS' drop-path regularizer."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob <= 0.0:
            return x
        keep = 1.0 - self.drop_prob
        mask = torch.empty(x.shape[0], *([1] * (x.dim() - 1)), device=x.device, dtype=x.dtype).bernoulli_(keep)
        return x / keep * mask


class NDSCell(nn.Module):
    """One cell: the two inputs aligned to ``channels`` (a ``FactorizedReduce`` when the cell
    before the previous one has the larger resolution), then the chosen ``tnn.Cell``."""

    def __init__(self, ops: Sequence[str], c_pprev: int, c_prev: int, channels: int, num_nodes: int, merge_op: str,
                 reduction: bool, reduction_prev: bool, drop_path_prob: float = 0.0):
        super().__init__()
        self.preprocess0 = FactorizedReduce(c_pprev, channels) if reduction_prev else ReLUConvBN(c_pprev, channels, 1)
        self.preprocess1 = ReLUConvBN(c_prev, channels, 1)

        def build(name: str, source: int) -> nn.Module:
            # an op on one of the cell's two inputs of a reduction cell has stride 2
            op = OPS[name](channels, 2 if reduction and source < 2 else 1, True)
            return nn.Sequential(op, DropPath(drop_path_prob)) if drop_path_prob > 0 and not isinstance(
                op, nn.Identity) else op

        def factory(name: str) -> Any:
            return lambda node, k, source: build(name, source)

        self.cell = tnn.Cell({name: factory(name) for name in ops}, num_nodes=num_nodes, num_ops_per_node=2,
                             num_predecessors=2, merge_op=merge_op, label="reduce" if reduction else "normal")
        outputs = getattr(self.cell, "output_nodes", None)
        self.out_channels = channels * (num_nodes if outputs is None else len(outputs))

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        return self.cell(self.preprocess0(s0), self.preprocess1(s1))


class NDS(tnn.ModelSpace):
    """A NASNet-family space with the operations ``op_candidates`` (names of :data:`tridens.hub.OPS`).

    ``width`` (channels of the first stage) and ``num_cells`` (cells in all, split evenly over
    the three stages, the reductions included) are ints or tuples (choices ``width``/``depth``).
    ``dataset="cifar"`` has a one-convolution stem for 32x32 inputs, ``"imagenet"`` three strided
    ones. ``auxiliary_loss=True`` adds the auxiliary head; in training the model then returns
    ``(logits, auxiliary_logits)``. ``drop_path_prob > 0`` follows every operation but the identity
    with a :class:`DropPath`, whose probability ``set_drop_path_prob(p)`` changes (a schedule).

    >>> space = NDS(["sep_conv_3x3", "skip_connect"], width=8, num_cells=3, in_channels=1)   # doctest: +SKIP
    """

    labels_unconditional = True  # every label exists in every model

    def __init__(self, op_candidates: Sequence[str], merge_op: str = "all", num_nodes_per_cell: int = 4,
                 width: int | Sequence[int] = 16, num_cells: int | Sequence[int] = 20, dataset: str = "cifar",
                 auxiliary_loss: bool = False, *, num_classes: int | None = None, in_channels: int = 3,
                 drop_path_prob: float = 0.0):
        super().__init__()
        unknown = [op for op in op_candidates if op not in OPS]
        if unknown:
            raise InvalidSpace(f"The 'op_candidates' parameter of {type(self).__name__} must name operations of "
                               f"tridens.hub.OPS ({', '.join(OPS)}). Got {unknown[0]!r} instead.")
        if dataset not in ("cifar", "imagenet"):
            raise InvalidSpace(f"The 'dataset' parameter of {type(self).__name__} must be 'cifar' or 'imagenet'. "
                               f"Got {dataset!r} instead.")
        c = choice("width", list(width)) if isinstance(width, Sequence) else width
        depth = choice("depth", list(num_cells)) if isinstance(num_cells, Sequence) else num_cells
        self.dataset, self.auxiliary_loss, self.drop_path_prob = dataset, auxiliary_loss, drop_path_prob
        num_classes = num_classes if num_classes is not None else (10 if dataset == "cifar" else 1000)
        if dataset == "imagenet":
            self.stem0 = nn.Sequential(nn.Conv2d(in_channels, c // 2, 3, stride=2, padding=1, bias=False),
                                       nn.BatchNorm2d(c // 2), nn.ReLU(inplace=False),
                                       nn.Conv2d(c // 2, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c))
            self.stem1 = nn.Sequential(nn.ReLU(inplace=False), nn.Conv2d(c, c, 3, stride=2, padding=1, bias=False),
                                       nn.BatchNorm2d(c))
            c_pprev = c_prev = c_curr = c
            reduction_prev = True
        else:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, 3 * c, 3, padding=1, bias=False), nn.BatchNorm2d(3 * c))
            c_pprev, c_prev, c_curr = 3 * c, 3 * c, c
            reduction_prev = False
        cells: list[NDSCell] = []
        self.aux_index = -1
        for stage in range(3):
            if stage > 0:
                c_curr *= 2
            for i in range((stage + 1) * depth // 3 - stage * depth // 3):
                reduction = stage > 0 and i == 0
                cell = NDSCell(op_candidates, c_pprev, c_prev, c_curr, num_nodes_per_cell, merge_op, reduction,
                               reduction_prev, drop_path_prob)
                cells.append(cell)
                c_pprev, c_prev, reduction_prev = c_prev, cell.out_channels, reduction
                if stage == 2 and i == 0:  # the auxiliary head reads the last stage's first (reduction) cell
                    self.aux_index, c_aux = len(cells) - 1, c_prev
        self.cells = nn.ModuleList(cells)
        if auxiliary_loss:
            self.auxiliary_head = AuxiliaryHead(c_aux, num_classes, dataset)
        self.global_pooling = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c_prev, num_classes)

    def set_drop_path_prob(self, drop_prob: float) -> None:
        """Set the probability of every :class:`DropPath` (built when ``drop_path_prob > 0``)."""
        for module in self.modules():
            if isinstance(module, DropPath):
                module.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> Any:
        if self.dataset == "imagenet":
            s0 = self.stem0(x)
            s1 = self.stem1(s0)
        else:
            s0 = s1 = self.stem(x)
        aux = None
        for i, cell in enumerate(self.cells):
            s0, s1 = s1, cell(s0, s1)
            if i == self.aux_index and self.auxiliary_loss and self.training:
                aux = self.auxiliary_head(s1)
        logits = self.classifier(self.global_pooling(s1).flatten(1))
        return (logits, aux) if aux is not None else logits


_DEFAULTS = dict(width=(16, 24, 32), num_cells=(4, 8, 12, 16, 20), dataset="cifar", auxiliary_loss=False)


class NASNet(NDS):
    """NASNet's space (Zoph et al. 2018): 13 operations, 5 nodes, the unused nodes concatenated.

    >>> space = NASNet(width=16, num_cells=8)      # doctest: +SKIP
    """

    OPS = ["skip_connect", "conv_3x1_1x3", "conv_7x1_1x7", "dil_conv_3x3", "avg_pool_3x3", "max_pool_3x3",
           "max_pool_5x5", "max_pool_7x7", "conv_1x1", "conv_3x3", "sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7"]

    def __init__(self, width: int | Sequence[int] = _DEFAULTS["width"], num_cells: int | Sequence[int] = _DEFAULTS["num_cells"],
                 dataset: str = "cifar", auxiliary_loss: bool = False, **kwargs: Any):
        super().__init__(self.OPS, "loose_end", 5, width, num_cells, dataset, auxiliary_loss, **kwargs)


class ENAS(NDS):
    """ENAS' macro-cell space (Pham et al. 2018): 5 operations, 5 nodes, the unused nodes concatenated."""

    OPS = ["skip_connect", "sep_conv_3x3", "sep_conv_5x5", "avg_pool_3x3", "max_pool_3x3"]

    def __init__(self, width: int | Sequence[int] = _DEFAULTS["width"], num_cells: int | Sequence[int] = _DEFAULTS["num_cells"],
                 dataset: str = "cifar", auxiliary_loss: bool = False, **kwargs: Any):
        super().__init__(self.OPS, "loose_end", 5, width, num_cells, dataset, auxiliary_loss, **kwargs)


class AmoebaNet(NDS):
    """AmoebaNet's space (Real et al. 2019): 8 operations, 5 nodes, the unused nodes concatenated."""

    OPS = ["skip_connect", "sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7", "avg_pool_3x3", "max_pool_3x3",
           "dil_sep_conv_3x3", "conv_7x1_1x7"]

    def __init__(self, width: int | Sequence[int] = _DEFAULTS["width"], num_cells: int | Sequence[int] = _DEFAULTS["num_cells"],
                 dataset: str = "cifar", auxiliary_loss: bool = False, **kwargs: Any):
        super().__init__(self.OPS, "loose_end", 5, width, num_cells, dataset, auxiliary_loss, **kwargs)


class PNAS(NDS):
    """PNAS' space (Liu et al. 2018): 8 operations, 5 nodes, every node concatenated."""

    OPS = ["sep_conv_3x3", "sep_conv_5x5", "sep_conv_7x7", "conv_7x1_1x7", "skip_connect", "avg_pool_3x3",
           "max_pool_3x3", "dil_conv_3x3"]

    def __init__(self, width: int | Sequence[int] = _DEFAULTS["width"], num_cells: int | Sequence[int] = _DEFAULTS["num_cells"],
                 dataset: str = "cifar", auxiliary_loss: bool = False, **kwargs: Any):
        super().__init__(self.OPS, "all", 5, width, num_cells, dataset, auxiliary_loss, **kwargs)


class DARTS(NDS):
    """DARTS' space (Liu et al. 2019) as NNI defines it: 7 operations (the paper's ``none`` is left
    out of the candidates, as NNI leaves it out), 4 nodes, every node concatenated. Its cells are one-shot trainable (``td.oneshot.DARTS``) with a fixed width and
    depth. ``space.freeze(hub.DARTS_V2)`` with ``width=36, num_cells=20`` is DARTS (2nd order),
    3.3 M parameters on CIFAR-10 (the auxiliary head not counted, as in the paper).

    >>> model = DARTS(width=36, num_cells=20).freeze(DARTS_V2)     # doctest: +SKIP
    """

    OPS = ["max_pool_3x3", "avg_pool_3x3", "skip_connect", "sep_conv_3x3", "sep_conv_5x5", "dil_conv_3x3",
           "dil_conv_5x5"]

    def __init__(self, width: int | Sequence[int] = _DEFAULTS["width"], num_cells: int | Sequence[int] = _DEFAULTS["num_cells"],
                 dataset: str = "cifar", auxiliary_loss: bool = False, **kwargs: Any):
        super().__init__(self.OPS, "all", 4, width, num_cells, dataset, auxiliary_loss, **kwargs)


def _genotype(kind: str, edges: Sequence[tuple[str, int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, (op, source) in enumerate(edges):
        node, k = 2 + i // 2, i % 2
        out[f"{kind}/op_{node}_{k}"] = op
        out[f"{kind}/input_{node}_{k}"] = source
    return out


#: DARTS (second order) on CIFAR-10, the cells of the paper's Figure 4/5 (its ``DARTS_V2`` genotype).
DARTS_V2: dict[str, Any] = {
    **_genotype("normal", [("sep_conv_3x3", 0), ("sep_conv_3x3", 1), ("sep_conv_3x3", 0), ("sep_conv_3x3", 1),
                           ("sep_conv_3x3", 1), ("skip_connect", 0), ("skip_connect", 0), ("dil_conv_3x3", 2)]),
    **_genotype("reduce", [("max_pool_3x3", 0), ("max_pool_3x3", 1), ("skip_connect", 2), ("max_pool_3x3", 1),
                           ("max_pool_3x3", 0), ("skip_connect", 2), ("skip_connect", 2), ("max_pool_3x3", 1)]),
}
