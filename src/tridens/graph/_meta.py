"""What passes store on fx nodes (``node.meta`` keys) and how values and nodes are written out.

Every key tridens puts in ``fx.Node.meta`` is prefixed ``tridens.`` and listed here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "SHAPE", "DTYPE", "OPAQUE", "OPAQUE_REASON", "PREFIX_FP", "FLOPS",
    "shape_of", "dtype_of", "format_shape", "qualified_name", "format_target", "format_node",
]

#: output shape: ``torch.Size``, a tuple of them (nested like the output), or None (non-tensor)
SHAPE = "tridens.shape"
#: output dtype, structured like SHAPE
DTYPE = "tridens.dtype"
#: True on call_module nodes whose module torch.fx could not trace through
OPAQUE = "tridens.opaque"
#: the fx error that made the node opaque
OPAQUE_REASON = "tridens.opaque_reason"
#: (graph version, hex digest) memo of the node's prefix fingerprint
PREFIX_FP = "tridens.prefix_fp"
#: estimated floating point operations of the node (see ``_flops``)
FLOPS = "tridens.flops"


def shape_of(value: Any) -> Any:
    """``torch.Size`` for a tensor, a tuple (same nesting) for a tuple/list, else None."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return tuple(shape_of(v) for v in value)
    return None


def dtype_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return tuple(dtype_of(v) for v in value)
    return None


def format_shape(shape: Any) -> str:
    """``[1, 16, 8, 8]`` for a size, ``([..], [..])`` for a tuple, ``-`` for a non-tensor value."""
    if isinstance(shape, torch.Size):
        return "[" + ", ".join(str(d) for d in shape) + "]"
    if isinstance(shape, tuple):
        return "(" + ", ".join(format_shape(s) for s in shape) + ")"
    return "-"


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a function or class; stable across runs (no ids)."""
    if isinstance(obj, type) or callable(obj):
        module = getattr(obj, "__module__", None) or ""
        name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        if name is None:  # a callable object: name its class
            return qualified_name(type(obj))
        if name.startswith("_VariableFunctionsClass."):  # torch.relu, torch.cat, ...
            module, name = "torch", name.split(".", 1)[1]
        if "<locals>" in name and getattr(obj, "__name__", None):
            # Functions made by a factory share a qualname (F.max_pool1d and F.max_pool2d are both
            # `boolean_dispatch.<locals>.fn`); their __name__ tells them apart.
            name = obj.__name__
        if module in ("builtins", "_operator"):
            module = "operator" if module == "_operator" else ""
        return f"{module}.{name}" if module else name
    return type(obj).__qualname__


def _format_arg(arg: Any) -> str:
    if isinstance(arg, fx.Node):
        return f"%{arg.name}"
    if isinstance(arg, tuple):
        inner = ", ".join(_format_arg(a) for a in arg)
        return f"({inner},)" if len(arg) == 1 else f"({inner})"
    if isinstance(arg, list):
        return "[" + ", ".join(_format_arg(a) for a in arg) + "]"
    if isinstance(arg, dict):
        return "{" + ", ".join(f"{k!r}: {_format_arg(v)}" for k, v in arg.items()) + "}"
    if isinstance(arg, slice):
        return f"slice({_format_arg(arg.start)}, {_format_arg(arg.stop)}, {_format_arg(arg.step)})"
    if callable(arg) and not isinstance(arg, torch.nn.Module):
        return qualified_name(arg)
    return repr(arg)


def format_args(node: fx.Node) -> str:
    parts = [_format_arg(a) for a in node.args]
    parts += [f"{k}={_format_arg(v)}" for k, v in node.kwargs.items()]
    return ", ".join(parts)


def format_module(module: torch.nn.Module) -> str:
    """One line: ``Conv2d(1, 16, kernel_size=(3, 3), stride=(1, 1))``; ``Block(...)`` for containers."""
    extra = module.extra_repr()
    if "\n" in extra:
        extra = "..."
    if not extra and next(iter(module.children()), None) is not None:
        extra = "..."
    return f"{type(module).__name__}({extra})"


def format_target(node: fx.Node, root: torch.nn.Module | None) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "get_attr":
        return f"get_attr {node.target}"
    if node.op == "call_module":
        module = _resolve(root, str(node.target)) if root is not None else None
        text = format_module(module) if isinstance(module, torch.nn.Module) else str(node.target)
        if node.meta.get(OPAQUE):
            text += " [opaque]"
        return text
    if node.op == "call_method":
        return f".{node.target}"
    return qualified_name(node.target)


def _resolve(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom, None)
        if obj is None:
            return None
    return obj


def format_node(node: fx.Node, root: torch.nn.Module | None, shape: str | None = None) -> str:
    """The code-like line of a node: ``%conv1 : Conv2d(1, 16, ...) -> [1, 16, 8, 8]  (%x)``.

    ``shape`` overrides the shape column (``?`` when unknown).
    """
    if node.op == "output":
        return f"return {_format_arg(node.args[0]) if node.args else 'None'}"
    if shape is None:
        shape = format_shape(node.meta[SHAPE]) if SHAPE in node.meta else "?"
    line = f"%{node.name} : {format_target(node, root)} -> {shape}"
    args = format_args(node)
    if node.op not in ("placeholder", "get_attr") or args:
        line += f"  ({args})"
    return line
