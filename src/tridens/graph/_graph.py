"""The graph IR: a thin, editable view over a ``torch.fx`` graph and the modules it calls.

A :class:`Graph` owns an ``fx.Graph`` and a *root* ``nn.Module`` holding exactly the submodules and
attributes the graph's ``call_module``/``get_attr`` nodes refer to (the traced model's own objects,
so weights are shared; the model's hierarchy itself is never edited). Passes store what they learn
in ``fx.Node.meta`` (keys in ``_meta``). Shapes and fingerprints are computed lazily and memoized
per *version*: every edit bumps the version, runs ``lint()`` and leaves re-propagation to the next
read.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import map_arg

from ..errors import GraphError, InvalidSample
from . import _meta
from ._fingerprint import prefix_fingerprint
from ._flops import flops
from ._params import num_params
from ._shapes import as_inputs, propagate

__all__ = ["Graph", "Node"]


def _snake(name: str) -> str:
    name = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()
    name = re.sub(r"[^0-9a-zA-Z_]", "_", name)
    return name if name and not name[0].isdigit() else f"m_{name}"


def _nodes_in(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []

    def collect(n: fx.Node) -> fx.Node:
        found.append(n)
        return n

    map_arg(arg, collect)
    return found


class Node:
    """One operation of a :class:`Graph` (a wrapper over an ``fx.Node``; ``node.fx_node``).

    >>> import torch, torch.nn as nn, tridens as td
    >>> g = td.graph.trace(nn.Sequential(nn.Conv2d(1, 4, 3)), torch.randn(1, 1, 8, 8))
    >>> conv = g.nodes(op_type=nn.Conv2d)[0]
    >>> conv.output_shape, conv.param_shapes["weight"], [src.name for src, slot in conv.inputs]
    (torch.Size([1, 4, 6, 6]), torch.Size([4, 1, 3, 3]), ['input_1'])
    """

    __slots__ = ("_graph", "_fx")

    def __init__(self, graph: Graph, fx_node: fx.Node) -> None:
        self._graph = graph
        self._fx = fx_node

    # ---- identity and description -------------------------------------------------------------
    @property
    def name(self) -> str:
        """Unique name of the node in its graph (a Python identifier, e.g. ``layer1_0_conv1``)."""
        return self._fx.name

    @property
    def op(self) -> str:
        """The fx opcode: placeholder, get_attr, call_function, call_method, call_module or output."""
        return self._fx.op

    @property
    def target(self) -> Any:
        """fx target: the module path (call_module/get_attr), the function, or the method name."""
        return self._fx.target

    @property
    def op_type(self) -> Any:
        """The module class (call_module), the function (call_function), the method name
        (call_method); the opcode string for placeholder, get_attr and output nodes."""
        n = self._fx
        if n.op == "call_module":
            return type(self._graph._get(str(n.target)))
        if n.op in ("call_function", "call_method"):
            return n.target
        return n.op

    @property
    def module(self) -> nn.Module | None:
        """The called module of a call_module node, else None."""
        if self._fx.op != "call_module":
            return None
        return self._graph._get(str(self._fx.target))

    @property
    def opaque(self) -> bool:
        """True for a module torch.fx could not trace through (kept whole, still trainable)."""
        return bool(self._fx.meta.get(_meta.OPAQUE, False))

    @property
    def param_shapes(self) -> dict[str, torch.Size]:
        """Name -> shape of the parameters of the node's module (all of them, recursively);
        for a get_attr of a parameter ``{attribute name: shape}``; else empty."""
        n = self._fx
        if n.op == "call_module":
            return {k: p.shape for k, p in self._graph._get(str(n.target)).named_parameters()}
        if n.op == "get_attr":
            obj = self._graph._get(str(n.target))
            if isinstance(obj, nn.Parameter):
                return {str(n.target).rsplit(".", 1)[-1]: obj.shape}
            if isinstance(obj, nn.Module):
                return {k: p.shape for k, p in obj.named_parameters()}
        return {}

    @property
    def output_shape(self) -> Any:
        """``torch.Size`` of the output, a tuple of them for multiple outputs, None for a
        non-tensor output or a graph without example inputs. Reading it re-propagates shapes after
        an edit, which raises :class:`~tridens.errors.InvalidSample` (naming the failing node) when
        this node's shape cannot be computed; nodes that don't depend on the failure keep theirs."""
        if self._graph._example_inputs is None:
            return None
        try:
            self._graph._ensure_shapes()
        except InvalidSample:
            if _meta.SHAPE not in self._fx.meta:  # this node could not be computed
                raise
        return self._fx.meta.get(_meta.SHAPE)

    @property
    def inputs(self) -> list[tuple[Node, int | str]]:
        """Incoming edges ``(source node, slot)`` in argument order; the slot is the positional
        argument index (every member of a list argument such as ``torch.cat``'s shares it) or the
        keyword name."""
        wrap = self._graph._wrap
        edges: list[tuple[Node, int | str]] = []
        for i, arg in enumerate(self._fx.args):
            edges += [(wrap(n), i) for n in _nodes_in(arg)]
        for key, arg in self._fx.kwargs.items():
            edges += [(wrap(n), key) for n in _nodes_in(arg)]
        return edges

    @property
    def users(self) -> list[Node]:
        """Nodes that consume this node's output."""
        return [self._graph._wrap(u) for u in self._fx.users]

    @property
    def meta(self) -> dict[str, Any]:
        """The fx node's metadata dict, where passes keep what they learn."""
        return self._fx.meta

    @property
    def fx_node(self) -> fx.Node:
        """The underlying ``torch.fx.Node`` (edit it only through :class:`Graph` methods)."""
        return self._fx

    @property
    def graph(self) -> Graph:
        return self._graph

    def prefix_fingerprint(self) -> str:
        """Hash of the subgraph that feeds this node: its own descriptor and its inputs' prefix
        fingerprints in slot order (memoized until the next edit)."""
        return prefix_fingerprint(self._graph, self._fx)

    # ---- editing -----------------------------------------------------------------------------
    def replace(self, module: nn.Module) -> Node:
        """Make this node call ``module`` instead, with the same inputs; returns ``self``.

        A call_module node gets the new module (in place of the old one, which keeps its name when
        no other node uses it). A call_function/call_method node becomes a call_module node whose
        module receives the node's input nodes positionally, in slot order (members of a list
        argument flattened; constant arguments dropped: the module carries its own configuration).
        """
        self._graph._replace(self._fx, module)
        return self

    def __str__(self) -> str:
        return self._graph._format(self._fx)

    def __repr__(self) -> str:
        return f"Node({self._graph._format(self._fx)})"


class Graph:
    """Data-flow graph of a concrete model, built by :func:`tridens.graph.trace`.

    >>> import torch, torch.nn as nn, tridens as td
    >>> g = td.graph.trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.randn(2, 4))
    >>> relu = g.nodes(op_type=nn.ReLU)[0]
    >>> _ = g.insert_after(relu, nn.Linear(8, 3))
    >>> g.to_module()(torch.randn(2, 4)).shape
    torch.Size([2, 3])
    >>> len(g.fingerprint())
    32
    """

    _root: nn.Module
    _fx: fx.Graph
    _example_inputs: tuple[Any, ...] | None
    _name: str
    _training: bool
    _wrappers: dict[fx.Node, Node]
    _version: int
    _shapes_version: int
    _shape_error: InvalidSample | None

    def __init__(self) -> None:  # use trace(); Graph._create builds one
        raise TypeError("build a Graph with tridens.graph.trace(model, example_inputs)")

    @classmethod
    def _create(cls, root: nn.Module, fx_graph: fx.Graph, example_inputs: tuple[Any, ...] | None,
                *, name: str, training: bool) -> Graph:
        self = cls.__new__(cls)
        self._root = root
        self._fx = fx_graph
        fx_graph.owning_module = root  # type: ignore[assignment]  # fx accepts any root module here
        self._example_inputs = example_inputs
        self._name = name
        self._training = training
        self._wrappers = {}
        self._version = 0
        self._shapes_version = -1
        self._shape_error = None
        return self

    # ---- access ------------------------------------------------------------------------------
    def _wrap(self, fx_node: fx.Node) -> Node:
        node = self._wrappers.get(fx_node)
        if node is None:
            node = self._wrappers[fx_node] = Node(self, fx_node)
        return node

    def _get(self, target: str) -> Any:
        obj: Any = self._root
        for atom in target.split("."):
            obj = getattr(obj, atom)
        return obj

    def __iter__(self) -> Iterator[Node]:
        return (self._wrap(n) for n in self._fx.nodes)

    def __len__(self) -> int:
        return len(self._fx.nodes)

    def __getitem__(self, name: str) -> Node:
        for n in self._fx.nodes:
            if n.name == name:
                return self._wrap(n)
        raise KeyError(f"no node named {name!r} in the graph of {self._name}")

    def nodes(self, op_type: Any = None, name: str | None = None) -> list[Node]:
        """Nodes in topological order, optionally filtered.

        ``op_type``: a module class (isinstance match on call_module nodes), a function
        (call_function nodes calling it), or a string (a method name, or an opcode such as
        ``"placeholder"``). ``name``: an exact name or a glob, matched against the node name and,
        for call_module nodes, the module path (``"layer1.*"`` and ``"layer1_*"`` both work).

        >>> import torch, torch.nn as nn, tridens as td
        >>> g = td.graph.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
        >>> [n.name for n in g.nodes(op_type=nn.Linear)], [n.name for n in g.nodes(name="_1")]
        (['_0', '_2'], ['_1'])
        """
        out = []
        for fx_node in self._fx.nodes:
            node = self._wrap(fx_node)
            if op_type is not None and not self._type_matches(node, op_type):
                continue
            if name is not None and not self._name_matches(fx_node, name):
                continue
            out.append(node)
        return out

    @staticmethod
    def _type_matches(node: Node, op_type: Any) -> bool:
        if isinstance(op_type, type) and issubclass(op_type, nn.Module):
            return node.op == "call_module" and isinstance(node.module, op_type)
        if isinstance(op_type, str):
            return node.op_type == op_type
        return node.op == "call_function" and node.target is op_type

    @staticmethod
    def _name_matches(fx_node: fx.Node, pattern: str) -> bool:
        names = [fx_node.name]
        if fx_node.op in ("call_module", "get_attr"):
            names.append(str(fx_node.target))
        return any(n == pattern or fnmatch.fnmatchcase(n, pattern) for n in names)

    @property
    def inputs(self) -> list[Node]:
        """The placeholder nodes, in argument order."""
        return [self._wrap(n) for n in self._fx.nodes if n.op == "placeholder"]

    @property
    def output(self) -> Node:
        """The output node (its inputs are the graph's results)."""
        for n in reversed(self._fx.nodes):
            if n.op == "output":
                return self._wrap(n)
        raise GraphError(f"the graph of {self._name} has no output node")

    @property
    def example_inputs(self) -> tuple[Any, ...] | None:
        return self._example_inputs

    @property
    def root(self) -> nn.Module:
        """The module holding the submodules and attributes the nodes refer to."""
        return self._root

    @property
    def fx_graph(self) -> fx.Graph:
        """The underlying ``torch.fx.Graph`` (edit it only through the methods here)."""
        return self._fx

    # ---- passes ------------------------------------------------------------------------------
    def _ensure_shapes(self) -> None:
        if self._shapes_version == self._version:
            if self._shape_error is not None:  # a fresh exception: don't grow the cached traceback
                raise InvalidSample(str(self._shape_error)) from self._shape_error.__cause__
            return
        self._shapes_version = self._version
        self._shape_error = None
        try:
            propagate(self, self._example_inputs)
        except InvalidSample as err:
            self._shape_error = err
            raise

    def propagate_shapes(self, example_inputs: Any = None) -> None:
        """Run shape propagation now (with new ``example_inputs`` if given).

        Raises :class:`~tridens.errors.InvalidSample` naming the failing node and the input shapes
        when the model does not fit its example inputs.
        """
        if example_inputs is not None:
            self._example_inputs = as_inputs(example_inputs)
            self._version += 1
        if self._example_inputs is None:
            raise InvalidSample(f"the graph of {self._name} has no example inputs to propagate")
        self._ensure_shapes()

    def fingerprint(self) -> str:
        """Structural hash (32 hex digits) of the computation: ops, their configuration, parameter
        shapes and requires_grad flags, input shapes and connections -- not attribute names, node
        names or weights. It does not run the model (shapes follow from the input shapes), so it
        exists for a graph whose shapes don't fit too: ``propagate_shapes()`` checks them.

        >>> import torch, torch.nn as nn, tridens as td
        >>> a = td.graph.trace(nn.Sequential(nn.Linear(4, 8)), torch.randn(1, 4))
        >>> b = td.graph.trace(nn.Sequential(nn.Linear(4, 8)), torch.randn(1, 4))
        >>> a.fingerprint() == b.fingerprint()  # other weights, same structure
        True
        """
        return prefix_fingerprint(self, self.output._fx)

    def num_params(self, trainable_only: bool = False) -> int:
        """Number of parameter elements the graph uses (shared ones counted once)."""
        return num_params(self, trainable_only)

    def flops(self) -> int:
        """Estimated floating point operations of one forward pass on the example inputs (see
        ``tridens.graph._flops`` for the counting rules). Per node in ``node.meta["tridens.flops"]``."""
        return flops(self)

    # ---- code generation and copies ------------------------------------------------------------
    def to_module(self) -> fx.GraphModule:
        """A new ``nn.Module`` (an fx ``GraphModule``) computing the graph; it shares the graph's
        submodules and weights (``graph.copy().to_module()`` for independent ones)."""
        gm = fx.GraphModule(self._root, copy.deepcopy(self._fx), class_name=self._name)
        gm.training = self._training
        return gm

    def copy(self) -> Graph:
        """An independent deep copy: modules and weights are copied, example inputs shared."""
        root = copy.deepcopy(self._root)
        new = Graph._create(root, copy.deepcopy(self._fx), self._example_inputs,
                            name=self._name, training=self._training)
        new._version = self._version
        new._shapes_version = self._shapes_version
        new._shape_error = self._shape_error
        return new

    # ---- printing ----------------------------------------------------------------------------
    def _format(self, fx_node: fx.Node) -> str:
        shape = None
        if self._shapes_version != self._version or self._example_inputs is None:
            shape = "?"
        return _meta.format_node(fx_node, self._root, shape)

    def __str__(self) -> str:
        error = None
        if self._example_inputs is not None:
            try:
                self._ensure_shapes()
            except InvalidSample as err:
                error = err
        args = ", ".join(f"%{n.name}" for n in self._fx.nodes if n.op == "placeholder")
        lines = [f"graph {self._name}({args}):"]
        lines += ["    " + _meta.format_node(n, self._root) for n in self._fx.nodes]
        if error is not None:
            lines.append("    # shapes do not fit: " + str(error).splitlines()[0])
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<tridens.graph.Graph of {self._name}: {len(self)} nodes>"

    # ---- editing -----------------------------------------------------------------------------
    def _edited(self) -> None:
        self._version += 1
        self.lint()

    def lint(self) -> None:
        """Check the graph's consistency (fx ``lint``: topological order, names, targets);
        raises :class:`~tridens.errors.GraphError`. Every edit runs it."""
        try:
            self._fx.lint()
        except Exception as err:
            raise GraphError(f"the graph of {self._name} is inconsistent: {err}") from err

    def _fx_of(self, node: Node) -> fx.Node:
        if not isinstance(node, Node):
            raise TypeError(f"expected a tridens.graph.Node, but got {type(node).__name__}")
        if node._graph is not self or node._fx.graph is not self._fx or node._fx._erased:
            raise GraphError(f"node %{node.name} does not belong to this graph (anymore)")
        return node._fx

    def _fresh_target(self, base: str) -> str:
        base = _snake(base.replace(".", "_"))
        candidate, i = base, 0
        while hasattr(self._root, candidate):
            i += 1
            candidate = f"{base}_{i}"
        return candidate

    def _add_module(self, module: nn.Module, base: str | None = None) -> str:
        if not isinstance(module, nn.Module):
            raise TypeError(f"expected an nn.Module, but got {type(module).__name__}")
        target = self._fresh_target(base or type(module).__name__)
        self._root.add_module(target, module)
        return target

    def _references(self, target: str, exclude: fx.Node | None = None) -> bool:
        for n in self._fx.nodes:
            if n is exclude or n.op not in ("call_module", "get_attr"):
                continue
            t = str(n.target)
            if t == target or t.startswith(target + ".") or target.startswith(t + "."):
                return True
        return False

    def _drop_if_unused(self, target: str) -> None:
        if self._references(target):
            return
        *prefix, field = target.split(".")
        owners: list[tuple[nn.Module, str]] = []
        obj: Any = self._root
        for atom in prefix:
            owners.append((obj, atom))
            obj = getattr(obj, atom)
        delattr(obj, field)
        for owner, atom in reversed(owners):  # remove the empty containers trace created
            child = getattr(owner, atom)
            if type(child) is nn.Module and not child._modules and not child._parameters and not child._buffers:
                delattr(owner, atom)
            else:
                break

    def _line(self, fx_node: fx.Node) -> str:
        return _meta.format_node(fx_node, self._root, "?")

    def _replace(self, fx_node: fx.Node, module: nn.Module) -> None:
        if fx_node.graph is not self._fx or fx_node._erased:
            raise GraphError(f"node %{fx_node.name} does not belong to this graph (anymore)")
        if not isinstance(module, nn.Module):
            raise TypeError(f"replace() needs an nn.Module, but got {type(module).__name__}")
        if fx_node.op == "call_module":
            old = str(fx_node.target)
            if self._references(old, exclude=fx_node):  # shared with another node: give this one its own
                fx_node.target = self._add_module(module, base=old)
            else:
                *prefix, field = old.split(".")
                owner = self._get(".".join(prefix)) if prefix else self._root
                setattr(owner, field, module)
        elif fx_node.op in ("call_function", "call_method"):
            inputs = []
            for arg in fx_node.args:
                inputs += _nodes_in(arg)
            for arg in fx_node.kwargs.values():
                inputs += _nodes_in(arg)
            target = self._add_module(module)
            fx_node.op = "call_module"
            fx_node.target = target
            fx_node.args = tuple(inputs)
            fx_node.kwargs = {}
        else:
            raise GraphError(f"cannot replace {self._line(fx_node)}: only call nodes can be replaced")
        fx_node.meta.pop(_meta.OPAQUE, None)
        fx_node.meta.pop(_meta.OPAQUE_REASON, None)
        self._edited()

    def insert_after(self, node: Node, module: nn.Module) -> Node:
        """Insert ``module`` after ``node``: the new node consumes node's output and every former
        user of node uses the new node instead.

        >>> import torch, torch.nn as nn, tridens as td
        >>> g = td.graph.trace(nn.Sequential(nn.Conv2d(1, 4, 3)), torch.randn(1, 1, 8, 8))
        >>> bn = g.insert_after(g.nodes(op_type=nn.Conv2d)[0], nn.BatchNorm2d(4))
        >>> bn.output_shape
        torch.Size([1, 4, 6, 6])
        """
        fx_node = self._fx_of(node)
        if fx_node.op == "output":
            raise GraphError(f"cannot insert after {self._line(fx_node)}: it is the output")
        target = self._add_module(module)
        with self._fx.inserting_after(fx_node):
            new = self._fx.call_module(target, (fx_node,))
        fx_node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        self._edited()
        return self._wrap(new)

    def insert_before(self, node: Node, module: nn.Module) -> Node:
        """Insert ``module`` before ``node``: the new node takes node's first input and node
        consumes the new node in that slot."""
        fx_node = self._fx_of(node)
        sources = [src for src, _ in node.inputs]
        if not sources:
            raise GraphError(f"cannot insert before {self._line(fx_node)}: it has no input")
        first = sources[0]._fx
        target = self._add_module(module)
        with self._fx.inserting_before(fx_node):
            new = self._fx.call_module(target, (first,))
        self._substitute(fx_node, 0, new)
        self._edited()
        return self._wrap(new)

    def insert_on_edge(self, src: Node, dst: Node, module: nn.Module, name: str | None = None) -> Node:
        """Insert ``module`` on the edge ``src -> dst``: the new node consumes src's output and dst
        reads the new node wherever it read src; src's other users are unchanged (Retiarii's
        ``insert_node_on_edge``). ``name`` names the new node and its module.

        >>> import torch, torch.nn as nn, tridens as td
        >>> g = td.graph.trace(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.randn(2, 4))
        >>> lin, relu = g.nodes(op_type=nn.Linear)[0], g.nodes(op_type=nn.ReLU)[0]
        >>> new = g.insert_on_edge(lin, relu, nn.Linear(8, 8), name="extra")
        >>> [n.name for n in g.nodes()], [s.name for s, _ in relu.inputs]
        (['input_1', '_0', 'extra', '_1', 'output'], ['extra'])
        """
        s, d = self._fx_of(src), self._fx_of(dst)
        if s not in d.all_input_nodes:
            raise GraphError(f"%{s.name} is not an input of {self._line(d)}: there is no edge to insert on")
        target = self._add_module(module, base=name)
        with self._fx.inserting_after(s):
            new = self._fx.create_node("call_module", target, (s,), {}, name=name)
        d.replace_input_with(s, new)
        self._edited()
        return self._wrap(new)

    def _substitute(self, fx_node: fx.Node, index: int, new: fx.Node) -> None:
        """Replace the ``index``-th node occurrence (in ``inputs`` order) of fx_node's arguments."""
        count = [0]

        def swap(n: fx.Node) -> fx.Node:
            i = count[0]
            count[0] += 1
            return new if i == index else n

        args = tuple(map_arg(a, swap) for a in fx_node.args)
        kwargs = {k: map_arg(v, swap) for k, v in fx_node.kwargs.items()}
        fx_node.args = args
        fx_node.kwargs = kwargs

    def remove(self, node: Node) -> None:
        """Remove ``node``; its users read node's first input instead. A module no other node
        uses leaves the graph's root too."""
        fx_node = self._fx_of(node)
        if fx_node.op in ("placeholder", "output"):
            raise GraphError(f"cannot remove {self._line(fx_node)}: it is a graph {fx_node.op}")
        if fx_node.users:
            sources = [src for src, _ in node.inputs]
            if not sources:
                raise GraphError(
                    f"cannot remove {self._line(fx_node)}: it has users "
                    f"({', '.join('%' + u.name for u in fx_node.users)}) but no input to rewire them to")
            fx_node.replace_all_uses_with(sources[0]._fx)
        self._fx.erase_node(fx_node)
        self._wrappers.pop(fx_node, None)
        if fx_node.op in ("call_module", "get_attr"):
            self._drop_if_unused(str(fx_node.target))
        self._edited()

    def add_node(self, op: nn.Module | Callable[..., Any], inputs: Sequence[Any] = (),
                 name: str | None = None) -> Node:
        """Add a node calling ``op`` (a module or a function) on ``inputs`` (nodes and constants,
        positionally), placed after its last input node. It has no users until you ``connect`` it.

        >>> import operator, torch, torch.nn as nn, tridens as td
        >>> g = td.graph.trace(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4))
        >>> x, lin = g.inputs[0], g.nodes(op_type=nn.Linear)[0]
        >>> add = g.add_node(operator.add, [lin, x], name="skip")
        >>> g.connect(add, g.output, slot=0)
        >>> add.output_shape
        torch.Size([2, 4])
        """
        args = tuple(self._fx_of(a) if isinstance(a, Node) else a for a in inputs)
        sources = [a for a in args if isinstance(a, fx.Node)]
        order = {n: i for i, n in enumerate(self._fx.nodes)}
        if sources:
            anchor: fx.Node | None = max(sources, key=order.__getitem__)
        else:
            placeholders = [n for n in self._fx.nodes if n.op == "placeholder"]
            anchor = placeholders[-1] if placeholders else None
        if isinstance(op, nn.Module):
            target: Any = self._add_module(op, base=name)
            opcode = "call_module"
        elif callable(op):
            target, opcode = op, "call_function"
        else:
            raise TypeError(f"add_node() needs an nn.Module or a function, but got {type(op).__name__}")
        if anchor is None:
            ctx = self._fx.inserting_before(next(iter(self._fx.nodes)))
        else:
            ctx = self._fx.inserting_after(anchor)
        with ctx:
            new = self._fx.create_node(opcode, target, args, {}, name=name)
        self._edited()
        return self._wrap(new)

    def connect(self, src: Node, dst: Node, slot: int | str | None = None) -> None:
        """Make ``src`` an input of ``dst``.

        ``slot`` an int: replace dst's positional argument at that index (``len(args)`` appends);
        a str: set that keyword argument; None: append -- to dst's list argument when it has one
        (``torch.cat([a, b])`` becomes ``torch.cat([a, b, src])``, the output tuple grows), else as
        a new positional argument. Nodes src depends on are moved before dst if needed; an edge
        that would close a cycle raises :class:`~tridens.errors.GraphError`.
        """
        s, d = self._fx_of(src), self._fx_of(dst)
        if d.op in ("placeholder", "get_attr"):
            raise GraphError(f"cannot connect into {self._line(d)}: a {d.op} takes no inputs")
        self._order_before(s, d)
        args = list(d.args)
        if isinstance(slot, str):
            if d.op == "output":
                raise GraphError(f"cannot connect into {self._line(d)} by keyword {slot!r}")
            kwargs = dict(d.kwargs)
            kwargs[slot] = s
            d.kwargs = kwargs
        elif slot is None:
            for i, a in enumerate(args):
                if isinstance(a, (list, tuple)) and _nodes_in(a):
                    args[i] = type(a)([*a, s])
                    break
            else:
                if d.op == "output":
                    args = [(args[0], s)] if args else [s]
                else:
                    args.append(s)
            d.args = tuple(args)
        else:
            if not 0 <= slot <= len(args) or (d.op == "output" and slot != 0):
                raise GraphError(
                    f"cannot connect %{s.name} into slot {slot} of {self._line(d)}: "
                    f"slot must be in [0, {len(args)}]")
            if slot == len(args):
                args.append(s)
            else:
                args[slot] = s
            d.args = tuple(args)
        self._edited()

    def _order_before(self, s: fx.Node, d: fx.Node) -> None:
        """Move s and the nodes it depends on that come after d to just before d."""
        order = {n: i for i, n in enumerate(self._fx.nodes)}
        if order[s] < order[d]:
            return
        pending, move, seen = [s], set(), set()
        while pending:
            n = pending.pop()
            if n is d:
                raise GraphError(f"connecting %{s.name} into %{d.name} would create a cycle: "
                                 f"%{s.name} depends on %{d.name}")
            if n in seen or order[n] < order[d]:
                continue
            seen.add(n)
            move.add(n)
            pending.extend(n.all_input_nodes)
        for n in sorted(move, key=order.__getitem__):
            if n.op == "placeholder":
                raise GraphError(f"cannot move graph input %{n.name} before %{d.name}")
            d.prepend(n)

    def disconnect(self, src: Node, dst: Node) -> None:
        """Remove ``src`` from ``dst``'s inputs: a positional argument (later ones shift), a keyword
        argument, or members of list/tuple arguments such as ``torch.cat``'s list."""
        s, d = self._fx_of(src), self._fx_of(dst)
        if s not in d.all_input_nodes:
            raise GraphError(f"%{s.name} is not an input of {self._line(d)}")

        def strip(a: Any) -> Any:
            if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
                return type(a)(strip(x) for x in a if x is not s)
            if isinstance(a, dict):
                return {k: strip(v) for k, v in a.items() if v is not s}
            if isinstance(a, slice) and s in (a.start, a.stop, a.step):
                raise GraphError(f"cannot disconnect %{s.name} from a slice in {self._line(d)}")
            return a

        if d.op == "output":
            if d.args and d.args[0] is s:
                raise GraphError(f"cannot disconnect %{s.name}: it is the graph's only output")
            d.args = tuple(strip(a) for a in d.args)
        else:
            d.args = tuple(strip(a) for a in d.args if a is not s)
            d.kwargs = {k: strip(v) for k, v in d.kwargs.items() if v is not s}
        self._edited()
