"""DARTS-style cell: ``num_nodes`` nodes, each summing ``num_ops_per_node`` chosen ops applied to
chosen earlier states (the cell's predecessors or earlier nodes)."""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import InvalidSpace
from ..space import active_resolver, resolve
from ..space import Categorical
from ._choices import _label

__all__ = ["Cell", "FrozenCell"]

OpFactory = Callable[[int, int, int], nn.Module]


class FrozenCell(nn.Module):
    """A cell with every op and input fixed. ``forward(*predecessors)`` or ``forward([...])``."""

    def __init__(self, ops: Sequence[nn.Module], input_index: Sequence[int], num_nodes: int,
                 num_ops_per_node: int, output_nodes: Sequence[int], concat_dim: int = 1):
        super().__init__()
        self.ops = nn.ModuleList(ops)
        self.input_index = [int(i) for i in input_index]
        self.num_nodes, self.num_ops_per_node = num_nodes, num_ops_per_node
        self.output_nodes = [int(i) for i in output_nodes]
        self.concat_dim = concat_dim

    def forward(self, *inputs: Any) -> torch.Tensor:
        if len(inputs) == 1 and isinstance(inputs[0], (list, tuple)):
            inputs = tuple(inputs[0])
        states = list(inputs)
        for j in range(self.num_nodes):
            total = None
            for k in range(self.num_ops_per_node):
                i = j * self.num_ops_per_node + k
                y = self.ops[i](states[self.input_index[i]])
                total = y if total is None else total + y
            states.append(total)
        outs = [states[i] for i in self.output_nodes]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=self.concat_dim)

    def extra_repr(self) -> str:
        return (f"num_nodes={self.num_nodes}, num_ops_per_node={self.num_ops_per_node}, "
                f"input_index={self.input_index}, output_nodes={self.output_nodes}")


def Cell(op_candidates: Sequence[OpFactory | nn.Module] | Mapping[str, OpFactory | nn.Module], num_nodes: int,
         num_ops_per_node: int = 1, num_predecessors: int = 1, merge_op: str = "all", *,
         concat_dim: int = 1, label: str | None = None) -> nn.Module:
    """A DARTS cell. States are numbered as NNI numbers them: ``0..num_predecessors-1`` are the
    cell's inputs, then the nodes in order, so node ``n`` (``n >= num_predecessors``) decides, for
    each of its ops ``k``, the labels ``{label}/op_{n}_{k}`` (which op) and ``{label}/input_{n}_{k}``
    (which earlier state it reads). Candidates are modules (deep-copied) or factories
    ``f(node_index, op_index, input_index) -> nn.Module``. The output concatenates every node
    (``merge_op="all"``) or the nodes no other node reads (``"loose_end"``) along ``concat_dim``.
    Under a one-shot supernet (``tridens.oneshot``) every op of every possible input is held, one
    set of candidates per edge (node, input) shared by the node's ops, as in DARTS and NNI.

    >>> ops = {"conv": lambda j, k, i: nn.Conv2d(8, 8, 3, padding=1), "skip": lambda j, k, i: nn.Identity()}  # doctest: +SKIP
    >>> self.cell = tnn.Cell(ops, num_nodes=4, num_predecessors=2, label="cell")  # doctest: +SKIP
    """
    label = _label(label, "cell")
    for name, value, low in (("num_nodes", num_nodes, 1), ("num_ops_per_node", num_ops_per_node, 1),
                             ("num_predecessors", num_predecessors, 1)):
        if not isinstance(value, int) or value < low:
            raise InvalidSpace(f"The {name!r} parameter of Cell {label!r} must be an int >= {low}. Got {value!r} instead.")
    if merge_op not in ("all", "loose_end"):
        raise InvalidSpace(f"The 'merge_op' parameter of Cell {label!r} must be 'all' or 'loose_end'. Got {merge_op!r} instead.")
    if isinstance(op_candidates, Mapping):
        op_domain = Categorical(dict(op_candidates), label=f"{label}/op")
    else:
        op_domain = Categorical(list(op_candidates), label=f"{label}/op", indexed=True)
    hook = getattr(active_resolver(), "cell", None)
    if hook is not None:  # a one-shot supernet (tridens.oneshot) holds every op on every input
        return hook(label, op_domain, num_nodes, num_ops_per_node, num_predecessors, merge_op, concat_dim)
    ops, inputs = [], []
    for j in range(num_nodes):
        node = num_predecessors + j
        for k in range(num_ops_per_node):
            source = resolve(f"{label}/input_{node}_{k}", Categorical(list(range(node))), "cell")
            candidate = resolve(f"{label}/op_{node}_{k}", op_domain, "cell")
            op = copy.deepcopy(candidate) if isinstance(candidate, nn.Module) else candidate(node, k, source)
            if not isinstance(op, nn.Module):
                raise InvalidSpace(f"op candidate of cell {label!r} returned {op!r}, not an nn.Module")
            ops.append(op)
            inputs.append(source)
    nodes = range(num_predecessors, num_predecessors + num_nodes)
    outputs = list(nodes) if merge_op == "all" else [n for n in nodes if n not in inputs]
    return FrozenCell(ops, inputs, num_nodes, num_ops_per_node, outputs, concat_dim)
