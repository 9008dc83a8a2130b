"""Weight inheritance and the super-graph (Retiarii's third cross-model optimization, issue 5).

**Inheritance.** A child of regularized evolution (``RegularizedEvolution(inherit_weights=True)``,
which names each child's parent in ``TrialGroup.parents``) starts from its parent's trained
weights for the layers they share. Layers are matched through the graph IR with the ModelKeeper
alignment of :mod:`tridens.warmup` (:func:`~tridens.warmup.describe` + :func:`~tridens.warmup.align`);
a matched pair is *shared* when both nodes have the same type and identical state shapes, and a
shared layer's tensors are copied exactly (parameters and buffers, e.g. BatchNorm statistics).
Layers that differ keep the child's own initialisation: no slicing or Net2Net widening here,
because only identical layers can be one tensor in a super-graph. The engine calls
:func:`inherit_from_trial` while it materializes a child (the parent's checkpoint is read from the
store); what was inherited is recorded in ``trial.info["inherit"]``.

**Super-graph.** Children of one parent in one TrialGroup (one per architecture, with the same
optimizer kind, momentum and weight decay) train merged in a :class:`SuperGraphUnit`, weight
sharing as in Retiarii's super-graph and in one-shot NAS (ENAS/SPOS):

* *Stored once.* Every parameter two or more children inherited from the same parent tensor is
  ONE ``nn.Parameter`` held by all their modules.
* *Computed once.* The children read the same batch and hold the same tensors up to their first
  mutated layer, so their graphs (``torch.fx`` through :func:`tridens.graph.trace`) are merged
  into a prefix tree: a node is computed once for the children whose nodes have the same
  structure (the IR's prefix fingerprint), the same shared tensors and the same inputs, and the
  graph branches where they differ. One ``torch.fx`` module computes every child's output per
  batch; one ``backward`` runs over the sum of the children's losses.
* *Stepped once.* A shared parameter takes ONE optimizer step per batch, from the mean of the
  gradients of the children that share it (the sum's gradient divided by their number), with one
  optimizer state, at the mean of those children's learning rates (their schedules at the
  step); each child's own tensors are stepped by its own optimizer at its own learning rate.
* *Buffers* (BatchNorm statistics) are stored once only for nodes computed once (the children
  feed them the same activations). A shared layer in a branch (same parameters, other inputs)
  keeps one copy of its statistics per child, each starting from the parent's: statistics of
  one child's activations would be wrong for another's.
* *Randomness.* Each child's nodes run in its trainer's own random stream; a node computed once
  runs in the stream of the first child (trial order) that has it. So dropout in a shared prefix
  draws ONE mask, used by every child sharing that prefix (what one forward of a super-graph
  does); dropout in a child's branch draws its own. Other random ops (``torch.rand``, RReLU, ...)
  are never shared: the graph branches there.

Per-trial guarantees: metrics for every child every epoch. A child whose loss turns NaN/inf fails
alone with :class:`~tridens.evaluators.NonFiniteLoss`: its loss is left out of that step's sum
(the others' step is what it would be had the child left just before) and it leaves the unit. An
exception in the merged forward is attributed to the children whose own model raises on that
batch. A child that is stopped (or finishes) leaves at the end of an epoch; the others keep their
optimizer states, data order and shared tensors. Each child's checkpoint is its whole model's
``state_dict`` (the shared tensors' values at that moment).

**Memory.** :func:`supergraph_memory`: the shared tensors once, each child's own, gradients and
optimizer states, the activations of every merged node (all kept until the one backward: shapes
from the graph IR at the batch size) and the shared batches. :func:`plan_supergraph` keeps each
unit under ``max_unit_memory`` (the experiment's bound, as for the other optimizations) and
splits a group that exceeds it; a child left alone trains apart (from the parent's weights).

The merge and the tying are hand-written over ``torch.fx`` (node copying into one graph, module
attribute replacement): no library merges separately built models into a prefix tree or ties
weights across them. Measured in BENCHMARKS.md ("Weight inheritance").

>>> td.Experiment(space, evaluator, td.strategy.RegularizedEvolution(inherit_weights=True))  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..units import ExecutionUnit, Job, resolve_max_unit_memory
from ..evaluators._base import StepwiseEvaluator
from ..evaluators._errors import NonFiniteLoss
from ..evaluators._supervised import SupervisedTrainer, TrainConfig, ValidationSums, SupervisedEvaluator
from ..graph import meta, trace
from ._cse import (BATCH, PipelineMember, SharedPipelineUnit, _RANDOM_FUNCTIONS, _RANDOM_METHODS, _RANDOM_MODULES,
                   _bytes, _example_batch, _mib, _optimizer_states, _pipeline_key)

__all__ = ["ENABLED", "shared_tensors", "inherit", "inherit_from_trial", "SuperGraphUnit", "SuperGraphMember",
           "plan_supergraph", "supergraph_memory"]

log = logging.getLogger("tridens")

#: Whether the planner merges children of one parent into a super-graph (the benchmark turns it
#: off to compare with children trained apart, each from the parent's checkpoint).
ENABLED = True

_DESCRIPTIONS: "OrderedDict[tuple[str, int], dict[str, Any]]" = OrderedDict()  # parents' IR descriptions
_CACHE_SIZE = 64


def _join(prefix: str | None, rel: str) -> str:
    return f"{prefix}.{rel}" if prefix else rel


def shared_tensors(child_desc: Mapping[str, Any], parent_desc: Mapping[str, Any]) -> dict[str, str]:
    """``{child state_dict key: parent state_dict key}`` for every tensor of the layers the child
    shares exactly with the parent: nodes paired by :func:`tridens.warmup.align` with the same
    type and identical state shapes (descriptions from :func:`tridens.warmup.describe`).

    >>> from tridens.warmup import describe
    >>> shared_tensors(describe(child, x), describe(parent, x))     # doctest: +SKIP
    {'conv.weight': 'conv.weight', 'conv.bias': 'conv.bias', ...}
    """
    from ..warmup import align

    cn, pn = child_desc["nodes"], parent_desc["nodes"]
    if not cn or not pn:
        return {}
    _score, pairs = align(dict(child_desc), dict(parent_desc))
    out: dict[str, str] = {}
    for ci, pi in pairs:
        c, p = cn[ci], pn[pi]
        if c.get("t") != p.get("t"):
            continue
        if c.get("k") is not None and p.get("k") is not None and c.get("s") and c["s"] == p.get("s"):
            for rel in c["s"]:
                out.setdefault(_join(c["k"], rel), _join(p["k"], rel))
        elif c.get("a") is not None and p.get("a") is not None and c.get("p") and c.get("p") == p.get("p"):
            out.setdefault(c["a"], p["a"])
    return out


def inherit(model: nn.Module, parent_state: Mapping[str, torch.Tensor], child_desc: Mapping[str, Any],
            parent_desc: Mapping[str, Any]) -> dict[str, Any]:
    """Copy the parent's tensors of the shared layers into ``model`` (in place, exact) and say what
    was inherited: ``tensors``, ``elements`` (floating-point elements copied), ``fraction`` (of the
    child's floating-point elements) and ``shared`` (child key -> parent key)."""
    state = model.state_dict(keep_vars=True)
    copied: dict[str, str] = {}
    with torch.no_grad():
        for ck, pk in shared_tensors(child_desc, parent_desc).items():
            target, source = state.get(ck), parent_state.get(pk)
            if target is None or source is None or tuple(target.shape) != tuple(source.shape):
                continue
            if target.dtype != source.dtype and not (target.is_floating_point() and source.is_floating_point()):
                continue
            target.copy_(source.to(device=target.device, dtype=target.dtype))
            copied[ck] = pk
    total = sum(int(t.numel()) for t in state.values() if t.is_floating_point())
    elements = sum(int(state[k].numel()) for k in copied if state[k].is_floating_point())
    return {"tensors": len(copied), "elements": elements, "fraction": (elements / total) if total else 0.0,
            "shared": copied}


def _describe(model: nn.Module, inputs: Any) -> dict[str, Any]:
    from ..warmup import describe

    on_meta = any(p.is_meta for p in model.parameters())
    if inputs is not None and on_meta:
        inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return describe(model, inputs)


def _parent_description(store_path: str, space: Any, parent: Any) -> dict[str, Any]:
    """The parent's IR description, from its structure built on the meta device (no weights
    initialised); cached per (store, trial)."""
    key = (store_path, parent.id)
    if key in _DESCRIPTIONS:
        _DESCRIPTIONS.move_to_end(key)
        return _DESCRIPTIONS[key]
    structure = space.freeze(space.restrict(parent.sample), check=False, device="meta")
    desc = _describe(structure, space.example_inputs)
    _DESCRIPTIONS[key] = desc
    while len(_DESCRIPTIONS) > _CACHE_SIZE:
        _DESCRIPTIONS.popitem(last=False)
    return desc


def inherit_from_trial(store: Any, space: Any, trial: Any, model: nn.Module) -> dict[str, Any]:
    """Load the trained weights of ``trial.parent`` (its checkpoint in ``store``) into ``model``
    for the layers they share; returns the record kept in ``trial.info["inherit"]``. Never raises:
    a parent without a checkpoint, or a model that cannot be matched, leaves ``model`` as
    initialised and the record says why (``reason``). ``seconds`` is the time it took. The torch
    random state is left untouched."""
    info: dict[str, Any] = {"parent": trial.parent}
    rng = torch.get_rng_state()
    t0 = time.perf_counter()
    try:
        parent = store.trial(trial.parent)
        if parent.checkpoint is None:
            info["reason"] = f"parent trial {parent.id} has no checkpoint ({parent.status.value})"
            return info
        parent_state = store.load_checkpoint(parent.checkpoint)
        parent_desc = _parent_description(str(store.path), space, parent)
        child_desc = _describe(model, space.example_inputs)
        if child_desc.get("opaque") or parent_desc.get("opaque"):
            # an opaque node is matched whole: still exact, usually all or nothing
            info["opaque"] = child_desc.get("opaque") or parent_desc.get("opaque")
        info.update(inherit(model, parent_state, child_desc, parent_desc))
    except Exception as err:  # inheritance is a head start: the child's own init is always valid
        info["reason"] = f"{type(err).__name__}: {err}"
    finally:
        torch.set_rng_state(rng)
        info["seconds"] = time.perf_counter() - t0  # checkpoint read + matching + copy
    if "reason" in info:
        log.info("trial %s: nothing inherited from trial %s (%s)", trial.id, trial.parent, info["reason"])
    return info


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


def _analyse(job: Job, cfg: TrainConfig, example: torch.Tensor, ident: Mapping[str, str]) -> _Child:
    """Trace the child (shapes on real examples) and key its nodes: a key hashes the node's
    structure (its prefix fingerprint), the identities of its tensors (the parent key of a shared
    one, the child's own otherwise) and its inputs' keys."""
    tid = job.trial.id
    model = job.model
    assert isinstance(model, nn.Module)
    child = _Child(job, cfg)
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
                names = [_join(target, name) for name, _ in model.get_submodule(target).named_buffers()]
            except AttributeError:  # a get_attr node of a tensor
                names = [target]
            for ck in names:
                pk = ident[tid].get(ck)
                if pk is not None and tid not in buffers.setdefault(pk, []):
                    buffers[pk].append(tid)
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


def _batch_bytes(cfg: TrainConfig, example: torch.Tensor) -> int:
    """The shared batches (training batch, its guard copy, a validation batch), as the CSE planner counts them."""
    return 3 * example[:1].numel() * example.element_size() * max(cfg.batch_size, 256)


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


# ------------------------------------------------------------------------------------------------
# the member and the unit
# ------------------------------------------------------------------------------------------------
class SuperGraphMember(PipelineMember):
    """The children of a super-graph as one member of a shared pipeline: per batch one forward of
    the merged module, one backward over the sum of the children's (finite) losses, one step of
    each shared parameter (mean gradient of its users) and of each child's own parameters."""

    def __init__(self, children: Sequence[_Child], trainers: Mapping[int, SupervisedTrainer],
                 ident: Mapping[int, Mapping[str, str]], share: _Sharing):
        self.children = {c.job.trial.id: c for c in children}
        self.trainers = dict(trainers)
        self._ids = list(self.children)
        self.shared: dict[str, tuple[torch.Tensor, set[int]]] = {}
        for pk, ids in share.params.items():
            ck = next(k for k, p in ident[ids[0]].items() if p == pk)
            model = self.children[ids[0]].job.model
            assert isinstance(model, nn.Module)
            slot = _slot(model, ck)
            if slot is not None:
                self.shared[pk] = (_tensor(slot), set(ids))
        shared_ids = {id(p) for p, _ in self.shared.values()}
        self.own: dict[int, torch.optim.Optimizer | None] = {}
        for tid, trainer in self.trainers.items():
            own = [p for p in trainer.model.parameters() if id(p) not in shared_ids]
            self.own[tid] = trainer.config.make_optimizer(own) if own else None
            if self.own[tid] is not None:
                trainer.optimizer = self.own[tid]  # type: ignore[assignment]  # what its trainer steps
        self.config = next(iter(self.trainers.values())).config
        self.shared_optimizer: torch.optim.Optimizer | None = None
        self._groups: list[tuple[frozenset[int], dict[str, Any]]] = []
        self._regroup()
        self._module: fx.GraphModule | None = None
        self._module_ids: tuple[int, ...] = ()
        self.nodes = 0                       # nodes of the merged module now
        self.child_nodes = 0                 # nodes of the children's own graphs, summed
        self.forwards = 0                    # merged forward passes (training and validation)
        self.errors: dict[int, BaseException] = {}
        self._epoch_ids: list[int] = []
        self._totals: dict[int, list[float]] = {}
        self._val: dict[int, ValidationSums] = {}
        self._flags: list[tuple[nn.Module, bool]] = []

    # -- bookkeeping ----------------------------------------------------------------------------
    def _regroup(self) -> None:
        """The shared optimizer: one param group per set of users (its lr is their mean); the
        optimizer state of every parameter kept across regroupings."""
        groups: dict[frozenset[int], list[torch.Tensor]] = {}
        for p, users in self.shared.values():
            live = frozenset(users & set(self._ids))
            if live:
                groups.setdefault(live, []).append(p)
        old = self.shared_optimizer
        if not groups:
            self.shared_optimizer, self._groups = None, []
            return
        optimizer = self.config.make_optimizer([{"params": ps} for ps in groups.values()])
        if old is not None:
            for p in chain.from_iterable(groups.values()):
                if p in old.state:
                    optimizer.state[p] = old.state[p]
        self.shared_optimizer = optimizer
        self._groups = list(zip(groups, optimizer.param_groups))

    def _merged(self, ids: Sequence[int]) -> fx.GraphModule:
        if self._module is None or self._module_ids != tuple(ids):
            children = [self.children[t] for t in ids]
            self._module, self.nodes = _merge(children, [self.trainers[t] for t in ids])
            self.child_nodes = sum(1 if c.nodes is None else sum(1 for n in c.nodes if n.op not in ("placeholder", "output"))
                                   for c in children)
            self._module_ids = tuple(ids)
        return self._module

    def _forward(self, ids: Sequence[int], x: Any) -> tuple[Any, ...]:
        module = self._merged(ids)
        self.forwards += 1
        try:
            return module(x)
        finally:
            module.streams.close()

    def _attribute(self, err: BaseException, ids: Sequence[int], x: Any) -> None:
        """The merged forward raised: fail the children whose own model raises on this batch (all
        of them when none does alone). Buffers and random states are left as they were."""
        culprits: dict[int, BaseException] = {}
        for tid in ids:
            model = self.children[tid].job.model
            assert isinstance(model, nn.Module)
            saved = [(b, b.detach().clone()) for b in model.buffers()]
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    model(x)
            except Exception as own:
                culprits[tid] = own
            finally:
                with torch.no_grad():
                    for b, value in saved:
                        b.copy_(value)
        for tid in ids:
            if not culprits or tid in culprits:
                self.errors[tid] = culprits.get(tid, err)

    # -- the PipelineMember protocol ---------------------------------------------------------------
    def trial_ids(self) -> list[int]:
        return list(self._ids)

    def limit(self, trial_id: int) -> int:
        trainer = self.trainers[trial_id]
        steps = self.children[trial_id].job.max_steps
        return trainer.epochs if steps is None else min(trainer.epochs, steps)

    def epoch(self, trial_id: int) -> int:
        return self.trainers[trial_id].epoch

    def begin_epoch(self) -> None:
        self._epoch_ids = [t for t in self._ids if t not in self.errors and self.epoch(t) < self.limit(t)]
        self._totals = {t: [0.0, 0] for t in self._epoch_ids}
        for tid in self._epoch_ids:
            try:
                self.trainers[tid].begin_epoch()
            except Exception as err:
                self.errors[tid] = err

    def train_batch(self, x: Any, y: torch.Tensor, batch: int) -> None:
        ids = [t for t in self._epoch_ids if t not in self.errors]
        if not ids:
            return
        lrs = {t: self.trainers[t].config.lr_at(self.trainers[t].step) for t in ids}
        for t in ids:
            optimizer = self.own[t]
            if optimizer is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lrs[t]
                optimizer.zero_grad(set_to_none=True)
        for p, _users in self.shared.values():
            p.grad = None
        try:
            outputs = self._forward(ids, x)
            losses = [self.trainers[t].config.loss(out, y) for t, out in zip(ids, outputs)]
            values = torch.stack([loss.detach().float().reshape(()) for loss in losses]).tolist()
        except Exception as err:
            self._attribute(err, ids, x)
            return
        included: list[int] = []
        total: torch.Tensor | None = None
        for t, loss, value in zip(ids, losses, values):
            if math.isfinite(value):
                included.append(t)
                total = loss if total is None else total + loss
                self._totals[t][0] += value * len(y)
                self._totals[t][1] += len(y)
            else:  # this child alone fails; its loss stays out of the step
                trainer = self.trainers[t]
                self.errors[t] = NonFiniteLoss.at(trainer.owner, value, epoch=trainer.epoch, batch=batch,
                                                  step=trainer.step, lr=lrs[t])
        if total is None:
            return
        try:
            total.backward()
        except Exception as err:
            for t in included:
                self.errors[t] = err
            return
        live = set(included)
        for p, users in self.shared.values():
            n = len(users & live)
            if p.grad is not None and n != 1:
                if n == 0:
                    p.grad = None
                else:
                    p.grad.div_(n)  # the mean of the users' gradients
        for t in included:
            optimizer = self.own[t]
            if optimizer is not None:
                optimizer.step()
            self.trainers[t].step += 1
        if self.shared_optimizer is not None:
            for users, group in self._groups:
                present = sorted(users & live)
                if present:
                    group["lr"] = sum(lrs[t] for t in present) / len(present)
            self.shared_optimizer.step()

    def end_epoch(self) -> dict[int, dict[str, float] | BaseException]:
        out: dict[int, dict[str, float] | BaseException] = {}
        for t in self._epoch_ids:
            if t in self.errors:
                out[t] = self.errors[t]
                continue
            total, count = self._totals[t]
            try:
                out[t] = self.trainers[t].end_epoch(total / count)
            except Exception as err:
                self.errors[t] = out[t] = err
        return out

    def begin_validation(self) -> None:
        ids = [t for t in self._epoch_ids if t not in self.errors]
        self._flags = [(m, m.training) for t in ids for m in self.trainers[t].model.modules()]
        for t in ids:
            self.trainers[t].model.eval()
        self._val = {t: ValidationSums(self.trainers[t].config) for t in ids}

    @torch.no_grad()
    def validate_batch(self, x: Any, y: torch.Tensor) -> None:
        ids = [t for t in self._val if t not in self.errors]
        if not ids:
            return
        try:
            outputs = self._forward(ids, x)
        except Exception as err:
            self._attribute(err, ids, x)
            return
        for t, out in zip(ids, outputs):
            try:
                self._val[t].add(out, y)
            except Exception as err:
                self.errors[t] = err

    def end_validation(self) -> dict[int, dict[str, float] | BaseException]:
        for m, flag in self._flags:
            m.training = flag
        self._flags = []
        out: dict[int, dict[str, float] | BaseException] = {}
        for t in self._epoch_ids:
            if t in self.errors:
                out[t] = self.errors[t]
            elif t in self._val:
                out[t] = self._val[t].result()
        self._val = {}
        return out

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        model = self.children[trial_id].job.model
        assert isinstance(model, nn.Module)
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def leave(self, trial_id: int) -> None:
        if trial_id not in self.children:
            return
        self._ids.remove(trial_id)
        del self.children[trial_id], self.trainers[trial_id], self.own[trial_id]
        self.errors.pop(trial_id, None)
        for _p, users in self.shared.values():
            users.discard(trial_id)
        self.shared = {pk: (p, users) for pk, (p, users) in self.shared.items() if users}
        self._regroup()
        self._module, self._module_ids = None, ()


def _tie(children: Sequence[_Child], ident: Mapping[int, Mapping[str, str]], share: _Sharing) -> int:
    """Make every shared parameter and buffer ONE tensor held by all the children sharing it (the
    first child's object). Returns the number of elements no longer duplicated."""
    by_id = {c.job.trial.id: c for c in children}
    saved = 0
    for tied, kind in ((share.params, "param"), (share.buffers, "buffer")):
        for pk, ids in tied.items():
            owner: torch.Tensor | None = None
            for tid in ids:
                model = by_id[tid].job.model
                assert isinstance(model, nn.Module)
                ck = next(k for k, p in ident[tid].items() if p == pk)
                slot = _slot(model, ck)
                if slot is None or slot[2] != kind:
                    continue
                if owner is None:
                    owner = _tensor(slot)
                    continue
                module, name, _ = slot
                if kind == "param":
                    module._parameters[name] = owner  # type: ignore[assignment]
                else:
                    module._buffers[name] = owner
                saved += int(owner.numel())
    return saved


class SuperGraphUnit(SharedPipelineUnit):
    """Children of one parent trained merged (see the module docstring): the tensors they
    inherited from the same parent tensor stored once, the nodes they compute alike computed once
    per batch, one backward, one step per shared tensor; one data pipeline; per-trial metrics,
    stops and failures as in any unit. ``memory`` is :func:`supergraph_memory`'s estimate.

    >>> unit = SuperGraphUnit(jobs, evaluator)          # doctest: +SKIP
    >>> unit.jobs[a].model.stem.weight is unit.jobs[b].model.stem.weight      # doctest: +SKIP
    True
    """

    kind = "supergraph"

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, *, reason: str = "",
                 memory: int | None = None, _children: Sequence[_Child] | None = None):
        assert isinstance(evaluator, SupervisedEvaluator), "the super-graph trains the declarative supervised evaluators"
        trainers: dict[int, SupervisedTrainer] = {}
        errors: dict[int, BaseException] = {}
        for job in jobs:
            try:  # built first: moving a model to its device may replace its buffers
                trainers[job.trial.id] = evaluator.trainer(job.model, job.trial.sample, job.trial.seed)
            except Exception as err:  # reported as the trial's failure at its first epoch
                errors[job.trial.id] = err
        ok = [job for job in jobs if job.trial.id in trainers]
        ident = _identities(ok)
        known = {c.job.trial.id: c for c in (_children or ())}
        example: torch.Tensor | None = None
        children: list[_Child] = []
        for job in ok:
            child = known.get(job.trial.id)
            if child is None:
                cfg = trainers[job.trial.id].config
                if example is None:
                    example = _example_batch(cfg).to(cfg.device)
                child = _analyse(job, cfg, example, ident[job.trial.id])
            children.append(child)
        share = _sharing(children, ident)
        self.saved_elements = _tie(children, ident, share)
        self.shared = {pk: list(ids) for pk, ids in {**share.buffers, **share.params}.items()}
        parents = {(job.trial.info.get("inherit") or {}).get("parent") for job in jobs}
        self.parent = next(iter(parents)) if len(parents) == 1 else None
        member = SuperGraphMember(children, trainers, ident, share)
        if children:
            member._merged(member.trial_ids())
        for job in ok:
            mine = [pk for pk, ids in self.shared.items() if job.trial.id in ids]
            job.trial.info.setdefault("inherit", {})["merged"] = {
                "unit": [j.trial.id for j in jobs], "tensors": len(mine), "nodes": [member.nodes, member.child_nodes]}
        if memory is None and children:
            memory = supergraph_memory(children, ident, _batch_bytes(children[0].cfg, _example_batch(children[0].cfg)))
        if not reason:
            reason = (f"children of trial {self.parent}: {len(self.shared)} inherited tensor(s) stored once "
                      f"({self.saved_elements} elements not duplicated); {member.nodes} nodes per batch for the "
                      f"children's {member.child_nodes} (shared prefixes computed once); one backward, one step "
                      f"per shared tensor")
            if memory is not None:
                reason += f"; memory estimate {_mib(memory)}"
        super().__init__(jobs, evaluator, members=[member] if children else [], reason=reason, memory=memory)
        self.errors.update(errors)
        self.member = member


# ------------------------------------------------------------------------------------------------
# the planner
# ------------------------------------------------------------------------------------------------
def plan_supergraph(jobs: Sequence[Job], evaluator: StepwiseEvaluator, *,
                    max_unit_memory: int | str | None = None) -> tuple[list[ExecutionUnit], list[Job]]:
    """Merge the children of one parent (``trial.info["inherit"]``) that read the same data
    pipeline, use the same optimizer kind, momentum and weight decay (their shared tensors take
    one optimizer's steps) and share inherited tensors with each other into
    :class:`SuperGraphUnit` s, each under ``max_unit_memory`` (bytes or e.g. ``"2GiB"``; default:
    the experiment's bound, :func:`tridens.units.resolve_max_unit_memory`): a group
    over it is split, in trial order. Return the units and the jobs left for the other
    optimizations. One child per architecture (graph fingerprint) joins a super-graph: siblings
    of the same architecture -- a mutation of the learning rate only -- would share all their
    inherited layers and hide the hyperparameter's effect, so the others train apart (each still
    from the parent's weights). Only the declarative supervised evaluators are merged (the engine
    owns their training loop)."""
    if not ENABLED or not isinstance(evaluator, SupervisedEvaluator):
        return [], list(jobs)
    groups: dict[tuple[Any, ...], list[tuple[Job, TrainConfig]]] = {}
    for job in jobs:
        record = job.trial.info.get("inherit") or {}
        if not isinstance(job.model, nn.Module) or not record.get("shared"):
            continue
        try:
            cfg = evaluator.config(job.trial.sample)
        except Exception:  # the separate unit reports it as the trial's failure
            continue
        key = (record.get("parent"), _pipeline_key(cfg, job.trial.seed), cfg.optimizer, cfg.momentum, cfg.weight_decay)
        groups.setdefault(key, []).append((job, cfg))
    units: list[ExecutionUnit] = []
    taken: set[int] = set()
    for (parent, *_rest), candidates in groups.items():
        group: list[tuple[Job, TrainConfig]] = []
        architectures: dict[str, int] = {}
        for job, cfg in candidates:
            fingerprint = job.trial.fingerprint
            if fingerprint is not None and fingerprint in architectures:
                # Tied to a sibling of the same architecture it would train the same inherited
                # tensors: its own hyperparameters could no longer be told apart. It trains apart.
                log.info("supergraph: trial %d has the architecture of trial %d: trained apart from the "
                         "super-graph (it still starts from trial %s's weights)",
                         job.trial.id, architectures[fingerprint], parent)
                continue
            if fingerprint is not None:
                architectures[fingerprint] = job.trial.id
            group.append((job, cfg))
        if len(group) < 2:
            continue
        ident = _identities([job for job, _ in group])
        counts: dict[str, int] = {}
        for mapping in ident.values():
            for pk in mapping.values():
                counts[pk] = counts.get(pk, 0) + 1
        if not any(n > 1 for n in counts.values()):
            log.info("supergraph: the children %s of trial %s share no inherited layer with each other",
                     [job.trial.id for job, _ in group], parent)
            continue
        cfg0 = group[0][1]
        example = _example_batch(cfg0)
        batch = _batch_bytes(cfg0, example)
        children = [_analyse(job, cfg, example, ident[job.trial.id]) for job, cfg in group]
        limit = resolve_max_unit_memory(max_unit_memory, cfg0.device)
        chunks: list[list[_Child]] = []
        for child in children:  # fill units in trial order, each under the bound
            if chunks and supergraph_memory(chunks[-1] + [child], ident, batch) <= limit:
                chunks[-1].append(child)
            else:
                chunks.append([child])
        for chunk in chunks:
            ids = [c.job.trial.id for c in chunk]
            share = _sharing(chunk, ident) if len(chunk) > 1 else None
            if share is None or not (share.params or share.buffers):
                if len(chunks) > 1:
                    log.info("supergraph: trials %s of trial %s's children train apart: with the next child the "
                             "super-graph would exceed max_unit_memory (%s)", ids, parent, _mib(limit))
                continue
            memory = supergraph_memory(chunk, ident, batch)
            unit = SuperGraphUnit([c.job for c in chunk], evaluator, memory=memory, _children=chunk)
            unit.reason += f", max_unit_memory {_mib(limit)}" + (
                f" (the group of {len(children)} children is split into {len(chunks)} parts)" if len(chunks) > 1 else "")
            units.append(unit)
            taken.update(ids)
    return units, [job for job in jobs if job.trial.id not in taken]
