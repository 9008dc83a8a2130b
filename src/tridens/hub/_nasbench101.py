"""NAS-Bench-101 (Ying et al. 2019): a cell of up to 7 nodes wired by a DAG of at most 9 edges,
each interior node a 3x3 convolution, a 1x1 convolution or a 3x3 max pool.

Labels of a cell ``label``: ``{label}/op{i}`` (the operation of node ``i``, ``1..num_nodes-2``) and
``{label}/input{i}`` (the sorted list of earlier nodes node ``i`` reads, ``1..num_nodes-1``; node
``num_nodes-1`` is the output) -- NNI's labels. A wiring with more than ``max_num_edges`` edges
is an invalid sample: freezing it raises ``InvalidSample``; the cell registers this budget as a
:class:`~tridens.space.SampleRule`, so random samples and evolution's mutations draw valid wirings
only. Nodes off every input-to-output path are dropped, as the benchmark does.

>>> space = NasBench101(stem_out_channels=16, num_stacks=1, num_modules_per_stack=1)   # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..space import SampleRule, choice

from .. import nn as tnn
from ..errors import InvalidSample, InvalidSpace
from ..space import FixedResolver, active_resolver

__all__ = ["NasBench101Cell", "NasBench101", "NasBench101EdgeBudget", "NASBENCH101_OPS", "nasbench101_edges"]


def _conv_bn_relu(kernel: int) -> Callable[[int], nn.Module]:
    return lambda c: nn.Sequential(nn.Conv2d(c, c, kernel, padding=kernel // 2, bias=False), nn.BatchNorm2d(c),
                                   nn.ReLU(inplace=False))


#: The benchmark's three operations: name -> ``factory(channels)``.
NASBENCH101_OPS: dict[str, Callable[[int], nn.Module]] = {
    "conv3x3-bn-relu": _conv_bn_relu(3),
    "conv1x1-bn-relu": _conv_bn_relu(1),
    "maxpool3x3": lambda c: nn.MaxPool2d(3, stride=1, padding=1),
}


def _projection(c_in: int, c_out: int) -> nn.Module:
    """The benchmark's projection of the cell's input: 1x1 convolution, batch norm, ReLU."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=False))


def nasbench101_edges(sample: Mapping[str, Any], label: str = "cell", num_nodes: int = 7) -> list[tuple[int, int]]:
    """The edges ``(from, to)`` of a cell's sample (before pruning)."""
    return [(int(src), dst) for dst in range(1, num_nodes) for src in sample[f"{label}/input{dst}"]]


class NasBench101EdgeBudget(SampleRule):
    """The rule tying a cell's input labels: at most ``max_num_edges`` edges in all. Random
    samples draw the wiring uniformly among those within the budget (as drawing every label
    and keeping the valid samples would, without the waste: with 7 nodes and 9 edges about 7 in
    8 independent draws break the budget). Every node reads at least one earlier node, so every
    such wiring reaches the output from the input.

    >>> rule = NasBench101EdgeBudget("cell", 7, 9)
    >>> sum(len(v) for v in rule.draw(random.Random(0), {}).values()) <= 9
    True
    """

    def __init__(self, label: str, num_nodes: int, max_num_edges: int):
        self.label, self.num_nodes, self.max_num_edges = label, num_nodes, max_num_edges
        self.labels = tuple(f"{label}/input{dst}" for dst in range(1, num_nodes))
        # ways[d][b]: wirings of nodes d..num_nodes-1 with at most b edges
        n = num_nodes
        self._ways = [[0] * (max_num_edges + 1) for _ in range(n + 1)]
        self._ways[n] = [1] * (max_num_edges + 1)
        for d in range(n - 1, 0, -1):
            for b in range(max_num_edges + 1):
                self._ways[d][b] = sum(math.comb(d, r) * self._ways[d + 1][b - r] for r in range(1, min(d, b) + 1))

    def violation(self, sample: Mapping[str, Any]) -> str | None:
        edges = sum(len(sample[label]) for label in self.labels)
        if edges > self.max_num_edges:
            return f"NAS-Bench-101 cell {self.label!r} has {edges} edges, more than max_num_edges={self.max_num_edges}"
        return None

    def draw(self, rng: random.Random, sample: Mapping[str, Any]) -> dict[str, Any]:
        budget = self.max_num_edges
        if self._ways[1][budget] == 0:
            raise InvalidSpace(f"NAS-Bench-101 cell {self.label!r}: {self.num_nodes} nodes need at least "
                               f"{self.num_nodes - 1} edges, more than max_num_edges={budget}")
        out: dict[str, Any] = {}
        for dst in range(1, self.num_nodes):
            sizes = list(range(1, min(dst, budget) + 1))
            weights = [math.comb(dst, r) * self._ways[dst + 1][budget - r] for r in sizes]
            r = rng.choices(sizes, weights=weights)[0]
            out[f"{self.label}/input{dst}"] = sorted(rng.sample(range(dst), r))
            budget -= r
        return out


def _prune(num_nodes: int, edges: list[tuple[int, int]]) -> set[int] | None:
    """The nodes on some input-to-output path, or None when the output is unreachable."""
    forward = {0}
    for src, dst in sorted(edges, key=lambda e: e[1]):
        if src in forward:
            forward.add(dst)
    backward = {num_nodes - 1}
    for src, dst in sorted(edges, key=lambda e: -e[0]):
        if dst in backward:
            backward.add(src)
    if num_nodes - 1 not in forward:
        return None
    return forward & backward


class NasBench101Cell(nn.Module):
    """A NAS-Bench-101 cell from ``in_channels`` to ``out_channels`` (see the module doc). Build it
    inside a ``ModelSpace``; every cell built with the same ``label`` is the same decision.
    ``op_candidates`` map names to ``factory(channels)``; ``projection(c_in, c_out)`` makes the
    input's projections (default: 1x1 convolution, batch norm, ReLU).

    The output concatenates the nodes that feed it (the channels split among them, as the
    benchmark does), plus a 1x1 projection of the input when the input feeds the output.
    """

    def __init__(self, in_channels: int, out_channels: int, num_nodes: int = 7,
                 op_candidates: Mapping[str, Callable[[int], nn.Module]] | None = None, max_num_edges: int = 9,
                 *, projection: Callable[[int, int], nn.Module] | None = None, label: str = "cell"):
        super().__init__()
        if num_nodes < 2:
            raise InvalidSpace(f"The 'num_nodes' parameter of NasBench101Cell must be an int >= 2. Got {num_nodes!r} instead.")
        ops = dict(op_candidates or NASBENCH101_OPS)
        names = list(ops)
        chosen_ops = {i: choice(f"{label}/op{i}", names) for i in range(1, num_nodes - 1)}
        inputs: dict[int, list[int]] = {}
        for dst in range(1, num_nodes):
            subsets = [list(c) for r in range(1, dst + 1) for c in itertools.combinations(range(dst), r)]
            inputs[dst] = list(choice(f"{label}/input{dst}", subsets))
        resolver = active_resolver()
        if resolver is not None:
            resolver.add_rule(NasBench101EdgeBudget(label, num_nodes, max_num_edges))
        edges = [(src, dst) for dst, srcs in inputs.items() for src in srcs]
        kept = _prune(num_nodes, edges)
        problem = None
        if len(edges) > max_num_edges:
            problem = f"has {len(edges)} edges, more than max_num_edges={max_num_edges}"
        elif kept is None:
            problem = "has no path from the input to the output"
        if problem is not None:
            if isinstance(active_resolver(), FixedResolver):
                raise InvalidSample(f"NAS-Bench-101 cell {label!r} {problem}")
            kept = {0, num_nodes - 1}  # discovery of the space: any structure will do
        edges = [(s, d) for s, d in edges if s in kept and d in kept]
        self.num_nodes, self.edges = num_nodes, edges
        self.channels = self._vertex_channels(in_channels, out_channels, num_nodes, edges)
        self.ops = nn.ModuleDict({str(i): ops[chosen_ops[i]](self.channels[i]) for i in range(1, num_nodes - 1)
                                  if i in kept})
        project = projection or _projection
        self.projections = nn.ModuleDict({str(dst): project(in_channels, self.channels[dst]) for src, dst in edges if src == 0})
        if not any(d == num_nodes - 1 for _, d in edges) and str(num_nodes - 1) not in self.projections:
            # no wiring: the output is the projected input
            self.projections[str(num_nodes - 1)] = project(in_channels, out_channels)

    @staticmethod
    def _vertex_channels(c_in: int, c_out: int, n: int, edges: list[tuple[int, int]]) -> list[int]:
        channels = [0] * n
        channels[0], channels[n - 1] = c_in, c_out
        feeding = [s for s, d in edges if d == n - 1 and s != 0]
        if feeding:
            share, extra = divmod(c_out, len(feeding))
            for v in sorted(feeding):
                channels[v] = share + (1 if extra > 0 else 0)
                extra -= 1
        for v in range(n - 2, 0, -1):
            if v not in feeding:
                for s, d in edges:
                    if s == v and d != n - 1:
                        channels[v] = max(channels[v], channels[d])
        return channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.num_nodes
        states: dict[int, torch.Tensor] = {0: x}
        for v in range(1, n - 1):
            if str(v) not in self.ops:
                continue
            fan_in = [states[s][:, :self.channels[v]] for s, d in self.edges if d == v and s != 0]
            if str(v) in self.projections:
                fan_in.append(self.projections[str(v)](x))
            total = fan_in[0]
            for t in fan_in[1:]:
                total = total + t
            states[v] = self.ops[str(v)](total)
        outs = [states[s] for s, d in sorted(self.edges) if d == n - 1 and s != 0]
        out = torch.cat(outs, dim=1) if outs else None
        if str(n - 1) in self.projections:
            projected = self.projections[str(n - 1)](x)
            out = projected if out is None else out + projected
        return out

    def extra_repr(self) -> str:
        return f"edges={self.edges}, channels={self.channels}"


class NasBench101(tnn.ModelSpace):
    """The NAS-Bench-101 network: a 3x3 stem, ``num_stacks`` stacks of ``num_modules_per_stack``
    cells (one shared decision, label ``cell``), a 2x2 max pool halving the resolution and doubling
    the channels between stacks, global pooling and a linear classifier. The benchmark trained
    ``stem_out_channels=128, num_stacks=3, num_modules_per_stack=3`` on CIFAR-10.

    >>> space = NasBench101(stem_out_channels=16, num_stacks=2, num_modules_per_stack=1, in_channels=1)  # doctest: +SKIP
    """

    labels_unconditional = True  # every label exists in every model

    def __init__(self, stem_out_channels: int = 128, num_stacks: int = 3, num_modules_per_stack: int = 3,
                 max_num_vertices: int = 7, max_num_edges: int = 9, num_labels: int = 10, bn_eps: float = 1e-5,
                 bn_momentum: float = 0.003, *, in_channels: int = 3):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(in_channels, stem_out_channels, 3, padding=1, bias=False),
                                   nn.BatchNorm2d(stem_out_channels, eps=bn_eps, momentum=bn_momentum), nn.ReLU(inplace=False)]
        c = stem_out_channels
        for stack in range(num_stacks):
            if stack > 0:
                layers.append(nn.MaxPool2d(2, 2))
            for _ in range(num_modules_per_stack):
                c_out = stem_out_channels * 2 ** stack
                layers.append(NasBench101Cell(c, c_out, max_num_vertices, max_num_edges=max_num_edges, label="cell"))
                c = c_out
        self.features = nn.Sequential(*layers)
        for m in self.features.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eps, m.momentum = bn_eps, bn_momentum
        self.classifier = nn.Linear(c, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))
