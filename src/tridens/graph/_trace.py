"""Capture: ``torch.fx`` symbolic tracing with an opaque-node fallback.

Standard ``torch.nn`` modules are leaves (one ``call_module`` node each); user modules are traced
through. When fx fails inside a user module's forward (data-dependent control flow, ...), that
module becomes a leaf -- an *opaque* node -- and tracing starts over, a few times at most. When the
top-level forward itself fails, the whole model is one opaque node. Every opaque node is reported
with ``warnings.warn`` (an :class:`OpaqueModuleWarning`) naming the module and the fx error.

A condition on shapes (``if x.dim() == 2:``, ``x.ndim``, ``x.shape[1] != 64``, ``x.size(0) > 1``)
cannot be decided on a symbolic value; with example inputs it is decided on them instead (the
graph up to that point run on meta copies: no weights touched, no statistics updated), the branch
taken is the one recorded, and a :class:`ShapeSpecializedWarning` names the line. Shapes used as
values (``x.view(x.size(0), -1)``) stay symbolic; conditions on tensor values still fail.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import threading
import traceback
import warnings
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from . import _meta
from ._graph import Graph
from ._shapes import as_inputs

__all__ = ["trace", "OpaqueModuleWarning", "ShapeSpecializedWarning"]

#: how many submodules may be made opaque before the whole model is
_MAX_OPAQUE = 8


class OpaqueModuleWarning(UserWarning):
    """A module torch.fx could not trace through is kept as one opaque (still trainable) node."""


class ShapeSpecializedWarning(UserWarning):
    """A condition in a forward was decided from the example inputs' shapes while tracing: the
    graph holds the branch those inputs take (inputs of another rank or size may need another)."""


_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the tridens package
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _user_line() -> str:
    """``file:line: code`` of the innermost frame outside torch and tridens (the user's forward)."""
    for frame in reversed(traceback.extract_stack()):
        name = os.path.abspath(frame.filename)
        if not name.startswith((_HERE, _TORCH)):
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "an unknown line"


def _math_tables() -> tuple[dict[str, Any], dict[str, Any], frozenset[int]] | None:
    """``math``'s public functions, fx's wrappers for them, and their ids: made once.

    Like every ``fx.Tracer``, ours records ``math.sqrt(proxy)`` (and ``from math import sqrt``) as a
    call_function node. fx does it by wrapping each of math's ~60 functions anew at every trace
    (a noticeable share of tracing a small model); its wrappers keep no state (they find
    the tracer through their Proxy arguments), so the same ones serve every trace. ``None`` if this
    torch lacks the (private) helper: then fx wraps as usual.
    """
    global _MATH
    if _MATH is None:
        wrap = getattr(fx._symbolic_trace, "_create_wrapped_func", None)
        originals = {k: v for k, v in vars(math).items() if not k.startswith("_") and callable(v)}
        wrappers = {}
        if wrap is not None:
            for name, fn in originals.items():
                wrapped = wrap(fn)
                wrapped.__fx_already_patched = True  # type: ignore[attr-defined]  # fx's patcher then keeps it
                wrappers[name] = wrapped
        _MATH = (originals, wrappers, frozenset(id(v) for v in originals.values())) if wrap is not None else False
    return _MATH or None


_MATH: Any = None
_MATH_LOCK = threading.Lock()
_MATH_DEPTH = 0


@contextlib.contextmanager
def _math_wrapped(tables: tuple[dict[str, Any], dict[str, Any], frozenset[int]]) -> Iterator[None]:
    """math's functions replaced by the fx wrappers while tracing, as fx's own patcher does."""
    global _MATH_DEPTH
    originals, wrappers, _ = tables
    with _MATH_LOCK:
        if _MATH_DEPTH == 0:
            vars(math).update(wrappers)
        _MATH_DEPTH += 1
    try:
        yield
    finally:
        with _MATH_LOCK:
            _MATH_DEPTH -= 1
            if _MATH_DEPTH == 0:
                vars(math).update(originals)


class _Tracer(fx.Tracer):
    """fx tracer whose leaves are torch.nn modules, ``leaf_types`` and the modules made opaque.

    It remembers the innermost traced-through module whose forward raised (``failed_path``).
    """

    def __init__(self, opaque: dict[str, str], leaf_types: tuple[type, ...],
                 example_inputs: tuple[Any, ...] | None = None) -> None:
        tables = _math_tables()
        if tables is None:
            super().__init__()
        else:  # math is patched around the trace by _math_wrapped (see _math_tables)
            super().__init__(autowrap_modules=())  # type: ignore[arg-type]  # no module auto-wrapped
            self._autowrap_function_ids = tables[2]  # type: ignore[assignment]
        self.math_tables = tables
        self.opaque = opaque
        self.leaf_types = leaf_types
        self.failed_path: str | None = None
        self.example_inputs = example_inputs
        self._meta_root: nn.Module | None = None
        self._values: dict[fx.Node, Any] = {}
        self._evaluating = False  # running meta copies: module calls run as they are, untraced

    def to_bool(self, obj: fx.Proxy) -> bool:
        """A condition on a traced value: decided on the example inputs when it depends on shapes
        only (warned, naming the line), else fx's error."""
        if self.example_inputs is None:
            return super().to_bool(obj)
        try:
            value = self._evaluate(obj.node)
        except Exception:
            value = None
        if isinstance(value, torch.Tensor) and value.device.type != "meta" and value.numel() == 1:
            value = bool(value)
        if not isinstance(value, (bool, int, float)):
            return super().to_bool(obj)  # a condition on tensor values: fx's TraceError
        decided = bool(value)
        warnings.warn(f"tridens.graph.trace: a condition at {_user_line()} was decided from the example inputs "
                      f"({decided}): the graph holds that branch only", ShapeSpecializedWarning, stacklevel=2)
        return decided

    def _evaluate(self, target: fx.Node) -> Any:
        """``target``'s value on meta copies of the example inputs and of the model (the graph
        traced so far, run once node by node; values kept for later conditions)."""
        if self._meta_root is None:
            self._meta_root = copy.deepcopy(self.root).to("meta")
        self._evaluating = True
        try:
            return self._run_to(target)
        finally:
            self._evaluating = False

    def _run_to(self, target: fx.Node) -> Any:
        root, values = self._meta_root, self._values
        assert root is not None
        inputs = iter(self.example_inputs or ())
        for node in self.graph.nodes:
            if node in values:
                if node is target:
                    break
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
            if node.op == "placeholder":
                x = next(inputs)
                values[node] = x.to("meta") if isinstance(x, torch.Tensor) else x
            elif node.op == "get_attr":
                value: Any = root
                for part in str(node.target).split("."):
                    value = getattr(value, part)
                values[node] = value
            elif node.op == "call_module":
                values[node] = root.get_submodule(str(node.target))(*args, **kwargs)
            elif node.op == "call_function":
                values[node] = node.target(*args, **kwargs)  # type: ignore[operator]
            elif node.op == "call_method":
                values[node] = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            if node is target:
                break
        return values[target]

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (
            module_qualified_name in self.opaque
            or (bool(self.leaf_types) and isinstance(m, self.leaf_types))
            or super().is_leaf_module(m, module_qualified_name)
        )

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._evaluating:  # (fx patches Module.__call__ while tracing)
            return forward(*args, **kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_path is None:
                try:
                    self.failed_path = self.path_of_module(m)
                except NameError:  # a module that is not part of the model: give up on it
                    self.failed_path = ""
            raise


def _signature(model: nn.Module) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def _concrete_args(params: list[inspect.Parameter] | None, n_given: int | None) -> dict[str, Any] | None:
    """Parameters with defaults that the example inputs don't cover are traced with the default."""
    if params is None:
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    concrete = {}
    for i, p in enumerate(positional):
        if p.default is not p.empty and (n_given is None or i >= n_given):
            concrete[p.name] = p.default
    return concrete or None


def _copy_attr(src_root: nn.Module, dst_root: nn.Module, target: str) -> None:
    """Make ``dst_root.<target>`` the same object as ``src_root.<target>``, creating empty
    containers on the way (the user's model is never modified)."""
    *prefix, field = target.split(".")
    src: Any = src_root
    dst: Any = dst_root
    for atom in prefix:
        src = getattr(src, atom)
        nxt = getattr(dst, atom, None)
        if nxt is src:  # already copied by reference: everything below is there
            return
        if nxt is None:
            nxt = nn.Module()
            dst.add_module(atom, nxt)
        dst = nxt
    obj = getattr(src, field)
    if getattr(dst, field, None) is obj:
        return
    if isinstance(obj, nn.Module):
        dst.add_module(field, obj)
    elif isinstance(obj, nn.Parameter):
        dst.register_parameter(field, obj)
    elif isinstance(obj, torch.Tensor):
        dst.register_buffer(field, obj)
    else:
        setattr(dst, field, obj)


def _build_root(model: nn.Module, fx_graph: fx.Graph, added: dict[str, Any]) -> nn.Module:
    root = nn.Module()
    targets = {str(n.target) for n in fx_graph.nodes if n.op in ("call_module", "get_attr")}
    for target in sorted(targets, key=lambda t: t.count(".")):
        if target in added:  # a constant fx attached to the model while tracing
            value = added[target]
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                root.register_buffer(target, value)
            else:
                setattr(root, target, value)
        else:
            _copy_attr(model, root, target)
    return root


def _opaque_whole(model: nn.Module, params: list[inspect.Parameter] | None,
                  n_given: int | None) -> tuple[nn.Module, fx.Graph]:
    """The whole model as one call_module node fed by its positional inputs."""
    names: list[str] = []
    if params is not None:
        for p in params:
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                if n_given is None and p.default is not p.empty:
                    break
                if n_given is not None and len(names) >= n_given:
                    break
                names.append(p.name)
            elif p.kind == p.VAR_POSITIONAL and n_given is not None:
                names += [f"{p.name}_{i}" for i in range(n_given - len(names))]
    else:
        names = [f"input_{i}" for i in range(n_given or 1)]
    fx_graph = fx.Graph()
    inputs = tuple(fx_graph.placeholder(name) for name in names)
    out = fx_graph.call_module("model", inputs)
    fx_graph.output(out)
    root = nn.Module()
    root.add_module("model", model)
    return root, fx_graph


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def trace(model: nn.Module, example_inputs: Any = None, *,
          leaf_modules: Sequence[type[nn.Module]] = ()) -> Graph:
    """Capture ``model`` as a :class:`Graph` with ``torch.fx``.

    ``example_inputs`` (a tensor or a tuple of tensors) give the nodes their output shapes; they
    are propagated lazily, the first time a shape is read. Modules of the ``leaf_modules`` types are
    kept as single nodes like standard ``torch.nn`` modules. Modules fx cannot trace through become
    opaque nodes (see :class:`OpaqueModuleWarning`). The graph shares the model's submodules and
    weights; the model itself is never modified.

    >>> import torch, torch.nn as nn
    >>> g = trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.randn(2, 4))
    >>> [n.name for n in g.nodes()]
    ['input_1', '_0', '_1', 'output']
    >>> g.nodes(op_type=nn.Linear)[0].output_shape
    torch.Size([2, 8])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace() needs an nn.Module, but got {type(model).__name__}")
    inputs = as_inputs(example_inputs)
    n_given = None if inputs is None else len(inputs)
    params = _signature(model)
    concrete = _concrete_args(params, n_given)
    opaque: dict[str, str] = {}
    leaf_types = tuple(leaf_modules)
    name = type(model).__name__
    fx_graph: fx.Graph | None = None
    root_error: BaseException | None = None
    for _ in range(_MAX_OPAQUE + 1):
        tracer = _Tracer(opaque, leaf_types, inputs)
        before = set(vars(model))
        try:
            with _math_wrapped(tracer.math_tables) if tracer.math_tables else contextlib.nullcontext():
                fx_graph = tracer.trace(model, concrete_args=concrete)
        except Exception as err:  # fx raises TraceError, TypeError, AttributeError, ...
            fx_graph = None
            path = tracer.failed_path
            if not path or path in opaque:
                root_error = err
                break
            opaque[path] = _first_line(err)
        finally:
            added = {k: vars(model)[k] for k in set(vars(model)) - before}
            for k in added:  # fx attaches tensor constants to the root: move them off the model
                delattr(model, k)
        if fx_graph is not None:
            break
    if fx_graph is None:
        reason = _first_line(root_error) if root_error is not None else "too many opaque submodules"
        warnings.warn(
            f"tridens.graph.trace: the whole model {name} is one opaque node: torch.fx could not "
            f"trace its forward ({reason}). It stays trainable, but mutators cannot see inside it.",
            OpaqueModuleWarning, stacklevel=2)
        root, fx_graph = _opaque_whole(model, params, n_given)
        opaque = {"model": reason}
    else:
        root = _build_root(model, fx_graph, added)
        used = {str(n.target) for n in fx_graph.nodes if n.op == "call_module"}
        for path, reason in opaque.items():
            if path in used:
                warnings.warn(
                    f"tridens.graph.trace: module {name}.{path} ({type(model.get_submodule(path)).__name__}) "
                    f"is an opaque node: torch.fx could not trace its forward ({reason}). It stays "
                    "trainable, but mutators cannot see inside it.",
                    OpaqueModuleWarning, stacklevel=2)
    for node in fx_graph.nodes:
        if node.op == "call_module" and str(node.target) in opaque:
            node.meta[_meta.OPAQUE] = True
            node.meta[_meta.OPAQUE_REASON] = opaque[str(node.target)]
    return Graph._create(root, fx_graph, inputs, name=name, training=model.training)
