"""Finding a frozen prefix that several models share: the graph IR's prefix fingerprints, weights
hashed, no random op, and a split (prefix + suffix with ``torch.fx``) checked on real data in
training and in evaluation mode before it is used.
"""

from __future__ import annotations


import hashlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import default_collate

from ..units import Job
from ..evaluators import TrainConfig
from ..graph import Graph, trace
from ..graph import meta
from ._pipeline import BATCH, SharedPrefix

#: A shared frozen prefix is used only when it holds at least this fraction of the members'
#: forward FLOPs (below that, saving it does not repay splitting the models).
MIN_PREFIX_SHARE = 0.05

#: Examples of the training set the planner traces and checks models with.
_EXAMPLES = 8


# ------------------------------------------------------------------------------------------------
# planning: frozen prefixes
# ------------------------------------------------------------------------------------------------
_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout, nn.RReLU)
_RANDOM_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                     F.feature_alpha_dropout, F.rrelu, torch.dropout, torch.rand, torch.randn,
                     torch.randint, torch.rand_like, torch.randn_like, torch.randint_like, torch.randperm,
                     torch.bernoulli, torch.normal, torch.multinomial, torch.poisson}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                   "geometric_", "cauchy_", "log_normal_", "multinomial"}


class _Hasher:
    """Hashes of weights and buffers, memoized for one planning call (while every model is alive,
    a storage address names one tensor)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[Any, ...], str] = {}

    def tensor(self, t: torch.Tensor) -> str:
        t = t.detach()
        key = (t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))
        digest = self.cache.get(key)
        if digest is None:
            h = hashlib.blake2b(f"{tuple(t.shape)}{t.dtype}".encode(), digest_size=16)
            if t.numel():
                h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            digest = self.cache[key] = h.hexdigest()
        return digest

    def state(self, obj: Any) -> str:
        """Weights, buffers and training flags of a node's module (or attribute)."""
        if isinstance(obj, nn.Module):
            parts = [f"{k}={self.tensor(v)}" for k, v in obj.state_dict(keep_vars=True).items()
                     if isinstance(v, torch.Tensor)]
            parts.append("".join("T" if m.training else "E" for m in obj.modules()))
            return ";".join(parts)
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        return repr(type(obj))


def _frozen(obj: Any) -> bool:
    if isinstance(obj, nn.Module):
        return all(not p.requires_grad for p in obj.parameters())
    if isinstance(obj, torch.Tensor):
        return not obj.requires_grad
    return True


def _random(n: fx.Node, module: nn.Module | None) -> bool:
    if n.op == "call_module" and module is not None:
        return any(isinstance(m, _RANDOM_MODULES) and m.training for m in module.modules())
    if n.op == "call_function":
        return n.target in _RANDOM_FUNCTIONS
    if n.op == "call_method":
        return n.target in _RANDOM_METHODS
    return False


def _bytes(shape: Any, dtype: Any) -> int:
    if isinstance(shape, torch.Size):
        size = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
        return math.prod(shape) * size
    if isinstance(shape, tuple):
        dtypes = dtype if isinstance(dtype, tuple) else (None,) * len(shape)
        return sum(_bytes(s, d) for s, d in zip(shape, dtypes))
    return 0


@dataclass
class _Analysis:
    """One job's model seen through the graph IR."""

    job: Job
    cfg: TrainConfig
    example: Any  # one tensor, or a collated structure (see example_tensor)
    graph: Graph | None = None
    eligible: dict[str, fx.Node] = field(default_factory=dict)   # value fingerprint -> first node
    key_of: dict[fx.Node, str] = field(default_factory=dict)     # eligible node -> value fingerprint
    cost: dict[str, float] = field(default_factory=dict)         # value fingerprint -> FLOPs
    total: float = 0.0                                           # the model's FLOPs
    activations: dict[fx.Node, int] = field(default_factory=dict)  # output bytes at the batch size
    why_not: str = ""


def _example_batch(cfg: TrainConfig) -> Any:
    """The first few training examples (the planner traces and checks models on real data): one
    tensor, or the collated structure (tuple, list, dict of tensors) a model taking several inputs
    receives -- :func:`example_tensor` tells which."""
    tensors = getattr(cfg.train, "tensors", None)
    n = min(_EXAMPLES, len(cfg.train))
    if isinstance(tensors, (tuple, list)) and tensors and isinstance(tensors[0], torch.Tensor):
        x = tensors[0][:n]
    else:  # any map-style dataset of (input, target) pairs, collated as the trainer's loader does
        x = default_collate([cfg.train[i][0] for i in range(n)])
    return _map_tensors(x, lambda t: t.detach().cpu().clone())  # a copy: a model may modify its input in place


def _map_tensors(x: Any, fn: Any) -> Any:
    """``fn`` applied to every tensor in a collated batch (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map_tensors(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return x


def example_tensor(example: Any) -> bool:
    """Whether a planner example is one tensor (the analyses that split or merge graphs need one input)."""
    return isinstance(example, torch.Tensor)


def example_bytes(example: Any) -> int:
    """The bytes of one example of a collated batch (every tensor's first row)."""
    total = 0

    def add(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += (t[:1].numel() if t.dim() else 1) * t.element_size()
        return t

    _map_tensors(example, add)
    return total


def example_to(example: Any, device: Any) -> Any:
    """A collated batch moved to ``device``."""
    return _map_tensors(example, lambda t: t.to(device))


def _analyse(job: Job, cfg: TrainConfig, example: Any, hasher: _Hasher) -> _Analysis:
    a = _Analysis(job, cfg, example)
    model = job.model
    assert model is not None
    if not example_tensor(example):
        a.why_not = "the model's input is a structure of tensors, not one tensor"
        return a
    scale = cfg.batch_size / max(len(example), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine reported opaque modules when it traced the trial
        graph = trace(model, (example.clone(),))
    a.graph = graph
    try:
        a.total = float(graph.flops())
    except Exception:
        try:  # an op the FLOP pass does not know: shapes alone
            graph.propagate_shapes()
        except Exception as err:
            a.why_not = f"its shapes could not be computed ({type(err).__name__})"
            return a
    nodes = list(graph.fx_graph.nodes)
    for n in nodes:
        if n.op in ("call_module", "call_function", "call_method"):
            a.activations[n] = int(_bytes(n.meta.get(meta.SHAPE), n.meta.get(meta.DTYPE)) * scale)
    if sum(1 for n in nodes if n.op == "placeholder") != 1:
        a.why_not = "the model takes several inputs"
    elif not any(not p.requires_grad for p in model.parameters()):
        a.why_not = "no frozen parameters"
    else:
        _eligible_nodes(a, nodes, hasher)
    return a


def _eligible_nodes(a: _Analysis, nodes: list[fx.Node], hasher: _Hasher) -> None:
    """Value fingerprints of the nodes that may belong to a shared prefix: frozen, deterministic,
    fed only by such nodes. A value fingerprint hashes the node's prefix fingerprint (structure),
    its module's weights, buffers and training flags, and its inputs' value fingerprints."""
    graph, model = a.graph, a.job.model
    assert graph is not None and model is not None
    flags = [m.training for m in model.modules()]
    model.train()  # the flags separate training runs with (a model may keep its backbone in eval)
    try:
        for n in nodes:
            if n.op == "output":
                continue
            if n.op == "placeholder":
                key = "input"
            else:
                if any(src not in a.key_of for src in n.all_input_nodes):
                    continue
                state = ""
                if n.op in ("call_module", "get_attr"):
                    obj = graph._get(str(n.target))
                    if not _frozen(obj) or (n.op == "call_module" and _random(n, obj)):
                        continue
                    state = hasher.state(obj)
                elif _random(n, None):
                    continue
                fp = graph[n.name].prefix_fingerprint()
                text = fp + "|" + state + "|" + ",".join(a.key_of[s] for s in n.all_input_nodes)
                key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
            a.key_of[n] = key
            a.eligible.setdefault(key, n)
            a.cost[key] = float(n.meta.get(meta.FLOPS, 0) or 0)
    finally:
        for m, flag in zip(model.modules(), flags):
            m.training = flag


def _cost(keys: Iterable[str], a: _Analysis) -> float:
    return sum(a.cost.get(k, 0.0) for k in keys)


@dataclass
class _Split:
    """One member's split at a shared prefix."""

    suffix: nn.Module
    inputs: tuple[str, ...]
    buffers: dict[str, str] = field(default_factory=dict)  # member state_dict key -> prefix module's key


def _build_prefix(rep: _Analysis, keys: set[str], outputs: list[str]) -> fx.GraphModule:
    """The prefix (``keys``) of the representative's graph as a module returning ``outputs``."""
    graph = rep.graph
    assert graph is not None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.fx_graph.nodes:
        key = rep.key_of.get(n)
        if key is not None and (key in keys or key == "input") and rep.eligible[key] is n:
            env[n] = g.node_copy(n, lambda s: env[rep.eligible[rep.key_of[s]]])
    g.output(tuple(env[rep.eligible[k]] for k in outputs))
    return fx.GraphModule(graph.root, g, class_name="SharedPrefix")


class _Suffix(nn.Module):
    """The suffix of a model that reads several shared tensors (the trainer passes them as a tuple)."""

    def __init__(self, module: fx.GraphModule):
        super().__init__()
        self.module = module

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        return self.module(*inputs)


def _split(a: _Analysis, keys: set[str]) -> _Split | str:
    """The member's suffix after the prefix made of ``keys``, or why it cannot be split."""
    graph = a.graph
    assert graph is not None
    nodes = list(graph.fx_graph.nodes)
    in_prefix = {n for n in nodes if a.key_of.get(n) is not None and (a.key_of[n] in keys or n.op == "placeholder")}
    frontier: list[fx.Node] = []
    for n in nodes:
        if n not in in_prefix:
            frontier += [src for src in n.all_input_nodes if src in in_prefix and src not in frontier]
    prefix_targets = {str(n.target) for n in in_prefix if n.op in ("call_module", "get_attr")}
    for n in nodes:
        if n not in in_prefix and n.op in ("call_module", "get_attr"):
            t = str(n.target)
            if any(t == p or t.startswith(p + ".") or p.startswith(t + ".") for p in prefix_targets):
                return "a frozen module is used both in the prefix and after it"
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: g.placeholder(f"shared_{i}") for i, n in enumerate(frontier)}
    for n in nodes:
        if n not in in_prefix:
            env[n] = g.node_copy(n, lambda s: env[s])
    gm = fx.GraphModule(graph.root, g, class_name="Suffix")
    if not any(p.requires_grad for p in gm.parameters()):
        return "nothing trainable after the frozen prefix"
    inputs = tuple(BATCH if n.op == "placeholder" else a.key_of[n] for n in frontier)
    return _Split(gm if len(frontier) == 1 else _Suffix(gm), inputs)


def _buffer_map(member: _Analysis, rep: _Analysis, keys: set[str]) -> dict[str, str]:
    """The member's state_dict keys of its prefix buffers -> the prefix module's keys (the
    representative's target paths, which ``fx.GraphModule`` keeps)."""
    out: dict[str, str] = {}
    assert member.graph is not None
    for n, key in member.key_of.items():
        if key not in keys or n.op not in ("call_module", "get_attr"):
            continue
        r = rep.eligible[key]
        obj = member.graph._get(str(n.target))
        if isinstance(obj, nn.Module):
            for name, _ in obj.named_buffers():
                out[f"{n.target}.{name}"] = f"{r.target}.{name}"
        elif isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter):
            out[str(n.target)] = str(r.target)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b)


def _verify(member: _Analysis, rep: _Analysis, prefix: fx.GraphModule, outputs: list[str], split: _Split) -> str:
    """Check ``suffix(prefix(x)) == model(x)`` on real data in training and in evaluation mode, the
    prefix drawing no random numbers; buffers and flags are restored. '' when it holds."""
    model, rep_model = member.job.model, rep.job.model
    assert model is not None and rep_model is not None
    x = member.example
    saved = [(b, b.detach().clone()) for m in (model, rep_model) for b in m.buffers()]
    flags = [(m, m.training) for mm in (model, rep_model) for m in mm.modules()]
    try:
        with torch.no_grad():
            for mode in (True, False):
                model.train(mode)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    expected = model(x.clone())
                rep_model.train(mode)
                model.train(mode)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    state = torch.get_rng_state()
                    values = dict(zip(outputs, prefix(x.clone())))
                    if not torch.equal(state, torch.get_rng_state()):
                        return "the frozen prefix draws random numbers"
                    args = [x.clone() if k == BATCH else values[k] for k in split.inputs]
                    got = split.suffix(args[0] if len(args) == 1 else tuple(args))
                if not _same(expected, got):
                    return "the split model does not reproduce the model"
    except Exception as err:
        return f"the split model failed ({type(err).__name__})"
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
        for m, flag in flags:
            m.training = flag
    return ""


def _mode_flags(model: nn.Module, module: nn.Module) -> tuple[list[bool], list[bool]]:
    """The training flags of ``module.modules()`` after ``model.train()`` and after ``model.eval()``."""
    saved = [(m, m.training) for m in model.modules()]
    try:
        model.train()
        train = [m.training for m in module.modules()]
        model.eval()
        evaluation = [m.training for m in module.modules()]
    finally:
        for m, flag in saved:
            m.training = flag
    return train, evaluation


@dataclass
class _PrefixPlan:
    prefix: SharedPrefix
    keys: set[str]
    rep: _Analysis
    members: dict[int, _Split]        # trial id -> its split


def _find_prefixes(analyses: list[_Analysis], notes: dict[int, str]) -> list[_PrefixPlan]:
    """Cluster the members whose frozen prefixes overlap (greedily, keeping at least half of a
    cluster's prefix FLOPs), split them, keep the splits that reproduce their models."""
    clusters: list[tuple[set[str], list[_Analysis]]] = []
    for a in analyses:
        if not a.eligible or a.why_not:
            continue
        own = set(a.eligible) - {"input"}
        best, best_cost = None, 0.0
        for i, (keys, _members) in enumerate(clusters):
            cost = _cost(keys & own, a)
            if cost > best_cost and cost >= 0.5 * _cost(keys, a):
                best, best_cost = i, cost
        if best is None:
            clusters.append((own, [a]))
        else:
            keys, members = clusters[best]
            clusters[best] = (keys & own, members + [a])
    plans: list[_PrefixPlan] = []
    for keys, members in clusters:
        if len(members) < 2:
            notes.setdefault(members[0].job.trial.id, "no other trial shares its frozen prefix")
            continue
        mean_total = sum(m.total for m in members) / len(members)
        cost = _cost(keys, members[0])
        if cost <= 0 or cost < MIN_PREFIX_SHARE * mean_total:
            for m in members:
                notes.setdefault(m.job.trial.id, f"shared frozen prefix too small ({cost / max(mean_total, 1):.0%} of FLOPs)")
            continue
        rep = members[0]
        splits: dict[int, _Split] = {}
        for m in members:
            split = _split(m, keys)
            if isinstance(split, str):
                notes[m.job.trial.id] = split
            else:
                splits[m.job.trial.id] = split
        outputs = list(dict.fromkeys(k for s in splits.values() for k in s.inputs if k != BATCH))
        if len(splits) < 2 or not outputs:
            continue
        module = _build_prefix(rep, keys, outputs)
        by_id = {m.job.trial.id: m for m in members}
        verified: dict[int, _Split] = {}
        for trial_id, split in splits.items():
            why = _verify(by_id[trial_id], rep, module, outputs, split)
            if why:
                notes[trial_id] = why
            else:
                split.buffers = _buffer_map(by_id[trial_id], rep, keys)
                verified[trial_id] = split
        if len(verified) < 2:
            for trial_id in verified:
                notes.setdefault(trial_id, "no other trial shares its frozen prefix")
            continue
        n_nodes = sum(1 for n, k in rep.key_of.items() if k in keys)
        description = f"frozen prefix of {n_nodes} nodes ({cost / max(mean_total, 1):.0%} of FLOPs)"
        key = "prefix:" + hashlib.blake2b(",".join(sorted(keys)).encode(), digest_size=6).hexdigest()
        assert rep.job.model is not None
        train_flags, eval_flags = _mode_flags(rep.job.model, module)
        prefix = SharedPrefix(key, module, tuple(outputs), description, train_flags, eval_flags)
        plans.append(_PrefixPlan(prefix, keys, rep, verified))
    return plans
