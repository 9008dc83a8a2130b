"""Shape propagation: run the graph once on its example inputs and record output shapes.

An ``fx.Interpreter`` pass. It runs under ``torch.no_grad()`` with every module in eval mode (so
BatchNorm statistics are not updated and batch-size-1 inputs are accepted) and restores both the
training flags and the global RNG state afterwards, so reading a shape never changes what training
does. A node that fails raises :class:`~tridens.errors.InvalidSample` naming the node (fx style)
and the shapes of its inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from ..errors import InvalidSample
from . import _meta

if TYPE_CHECKING:
    from ._graph import Graph

__all__ = ["propagate", "as_inputs"]


def as_inputs(example_inputs: Any) -> tuple[Any, ...] | None:
    """Example inputs as a tuple: a tensor becomes a 1-tuple, None stays None."""
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(
        "example_inputs must be a tensor or a tuple of tensors, "
        f"but got {type(example_inputs).__name__}")


class ShapeProp(fx.Interpreter):
    """Records ``_meta.SHAPE`` and ``_meta.DTYPE`` on every node it runs."""

    def __init__(self, graph: Graph) -> None:
        super().__init__(graph._root, garbage_collect_values=True, graph=graph._fx)
        self.extra_traceback = False
        self._name = graph._name

    def run(self, *args: Any, **_: Any) -> InvalidSample | None:  # type: ignore[override]
        """Run every node whose inputs could be computed; return the first failure (or None).

        Nodes that don't depend on a failing node still get their shapes, so a mutator can read
        the shapes before a broken spot to repair it.
        """
        self.env = {}
        self.args_iter = iter(args)
        failed: set[fx.Node] = set()
        first: InvalidSample | None = None
        for n in self.graph.nodes:
            if any(src in failed for src in n.all_input_nodes):
                failed.add(n)
                continue
            try:
                result = self.run_node(n)
            except Exception as err:
                failed.add(n)
                if first is None:
                    first = InvalidSample(self._message(n, err))
                    first.__cause__ = err
                continue
            n.meta[_meta.SHAPE] = _meta.shape_of(result)
            n.meta[_meta.DTYPE] = _meta.dtype_of(result)
            self.env[n] = result
            for dead in self.user_to_last_uses.get(n, []):
                self.env.pop(dead, None)
        self.env = {}
        return first

    def _message(self, n: fx.Node, err: Exception) -> str:
        line = _meta.format_node(n, self.module, "?")
        inputs = [f"%{src.name} -> {_meta.format_shape(src.meta.get(_meta.SHAPE))}"
                  for src in n.all_input_nodes]
        detail = str(err).strip() or type(err).__name__
        text = f"While executing {line}: {type(err).__name__}: {detail}"
        if inputs:
            text += "\n  input shapes: " + ", ".join(inputs)
        return f"{text}\n  (in the graph of {self._name})"


def propagate(graph: Graph, example_inputs: tuple[Any, ...] | None) -> None:
    """Fill ``node.meta`` shapes by running ``graph`` on ``example_inputs``; raise the first
    failure as :class:`InvalidSample` after recording every shape that could be computed."""
    for n in graph._fx.nodes:
        n.meta.pop(_meta.SHAPE, None)
        n.meta.pop(_meta.DTYPE, None)
    if example_inputs is None:
        return
    n_inputs = sum(1 for n in graph._fx.nodes if n.op == "placeholder")
    if len(example_inputs) > n_inputs:
        raise InvalidSample(
            f"the graph of {graph._name} takes {n_inputs} input(s), but got {len(example_inputs)} "
            "example inputs")
    devices = sorted({t.device.index or 0 for t in example_inputs
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    modules = list(graph._root.modules())
    flags = [m.training for m in modules]
    try:
        for m in modules:
            m.training = False
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            error = ShapeProp(graph).run(*example_inputs)
    finally:
        for m, flag in zip(modules, flags):
            m.training = flag
    if error is not None:
        raise error
