"""The super-graph's structure: which tensors and which nodes the children of one parent share,
its memory estimate, and the merged ``torch.fx`` module that computes every child's output per
batch (a prefix tree: a node computed once for the children that share it).
"""

from __future__ import annotations


import hashlib
import warnings
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..units import Job
from ..evaluators import SupervisedTrainer, TrainConfig
from ..graph import meta, trace
from ._cse import _optimizer_states
from ._prefix import _RANDOM_FUNCTIONS, _RANDOM_METHODS, _RANDOM_MODULES, _bytes, example_bytes, example_tensor
from ._inherit import _join

# ------------------------------------------------------------------------------------------------
# the super-graph: which tensors and which nodes the children share
# ------------------------------------------------------------------------------------------------
# Dropout is shared in a prefix (one mask for the children sharing it); other random ops branch.
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_DROPOUT_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                      torch.dropout}
_IN_PLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                       "ilshift", "irshift", "imatmul"}


def _slot(model: nn.Module, key: str) -> tuple[nn.Module, str, str] | None:
    """(owning module, attribute name, 'param'|'buffer') of a state_dict key, or None."""
    prefix, _, name = key.rpartition(".")
    try:
        module = model.get_submodule(prefix) if prefix else model
    except AttributeError:
        return None
    if name in module._parameters and module._parameters[name] is not None:
        return module, name, "param"
    if name in module._buffers and module._buffers[name] is not None:
        return module, name, "buffer"
    return None


def _tensor(slot: tuple[nn.Module, str, str]) -> torch.Tensor:
    module, name, kind = slot
    return module._parameters[name] if kind == "param" else module._buffers[name]  # type: ignore[return-value]


def _identities(jobs: Sequence[Job]) -> dict[int, dict[str, str]]:
    """``{trial id: {state_dict key: parent key}}``: the tensors each child may share with its
    siblings -- inherited from the same parent tensor, of the same kind (parameter or buffer),
    shape, dtype and device, and still equal to the first child's copy; one key per parent tensor
    per child (never two layers of one child)."""
    first: dict[str, tuple[torch.Tensor, str]] = {}
    out: dict[int, dict[str, str]] = {}
    for job in jobs:
        model = job.model
        assert isinstance(model, nn.Module)
        mine: dict[str, str] = {}
        seen: set[str] = set()
        for ck, pk in (job.trial.info.get("inherit") or {}).get("shared", {}).items():
            if pk in seen:
                continue
            slot = _slot(model, ck)
            if slot is None:
                continue
            tensor = _tensor(slot)
            ref = first.get(pk)
            if ref is None:
                first[pk] = (tensor, slot[2])
            else:
                owner, kind = ref
                if kind != slot[2] or owner.shape != tensor.shape or owner.dtype != tensor.dtype or \
                        owner.device != tensor.device or not torch.equal(owner.detach(), tensor.detach()):
                    continue
            seen.add(pk)
            mine[ck] = pk
        out[job.trial.id] = mine
    return out


def _branches(n: fx.Node, obj: Any) -> bool:
    """Whether the node draws random numbers other than dropout's (the graph branches there)."""
    if n.op == "call_module" and isinstance(obj, nn.Module):
        return any(isinstance(m, _RANDOM_MODULES) and not isinstance(m, _DROPOUT_MODULES) and m.training
                   for m in obj.modules())
    if n.op == "call_function":
        return n.target in _RANDOM_FUNCTIONS and n.target not in _DROPOUT_FUNCTIONS
    if n.op == "call_method":
        return n.target in _RANDOM_METHODS
    return False


def _in_place(n: fx.Node, obj: Any) -> bool:
    """Whether the node modifies its first input in place."""
    if n.op == "call_module":
        return bool(getattr(obj, "inplace", False))
    if n.op == "call_method":
        return str(n.target).endswith("_") and not str(n.target).startswith("_")
    if n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        return bool(n.kwargs.get("inplace")) or (name.endswith("_") and not name.startswith("_")) or \
            name in _IN_PLACE_OPERATORS
    return False


@dataclass
class _Child:
    """One child seen through the graph IR: the key of every node (equal keys in two children: the
    node is computed once for both) and its activation bytes at the batch size."""

    job: Job
    cfg: TrainConfig
    nodes: list[fx.Node] | None = None            # None: the whole model is one node
    keys: dict[fx.Node, str] = field(default_factory=dict)
    activations: dict[str, int] = field(default_factory=dict)   # node key -> output bytes
    targets: dict[str, str] = field(default_factory=dict)       # node key -> module/attribute path
    why: str = ""                                                # why the model is one node


def _analyse(job: Job, cfg: TrainConfig, example: Any, ident: Mapping[str, str]) -> _Child:
    """Trace the child (shapes on real examples) and key its nodes: a key hashes the node's
    structure (its prefix fingerprint), the identities of its tensors (the parent key of a shared
    one, the child's own otherwise) and its inputs' keys."""
    tid = job.trial.id
    model = job.model
    assert isinstance(model, nn.Module)
    child = _Child(job, cfg)
    if not example_tensor(example):  # the child still joins, as one node
        child.why = "its input is a structure of tensors, not one tensor"
        child.keys = {}
        return child
    scale = cfg.batch_size / max(len(example), 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # opaque modules were reported when the engine traced the trial
            graph = trace(model, (example.clone(),))
            graph.propagate_shapes()
    except Exception as err:  # the merge is an optimization: the child still joins, as one node
        child.why = f"tracing failed ({type(err).__name__})"
        child.keys = {}
        return child
    nodes = list(graph.fx_graph.nodes)
    if sum(1 for n in nodes if n.op == "placeholder") != 1:
        child.why = "the model takes several inputs"
        return child

    def identity(key: str) -> str:
        pk = ident.get(key)
        return f"parent:{pk}" if pk is not None else f"own:{tid}:{key}"

    flags = [(m, m.training) for m in model.modules()]
    model.train()  # the flags it trains with enter the keys
    try:
        for n in nodes:
            if n.op == "output":
                continue
            obj = graph._get(str(n.target)) if n.op in ("call_module", "get_attr") else None
            if n.op == "placeholder":
                key = "input"
            elif graph[n.name].opaque or _branches(n, obj):
                key = f"own:{tid}:{n.name}"
            else:
                parts = [graph[n.name].prefix_fingerprint()]
                if isinstance(obj, nn.Module):
                    target = str(n.target)
                    parts += [f"{name}={identity(_join(target, name))}"
                              for name, _ in chain(obj.named_parameters(), obj.named_buffers())]
                    parts.append("".join("T" if m.training else "E" for m in obj.modules()))
                elif isinstance(obj, torch.Tensor):
                    parts.append(identity(str(n.target)))
                parts += [child.keys[s] for s in n.all_input_nodes]
                key = hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()
            child.keys[n] = key
            if n.op != "placeholder":
                child.activations.setdefault(key, int(_bytes(n.meta.get(meta.SHAPE), n.meta.get(meta.DTYPE)) * scale))
            if obj is not None:
                child.targets[key] = str(n.target)
    finally:
        for m, flag in flags:
            m.training = flag
    child.nodes = nodes
    return child


@dataclass
class _Sharing:
    """What a set of children share: parameters and buffers by parent key -> the children tying
    them, and node keys -> the children computing that node together."""

    params: dict[str, list[int]]
    buffers: dict[str, list[int]]
    nodes: dict[str, list[int]]


def _sharing(children: Sequence[_Child], ident: Mapping[int, Mapping[str, str]]) -> _Sharing:
    nodes: dict[str, list[int]] = {}
    for c in children:
        for key in dict.fromkeys(c.keys.values()):
            if key != "input":
                nodes.setdefault(key, []).append(c.job.trial.id)
    nodes = {k: ids for k, ids in nodes.items() if len(ids) > 1}
    params: dict[str, list[int]] = {}
    for c in children:
        model = c.job.model
        assert isinstance(model, nn.Module)
        tid = c.job.trial.id
        names = {name for name, _ in model.named_parameters()}
        for ck, pk in ident[tid].items():
            if ck in names:
                params.setdefault(pk, []).append(tid)
    buffers: dict[str, list[int]] = {}
    by_id = {c.job.trial.id: c for c in children}
    for key, ids in nodes.items():
        for tid in ids:
            c = by_id[tid]
            target = c.targets.get(key)
            if target is None:
                continue
            model = c.job.model
            assert isinstance(model, nn.Module)
            try:
                buffer_names = [_join(target, name) for name, _ in model.get_submodule(target).named_buffers()]
            except AttributeError:  # a get_attr node of a tensor
                buffer_names = [target]
            for ck in buffer_names:
                shared_key = ident[tid].get(ck)
                if shared_key is not None and tid not in buffers.setdefault(shared_key, []):
                    buffers[shared_key].append(tid)
    return _Sharing({pk: ids for pk, ids in params.items() if len(ids) > 1},
                    {pk: ids for pk, ids in buffers.items() if len(ids) > 1}, nodes)


def supergraph_memory(children: Sequence[_Child], ident: Mapping[int, Mapping[str, str]],
                      batch_bytes: int = 0) -> int:
    """Estimated bytes of a super-graph of ``children``: each shared parameter once and each
    child's own, with their gradients and optimizer states; buffers (shared ones once); the
    activations of every merged node (all kept until the one backward; shapes from the graph IR
    at the batch size); and ``batch_bytes`` (the shared batches)."""
    share = _sharing(children, ident)
    counted: set[str] = set()
    total = 0
    for c in children:
        model = c.job.model
        assert isinstance(model, nn.Module)
        tid = c.job.trial.id
        states = _optimizer_states(c.cfg)
        for kind, items, tied in (("p", model.named_parameters(), share.params), ("b", model.named_buffers(), share.buffers)):
            for name, t in items:
                pk = ident[tid].get(name)
                if pk is not None and tid in tied.get(pk, ()):
                    if (kind, pk) in counted:
                        continue
                    counted.add((kind, pk))  # type: ignore[arg-type]
                size = t.numel() * t.element_size()
                total += size * (2 + states) if kind == "p" and t.requires_grad else size
    activations: dict[str, int] = {}
    for c in children:
        for key, size in c.activations.items():
            activations.setdefault(key, size)
        if c.nodes is None:  # not traced: its parameters' size stands in for its activations
            model = c.job.model
            assert isinstance(model, nn.Module)
            activations[f"whole:{c.job.trial.id}"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(activations.values()) + batch_bytes


def _batch_bytes(cfg: TrainConfig, example: Any) -> int:
    """The shared batches (training batch, its guard copy, a validation batch), as the CSE planner counts them."""
    return 3 * example_bytes(example) * max(cfg.batch_size, 256)


# ------------------------------------------------------------------------------------------------
# the merged module
# ------------------------------------------------------------------------------------------------
class _Streams(nn.Module):
    """A node of the merged graph: ``streams(i)`` runs what follows in child ``i``'s own random
    stream (its trainer's), ``streams(-1)`` gives the caller's back."""

    def __init__(self, trainers: Sequence[SupervisedTrainer]):
        super().__init__()
        self.trainers = list(trainers)
        self._active: Any = None

    def forward(self, index: int) -> None:
        self.close()
        if index >= 0:
            context = self.trainers[index]._random_stream()
            context.__enter__()
            self._active = context

    def close(self) -> None:
        context, self._active = self._active, None
        if context is not None:
            context.__exit__(None, None, None)


def _merge(children: Sequence[_Child], trainers: Sequence[SupervisedTrainer]) -> tuple[fx.GraphModule, int]:
    """One ``fx.GraphModule`` mapping the batch to the tuple of the children's outputs, each node
    key computed once (in the first child that has it); returns it and its number of nodes."""
    root = nn.Module()
    root.streams = _Streams(trainers)
    users: dict[str, set[int]] = {}
    for c in children:
        for key in c.keys.values():
            users.setdefault(key, set()).add(c.job.trial.id)
    g = fx.Graph()
    x = g.placeholder("x")
    memo: dict[str, fx.Node] = {"input": x}
    outputs: list[Any] = []
    computed = 0
    for i, c in enumerate(children):
        model = c.job.model
        assert isinstance(model, nn.Module)
        root.add_module(f"c{i}", model)
        g.call_module("streams", (i,))
        if c.nodes is None:
            outputs.append(g.call_module(f"c{i}", (x,)))
            computed += 1
            continue
        env: dict[fx.Node, Any] = {}
        for n in c.nodes:
            if n.op == "output":
                outputs.append(fx.map_arg(n.args[0], lambda a: env[a]))
                continue
            key = c.keys[n]
            if key in memo:
                env[n] = memo[key]
                continue
            override: dict[fx.Node, fx.Node] = {}
            obj = None
            if n.op == "call_module":
                obj = model.get_submodule(str(n.target)) if n.target else model
            if n.all_input_nodes and _in_place(n, obj):
                source = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else n.all_input_nodes[0]
                if users.get(c.keys[source]) != users.get(key):  # a branch must not modify what others read
                    override[source] = g.call_method("clone", (env[source],))
            new = g.node_copy(n, lambda a: override.get(a, env[a]))
            if new.op in ("call_module", "get_attr"):
                new.target = f"c{i}.{n.target}" if n.target else f"c{i}"
            memo[key] = env[n] = new
            computed += 1
    g.call_module("streams", (-1,))
    g.output(tuple(outputs))
    return fx.GraphModule(root, g, class_name="SuperGraph"), computed
