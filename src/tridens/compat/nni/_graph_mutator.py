"""NNI 2.x's graph mutators (``nni.retiarii.Mutator``) on tridens' graph IR.

An NNI mutator edits NNI's graph (``model.get_nodes_by_label``, ``node.operation.parameters``,
``node.update_operation``, ``graph.insert_node_on_edge``) and decides with ``self.choice(...)``.
Here it is a ``td.Mutator``: the space traces the base model with ``torch.fx`` (an
``nn.Placeholder`` is one node) and hands ``mutate`` a view of that graph with NNI's names. An
operation is a module class and its constructor arguments: ``node.operation.parameters`` of a
``torch.nn`` layer are read back from the layer (``Conv2d``: ``in_channels``, ``out_channels``,
``kernel_size``...), and a node whose type or parameters the mutator changed is rebuilt from them
(``type(**parameters)``) when ``mutate`` returns. Type names follow NNI's code generator:
``'__mutated__.module.Class'`` or ``'__torch__.module.Class'`` name a class by import path.

Each ``self.choice(candidates)`` is a tridens label: ``{mutator label}/{i}`` for a mutator built
with ``label=``, else ``{ClassName}_{n}`` numbered in the order the choices are made.
"""

from __future__ import annotations

import contextvars
import copy
import importlib
import inspect
import sys
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from tridens.errors import InvalidSpace
from tridens.graph import Graph as _TdGraph
from tridens.graph import Node as _TdNode
from tridens.space import Mutator as _TdMutator

from ._common import NotSupported, only_default

__all__ = ["Mutator", "Placeholder", "Operation", "Model", "Graph", "Node", "Edge", "InvalidMutation", "Sampler"]

# Where a node's NNI operation, the operation its module was built from, and its label live.
_META = "tridens.compat.nni.operation"

# The choice counter of the labelled mutator running now.
_CALLS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("nni_mutator_calls", default=None)


class InvalidMutation(Exception):
    """``nni.retiarii.InvalidMutation``: a mutator may raise it for a combination it cannot build."""


class Sampler:
    """``nni.retiarii.Sampler``: tridens' strategies make the decisions; a mutator takes no sampler."""


class Placeholder(nn.Module):
    """``nn.Placeholder(label, **related_info)``: an empty module (its ``forward`` returns its input)
    for a mutator to replace; its node has ``label`` and ``operation.parameters == related_info``.

    >>> ph = Placeholder("block0", kernel_size_options=[3, 5])
    >>> ph.label, ph.related_info
    ('block0', {'kernel_size_options': [3, 5]})
    """

    def __init__(self, label: str, **related_info: Any) -> None:
        super().__init__()
        self.label = label
        self.related_info = related_info

    def forward(self, x: Any) -> Any:
        return x


class Operation:
    """``Operation(type, parameters)``: which module class a node calls and its constructor
    arguments. ``parameters`` is the dict given (NNI keeps the reference too)."""

    def __init__(self, type: str, parameters: dict[str, Any] | None = None) -> None:
        self.type = type
        self.parameters: dict[str, Any] = parameters if parameters is not None else {}

    @classmethod
    def new(cls, type_name: str, parameters: dict[str, Any] | None = None, cell_name: str | None = None,
            attributes: dict[str, Any] | None = None) -> Operation:
        if cell_name is not None:
            raise NotSupported("NNI's cell operations (a node holding a subgraph) have no tridens equivalent: "
                               "tridens' graph is one flat torch.fx graph; give a module class instead.")
        return cls(type_name, parameters)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Operation) and other.type == self.type and other.parameters == self.parameters

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.parameters.items())
        return f"Operation(type={self.type!r}{', ' if args else ''}{args})"


class _Info:
    """What the view keeps on an fx node: its operation, a copy of the operation its module was
    built from (None: never rebuilt, a placeholder or a function), and its label."""

    def __init__(self, operation: Operation, built: Operation | None, label: str | None) -> None:
        self.operation, self.built, self.label = operation, built, label


def _type_name(cls: type) -> str:
    return f"__torch__.{cls.__module__}.{cls.__qualname__}"


def _init_parameters(module: nn.Module) -> dict[str, Any]:
    """The constructor arguments of ``module``: those it was built with when tridens kept them,
    else every ``__init__`` parameter the module keeps as an attribute of the same name (a tensor
    or None in place of a boolean default, such as ``Conv2d.bias``, is read as present or not)."""
    init = type(module).__init__
    try:
        signature = inspect.signature(init)
    except (TypeError, ValueError):
        return {}
    kept = module.__dict__.get("_tridens_init")
    if kept is not None:
        args, kwargs = kept
        try:
            bound = signature.bind(module, *args, **kwargs)
        except TypeError:
            bound = None
        if bound is not None:
            values = dict(bound.arguments)
            values.pop(next(iter(signature.parameters)), None)  # self
            return values
    params: dict[str, Any] = {}
    for p in list(signature.parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in ("device", "dtype"):
            continue
        if p.name not in module.__dict__ and not hasattr(type(module), p.name) and \
                p.name not in module._parameters and p.name not in module._buffers:
            continue
        value = getattr(module, p.name)
        if isinstance(p.default, bool) and (value is None or isinstance(value, torch.Tensor)):
            value = value is not None
        elif isinstance(value, (torch.Tensor, nn.Module)) or callable(value):
            continue
        params[p.name] = value
    return params


def _resolve_type(type_name: str, where: str) -> type:
    """The module class ``type_name`` names (``'__mutated__.pkg.mod.Class'``, ``'__torch__.pkg.mod.Class'``
    or ``'pkg.mod.Class'``): its module is looked up among those already imported, then imported."""
    if not isinstance(type_name, str):
        raise NotSupported(f"{where}: an operation type must be a str naming a module class such as "
                           f"'__mutated__.module.Class'. Got {type_name!r} instead.")
    path = type_name
    for prefix in ("__mutated__.", "__torch__."):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name, attrs = ".".join(parts[:cut]), parts[cut:]
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
        obj: Any = module
        try:
            for attr in attrs:
                obj = getattr(obj, attr)
        except AttributeError:
            continue
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            return obj
        break
    raise NotSupported(f"{where}: the operation type {type_name!r} names no nn.Module class that can be imported "
                       f"(NNI's spelling: '__mutated__.module.Class' for a class of your own, importable from the "
                       f"script's folder).")


def _build(operation: Operation, where: str) -> nn.Module:
    cls = _resolve_type(operation.type, where)
    try:
        return cls(**operation.parameters)
    except Exception as err:
        raise InvalidSpace(f"{where}: {cls.__qualname__}(**{operation.parameters!r}) failed: "
                           f"{type(err).__name__}: {err}") from err


class Edge:
    """A data flow ``head -> tail``: ``tail`` reads ``head``'s output in its argument ``tail_slot``."""

    def __init__(self, head: Node, tail: Node, tail_slot: int | str | None) -> None:
        self.graph = head.graph
        self.head, self.tail = head, tail
        self.head_slot: int | None = None
        self.tail_slot = tail_slot

    def __repr__(self) -> str:
        return f"Edge(head=({self.head.name}, None), tail=({self.tail.name}, {self.tail_slot}))"

    def remove(self) -> None:
        raise NotSupported("Edge.remove(): tridens' graph keeps every node connected; edit with "
                           "graph.insert_node_on_edge / node.update_operation, or write a td.Mutator "
                           "(graph.disconnect / graph.connect).")


class Node:
    """One node of the graph: ``name``, ``label``, ``operation`` (``type``, ``parameters``),
    ``predecessors`` / ``successors``, ``incoming_edges`` / ``outgoing_edges``, ``update_operation``."""

    def __init__(self, graph: Graph, node: _TdNode) -> None:
        self.graph = graph
        self._node = node

    # -- what NNI's node holds ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._node.name

    @property
    def python_name(self) -> str | None:
        """The module's path in the model (a call_module node), else None."""
        return str(self._node.target) if self._node.op == "call_module" else None

    @property
    def id(self) -> int:
        return self.graph._order().index(self._node.fx_node)

    def _info(self) -> _Info:
        info = self._node.meta.get(_META)
        if info is None:
            info = self._node.meta[_META] = self._describe()
        return info

    def _describe(self) -> _Info:
        node = self._node
        if node.op == "call_module":
            module = node.module
            assert module is not None
            if isinstance(module, Placeholder):
                return _Info(Operation(_type_name(Placeholder), module.related_info), None, module.label)
            params = _init_parameters(module)
            op = Operation(_type_name(type(module)), params)
            label = getattr(module, "label", None)
            return _Info(op, copy.deepcopy(op), label if isinstance(label, str) else None)
        if node.op == "placeholder":
            return _Info(Operation("_inputs"), None, None)
        if node.op == "output":
            return _Info(Operation("_outputs"), None, None)
        target = node.target
        name = target if isinstance(target, str) else getattr(target, "__name__", repr(target))
        return _Info(Operation(f"aten::{name}"), None, None)

    @property
    def operation(self) -> Operation:
        return self._info().operation

    @operation.setter
    def operation(self, value: Operation) -> None:
        self.update_operation(value)

    @property
    def label(self) -> str | None:
        return self._info().label

    def update_label(self, label: str | None) -> None:
        self._info().label = label

    # -- topology -----------------------------------------------------------------------------
    @property
    def incoming_edges(self) -> list[Edge]:
        view = self.graph._view
        return [Edge(view(src), self, slot) for src, slot in self._node.inputs]

    @property
    def outgoing_edges(self) -> list[Edge]:
        view = self.graph._view
        edges = []
        for user in self._node.users:
            tail = view(user)
            edges += [Edge(self, tail, slot) for src, slot in user.inputs if src.fx_node is self._node.fx_node]
        return edges

    @property
    def predecessors(self) -> list[Node]:
        return list(dict.fromkeys(e.head for e in self.incoming_edges))

    @property
    def successors(self) -> list[Node]:
        return [self.graph._view(u) for u in self._node.users]

    # -- edits -----------------------------------------------------------------------------------
    def update_operation(self, operation_or_type: Operation | str, parameters: dict[str, Any] | None = None) -> None:
        """Make this node call ``operation_or_type`` (an :class:`Operation`, or a type name with its
        ``parameters``); the module is built now and rebuilt when ``mutate`` returns if the
        parameters changed in between."""
        if self._node.op != "call_module" and self._node.op not in ("call_function", "call_method"):
            raise NotSupported(f"update_operation() on node {self.name!r}: only operations can change, not the "
                               f"graph's {self._node.op}.")
        op = operation_or_type if isinstance(operation_or_type, Operation) else Operation.new(operation_or_type, parameters)
        info = self._info()
        info.operation = op
        self.graph._materialize(self, info)

    def remove(self) -> None:
        """Remove this node; its users read its input instead (tridens' ``graph.remove``)."""
        self.graph._graph.remove(self._node)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and other._node.fx_node is self._node.fx_node

    def __hash__(self) -> int:
        return hash(self._node.fx_node)

    def __repr__(self) -> str:
        return f"Node(name={self.name}, python_name={self.python_name}, label={self.label}, operation={self.operation})"


class Graph:
    """NNI's ``Graph`` over one tridens graph: ``nodes`` (with the input and output nodes),
    ``hidden_nodes``, ``get_nodes_by_label`` / ``_by_type`` / ``get_node_by_name``,
    ``insert_node_on_edge``. tridens' graph is flat: a model is one graph, named ``_model``."""

    def __init__(self, model: Model, graph: _TdGraph, name: str = "_model") -> None:
        self.model, self.name = model, name
        self._graph = graph
        self._views: dict[Any, Node] = {}

    def _view(self, node: _TdNode) -> Node:
        view = self._views.get(node.fx_node)
        if view is None:
            view = self._views[node.fx_node] = Node(self, node)
        return view

    def _order(self) -> list[Any]:
        return [n.fx_node for n in self._graph]

    @property
    def nodes(self) -> list[Node]:
        return [self._view(n) for n in self._graph]

    @property
    def hidden_nodes(self) -> list[Node]:
        return [self._view(n) for n in self._graph if n.op not in ("placeholder", "output")]

    @property
    def input_node(self) -> Node:
        return self._view(self._graph.inputs[0])

    @property
    def output_node(self) -> Node:
        return self._view(self._graph.output)

    @property
    def edges(self) -> list[Edge]:
        return [e for n in self.nodes for e in n.incoming_edges]

    def get_node_by_name(self, name: str) -> Node | None:
        found = self.get_nodes_by_name(name)
        return found[0] if found else None

    def get_nodes_by_name(self, name: str) -> list[Node]:
        return [n for n in self.hidden_nodes if n.name == name]

    def get_node_by_python_name(self, python_name: str) -> Node | None:
        found = [n for n in self.nodes if n.python_name == python_name]
        return found[0] if found else None

    def get_nodes_by_type(self, operation_type: str) -> list[Node]:
        return [n for n in self.hidden_nodes if n.operation.type == operation_type]

    def get_nodes_by_label(self, label: str) -> list[Node]:
        return [n for n in self.hidden_nodes if n.label == label]

    def insert_node_on_edge(self, edge: Edge, name: str, operation_or_type: Operation | str,
                            parameters: dict[str, Any] | None = None) -> Node:
        """A new node ``name`` calling ``operation_or_type`` on the edge: it reads ``edge.head`` and
        ``edge.tail`` reads it."""
        op = operation_or_type if isinstance(operation_or_type, Operation) else Operation.new(operation_or_type, parameters)
        where = f"insert_node_on_edge({name!r})"
        module = _build(op, where)
        new = self._graph.insert_on_edge(edge.head._node, edge.tail._node, module, name=_identifier(name))
        new.meta[_META] = _Info(op, copy.deepcopy(op), None)
        return self._view(new)

    def add_node(self, name: str, operation_or_type: Any, parameters: dict[str, Any] | None = None) -> Node:
        raise NotSupported(f"Graph.add_node({name!r}): tridens' graph holds no node without inputs; use "
                           "graph.insert_node_on_edge(edge, name, type, parameters), or write a td.Mutator "
                           "(graph.add_node(module, inputs) then graph.connect).")

    def _materialize(self, node: Node, info: _Info) -> None:
        """Rebuild ``node``'s module from its operation when it differs from the one it was built from."""
        op = info.operation
        if node._node.op in ("placeholder", "output") or op.type == _type_name(Placeholder):
            return
        if info.built is not None and info.built == op:
            return
        if info.built is None and node._node.op != "call_module" and op.type.startswith("aten::"):
            return  # a function node left as it is
        module = _build(op, f"node {node.name!r}")
        node._node.replace(module)
        info.built = copy.deepcopy(op)

    def _materialize_all(self) -> None:
        for td_node in self._graph.nodes():
            info = td_node.meta.get(_META)
            if info is not None:
                self._materialize(self._view(td_node), info)

    def __repr__(self) -> str:
        return f"Graph(name={self.name}, nodes={[n.name for n in self.nodes]})"


def _identifier(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in str(name))
    return out if out and not out[0].isdigit() else f"n_{out}"


class Model:
    """NNI's ``Model`` handed to ``Mutator.mutate``: its one graph (``root_graph``, ``graphs``) and the
    searches over its nodes (``get_nodes``, ``get_nodes_by_label``, ``get_nodes_by_type``,
    ``get_node_by_name``, ``get_node_by_python_name``)."""

    def __init__(self, graph: _TdGraph) -> None:
        self.root_graph = Graph(self, graph)
        self.graphs = {self.root_graph.name: self.root_graph}

    def get_nodes(self) -> Iterable[Node]:
        return iter(self.root_graph.nodes)

    def get_nodes_by_label(self, label: str) -> list[Node]:
        return self.root_graph.get_nodes_by_label(label)

    def get_nodes_by_type(self, type_name: str) -> list[Node]:
        return self.root_graph.get_nodes_by_type(type_name)

    def get_node_by_name(self, node_name: str) -> Node | None:
        return self.root_graph.get_node_by_name(node_name)

    def get_node_by_python_name(self, python_name: str) -> Node | None:
        return self.root_graph.get_node_by_python_name(python_name)

    def __repr__(self) -> str:
        return f"Model({self.root_graph!r})"


class Mutator(_TdMutator):
    """``nni.retiarii.Mutator``: subclass it, implement ``mutate(model)`` with ``self.choice(candidates)``
    and pass instances as ``RetiariiExperiment(base_model, evaluator, applied_mutators=[...])`` (or
    ``td.ModelSpace.from_base(base, mutators, example_inputs)``: it is a ``td.Mutator``).

    >>> class Widen(Mutator):                                              # doctest: +SKIP
    ...     def mutate(self, model):
    ...         node = model.get_nodes_by_label("block")[0]
    ...         node.update_operation("__torch__.torch.nn.Conv2d", {
    ...             "in_channels": 8, "out_channels": self.choice([8, 16]), "kernel_size": 3, "padding": 1})
    """

    label: str | None = None
    leaf_modules: tuple[type[nn.Module], ...] = (Placeholder,)

    def __init__(self, sampler: Any = None, label: str | None = None) -> None:
        only_default(type(self).__name__, "sampler", sampler, None,
                     "tridens' strategy makes every decision of self.choice(); pass the mutator to RetiariiExperiment.")
        if label is not None:  # only what differs from the class is an attribute (a stored space keeps vars(mutator))
            self.label = label

    @property
    def name(self) -> str:
        return self.label or type(self).__name__

    def mutate(self, model: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement mutate(model)")

    def edit(self, graph: Any) -> None:
        """Run ``mutate`` on NNI's view of ``graph``, then rebuild the nodes whose operation changed."""
        model = Model(graph)
        token = _CALLS.set([0])
        try:
            self.mutate(model)
        finally:
            _CALLS.reset(token)
        model.root_graph._materialize_all()

    def choice(self, candidates: Iterable[Any], label: str | None = None) -> Any:  # type: ignore[override]
        """One decision among ``candidates`` (labelled ``{label}/{i}``, or ``{ClassName}_{n}``)."""
        options: Sequence[Any] = list(candidates)
        if label is None and self.label is not None:
            calls = _CALLS.get()
            index = 0
            if calls is not None:
                index = calls[0]
                calls[0] += 1
            label = f"{self.label}/{index}"
        return super().choice(options, label=label)

    def bind_sampler(self, sampler: Any) -> Mutator:
        raise NotSupported("Mutator.bind_sampler(): tridens' strategy makes every decision; pass the mutator to "
                           "RetiariiExperiment(base_model, evaluator, [mutator], strategy).")

    def apply(self, model: Any) -> Any:
        raise NotSupported("Mutator.apply(model): tridens applies mutators while it builds each sample; use "
                           "td.ModelSpace.from_base(base, [mutator], example_inputs).freeze(sample).")

    def dry_run(self, model: Any) -> Any:
        raise NotSupported("Mutator.dry_run(model): tridens finds a mutator's choices itself; use "
                           "td.ModelSpace.from_base(base, [mutator], example_inputs).search_space().")

