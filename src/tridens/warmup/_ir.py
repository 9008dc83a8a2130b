"""A compact, JSON-able description of a model's IR for matching and weight mapping.

Each node (topological order, as traced by ``tridens.graph.trace``) is a dict:
``t`` type name, ``p`` parameter shapes (list, in ``named_parameters`` order), ``s`` the module's
``state_dict`` shapes (relative keys, parameters and buffers), ``i`` input node indices, ``k`` the
module path (the ``state_dict`` key prefix) or None, ``kind`` linear/conv/bn/None, ``g`` conv groups.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.nn as nn

__all__ = ["describe", "Description"]

Description = dict  # {"nodes": [...], "opaque": str | None}


def _type_name(node: Any) -> str:
    if node.op == "call_module":
        cls = type(node.module)
        return f"{cls.__module__}.{cls.__qualname__}"
    if node.op == "call_function":
        fn = node.target
        return f"{getattr(fn, '__module__', None) or ''}.{getattr(fn, '__name__', repr(fn))}"
    if node.op == "call_method":
        return f"method.{node.target}"
    return str(node.op)  # placeholder / get_attr / output


def _kind(module: nn.Module | None) -> tuple[str | None, int]:
    if isinstance(module, nn.Linear):
        return "linear", 1
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv", int(module.groups)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "bn", 1
    return None, 1


def describe(model: nn.Module, example_inputs: Any = None, *, graph: Any = None) -> Description:
    """Trace ``model`` (or use ``graph``) and describe it. ``opaque`` names the first opaque node's
    reason (such a model is neither matched nor added)."""
    from ..graph import trace
    from ..graph import meta

    if graph is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = trace(model, example_inputs)
    nodes = list(graph)
    index = {n.name: i for i, n in enumerate(nodes)}
    out: list[dict[str, Any]] = []
    opaque = None
    for n in nodes:
        if n.opaque and opaque is None:
            opaque = f"{n.name}: {n.meta.get(meta.OPAQUE_REASON, 'opaque module')}"
        module = n.module
        entry: dict[str, Any] = {"t": _type_name(n), "i": [index[src.name] for src, _ in n.inputs if src.name in index]}
        if module is not None:
            entry["k"] = str(n.target)
            entry["p"] = [list(p.shape) for _, p in module.named_parameters()]
            entry["s"] = {k: list(v.shape) for k, v in module.state_dict().items()}
            kind, groups = _kind(module)
            if kind:
                entry["kind"] = kind
            if groups != 1:
                entry["g"] = groups
        elif n.op == "get_attr":
            entry["p"] = [list(s) for s in n.param_shapes.values()]
            entry["a"] = str(n.target)  # a state_dict key (a parameter used by a functional call)
        out.append(entry)
    return {"nodes": out, "opaque": opaque}
