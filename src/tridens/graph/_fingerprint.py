"""Structural fingerprints: a Merkle hash over the data-flow graph.

``prefix_fingerprint(node)`` hashes the node's own *descriptor* together with the prefix
fingerprints of its inputs, in argument order; the graph's fingerprint is its output node's. So the
fingerprint is the hash of the subgraph that feeds a node: equal for two models that compute the
same thing with the same structure, whatever the order their independent branches were written in,
their attribute and input names, or their weights.

A descriptor holds, per opcode:

* placeholder -- its position, default value, and the example input's shape and dtype;
* get_attr -- parameter/buffer shape, dtype and requires_grad (never values);
* call_module -- the module's structure (below) and, for a module with parameters called from
  several nodes (weight sharing), how many;
* call_function / call_method -- the function's qualified name or the method name;
* plus the arguments: constants written out canonically, input nodes as their prefix fingerprints.

A module's structure lists every module in ``module.modules()`` order with its class (qualified
name), ``extra_repr()``, its plain configuration values (bool/int/float/str/None/dtype/functions,
in ``__dict__`` order, without their attribute names; ``training`` excluded) and the shape, dtype
and requires_grad of its own parameters and shape/dtype of its buffers. Attribute names of
submodules never enter. Intermediate shapes are not hashed: they follow from the input shapes and
the ops, which are.

Fingerprints are memoized in ``node.meta["tridens.prefix_fp"]`` until the graph's next edit.
"""

from __future__ import annotations

import enum
import hashlib
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn as nn

from . import _meta

if TYPE_CHECKING:
    from ._graph import Graph

__all__ = ["prefix_fingerprint", "module_structure"]

_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout)


def _const(value: Any) -> str:
    """Canonical text of a constant argument (no object ids, no tensor values)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float, complex, str)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, torch.Size):
        return "Size(" + ",".join(str(d) for d in value) + ")"
    if isinstance(value, tuple):
        return "(" + ",".join(_const(v) for v in value) + ")"
    if isinstance(value, list):
        return "[" + ",".join(_const(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_const(k)}:{_const(v)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        return f"slice({_const(value.start)},{_const(value.stop)},{_const(value.step)})"
    if value is Ellipsis:
        return "..."
    if isinstance(value, enum.Enum):
        return f"{_meta.qualified_name(type(value))}.{value.name}"
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, nn.Module):
        return module_structure(value)
    if isinstance(value, type) or callable(value):
        return _meta.qualified_name(value)
    return f"<{_meta.qualified_name(type(value))}>"


def _tensor(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    kind = "P" if isinstance(t, nn.Parameter) else "T"
    return f"{kind}{tuple(t.shape)}{str(t.dtype)[6:]}{'g' if t.requires_grad else ''}"


def _config_value(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list)):
        return all(_config_value(v) for v in value)
    return isinstance(value, type) or (callable(value) and not isinstance(value, nn.Module)
                                       and hasattr(value, "__qualname__"))


def module_structure(module: nn.Module) -> str:
    """Text of a module's structure: class, extra_repr, configuration values, parameter and buffer
    shapes of every submodule in order -- no attribute names, no weights."""
    parts = []
    for sub in module.modules():
        config = [_const(v) for k, v in vars(sub).items()
                  if not k.startswith("_") and k != "training" and _config_value(v)]
        params = [_tensor(p) for p in sub._parameters.values()]
        buffers = [_tensor(b) for b in sub._buffers.values()]
        parts.append(f"{_meta.qualified_name(type(sub))}({sub.extra_repr()})"
                     f"{{{';'.join(config)}}}[{';'.join(params)}][{';'.join(buffers)}]")
    return "/".join(parts)


def _uses(graph: Graph) -> dict[int, int]:
    """id(module or parameter) -> number of call_module/get_attr nodes using it."""
    uses: dict[int, int] = {}
    for n in graph._fx.nodes:
        if n.op in ("call_module", "get_attr"):
            key = id(graph._get(str(n.target)))
            uses[key] = uses.get(key, 0) + 1
    return uses


class _Hasher:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.version = graph._version
        self.structures: dict[int, str] = {}
        self._uses: dict[int, int] | None = None
        self.placeholders = {n: i for i, n in enumerate(n for n in graph._fx.nodes if n.op == "placeholder")}

    def uses(self, obj: Any) -> int:
        if self._uses is None:
            self._uses = _uses(self.graph)
        return self._uses.get(id(obj), 1)

    def arg(self, value: Any) -> str:
        if isinstance(value, fx.Node):
            return "@" + self.fingerprint(value)
        if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
            inner = ",".join(self.arg(v) for v in value)
            return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
        if isinstance(value, dict):
            return "{" + ",".join(f"{_const(k)}:{self.arg(v)}" for k, v in value.items()) + "}"
        if isinstance(value, slice):
            return f"slice({self.arg(value.start)},{self.arg(value.stop)},{self.arg(value.step)})"
        return _const(value)

    def descriptor(self, n: fx.Node) -> str:
        graph = self.graph
        if n.op == "placeholder":
            text = f"input#{self.placeholders[n]}"
            inputs = graph._example_inputs
            i = self.placeholders[n]
            if inputs is not None and i < len(inputs):
                value = inputs[i]
                text += ":" + (_tensor(value.detach()) if isinstance(value, torch.Tensor) else self.arg(value))
            return text
        if n.op == "get_attr":
            obj = graph._get(str(n.target))
            text = "attr:" + (module_structure(obj) if isinstance(obj, nn.Module) else _const(obj))
            if isinstance(obj, (nn.Parameter, nn.Module)) and self.uses(obj) > 1:
                text += f"*{self.uses(obj)}"
            return text
        if n.op == "call_module":
            module = graph._get(str(n.target))
            key = id(module)
            structure = self.structures.get(key)
            if structure is None:
                structure = self.structures[key] = module_structure(module)
            text = "module:" + structure
            if self.uses(module) > 1 and next(iter(module.parameters()), None) is not None:
                text += f"*{self.uses(module)}"  # weight sharing is structure
            return text
        if n.op == "call_function":
            return "function:" + _meta.qualified_name(n.target)
        if n.op == "call_method":
            return "method:" + str(n.target)
        return "output"

    def fingerprint(self, n: fx.Node) -> str:
        memo = n.meta.get(_meta.PREFIX_FP)
        if memo is not None and memo[0] == self.version:
            return memo[1]
        # iterative over the not-yet-hashed ancestors (deep graphs must not hit the recursion limit)
        stack, order = [n], []
        seen: set[fx.Node] = set()
        while stack:
            cur = stack.pop()
            if cur in seen:
                continue
            memo = cur.meta.get(_meta.PREFIX_FP)
            if memo is not None and memo[0] == self.version:
                continue
            seen.add(cur)
            order.append(cur)
            stack.extend(cur.all_input_nodes)
        node_order = {x: i for i, x in enumerate(self.graph._fx.nodes)} if len(order) > 1 else {}
        for cur in sorted(order, key=lambda x: node_order.get(x, 0)):
            args = ",".join(self.arg(a) for a in cur.args)
            kwargs = ",".join(f"{k}={self.arg(v)}" for k, v in sorted(cur.kwargs.items()))
            text = f"{self.descriptor(cur)}|{args}|{kwargs}"
            digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
            cur.meta[_meta.PREFIX_FP] = (self.version, digest)
        return n.meta[_meta.PREFIX_FP][1]


def prefix_fingerprint(graph: Graph, node: fx.Node) -> str:
    """Prefix fingerprint (hex) of ``node`` in ``graph``: the hash of the subgraph feeding it."""
    return _Hasher(graph).fingerprint(node)
