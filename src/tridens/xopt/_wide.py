"""Planning joint steps: each member's first layer (the module that alone reads the batch), the
wide op over compatible first layers where it measured faster, and the exact 2x2 max-pool kernel
where it reproduced the model bit for bit.
"""

from __future__ import annotations


import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..evaluators import TrainConfig
from ..units import Decisions
from ..graph import Graph
from ..graph import meta
from ._joint import JointMember, _WideLayer
from ._pipeline import BATCH, PipelineMember, TrainerMember, _mib
from ._prefix import _Analysis, _same
from ._settings import CSESettings

# ------------------------------------------------------------------------------------------------
# planning: joint steps and wide first layers
# ------------------------------------------------------------------------------------------------
@dataclass
class _First:
    """A member's first layer: the module that alone reads the (possibly flattened) batch."""

    key: tuple[Any, ...]          # members with equal keys may share one wide op
    kind: str                     # "linear" | "conv2d"
    flatten: bool
    layer: nn.Linear | nn.Conv2d
    graph: Graph                  # the member's graph IR
    skip: tuple[fx.Node, ...]     # its nodes up to the layer (input, flatten, layer)
    _after: fx.GraphModule | None = None

    @property
    def after(self) -> fx.GraphModule:
        """The model after the layer: its output -> the model's output (built when first asked:
        only for the groups whose wide op is kept)."""
        if self._after is None:
            g = fx.Graph()
            env: dict[fx.Node, fx.Node] = {self.skip[-1]: g.placeholder("first_layer")}
            for m in self.graph.fx_graph.nodes:
                if m not in self.skip:
                    env[m] = g.node_copy(m, lambda s: env[s])
            self._after = fx.GraphModule(self.graph.root, g, class_name="AfterFirstLayer")
        return self._after


def _is_flatten(n: fx.Node, graph: Graph, src: fx.Node) -> bool:
    """``nn.Flatten()``, ``torch.flatten(x, 1)`` or ``x.flatten(1)`` of ``src`` (from dim 1 on)."""
    if not n.args or n.args[0] is not src:
        return False
    if n.op == "call_module":
        m = graph._get(str(n.target))
        return type(m) is nn.Flatten and m.start_dim == 1 and m.end_dim == -1 and len(n.args) == 1 and not n.kwargs
    if (n.op == "call_function" and n.target is torch.flatten) or (n.op == "call_method" and n.target == "flatten"):
        dims: dict[str, Any] = {"start_dim": 0, "end_dim": -1}
        for name, value in zip(("start_dim", "end_dim"), n.args[1:]):
            dims[name] = value
        dims.update(n.kwargs)
        return set(dims) == {"start_dim", "end_dim"} and dims["start_dim"] == 1 and dims["end_dim"] == -1
    return False


def _first_layer(a: _Analysis) -> _First | None:
    """The member's first layer if it can run in a wide op: a plain ``nn.Linear`` or ``nn.Conv2d``
    (groups 1, zero padding, no bias, as before BatchNorm) with no hooks, trainable, its weight used
    nowhere else, that is the only reader of the batch (through at most one flatten), called once."""
    graph, model = a.graph, a.job.model
    if graph is None or model is None:
        return None
    nodes = list(graph.fx_graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        return None
    src, flatten = placeholders[0], False
    while True:
        users = list(src.users)
        if len(users) != 1:
            return None
        n = users[0]
        if not flatten and _is_flatten(n, graph, src):
            src, flatten = n, True
            continue
        break
    if n.op != "call_module" or n.args != (src,) or n.kwargs:
        return None
    layer = graph._get(str(n.target))
    if type(layer) not in (nn.Linear, nn.Conv2d) or layer._forward_hooks or layer._forward_pre_hooks:
        return None
    if sum(1 for m in nodes if m.op == "call_module" and m.target == n.target) != 1:
        return None
    weight, bias = layer.weight, layer.bias
    if not weight.requires_grad or (bias is not None and not bias.requires_grad):
        return None
    if sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is weight or p is bias) != 1 + (bias is not None):
        return None  # a weight tied to another module
    common = (bias is not None, weight.dtype, str(weight.device), flatten)
    if isinstance(layer, nn.Linear):
        key: tuple[Any, ...] = ("linear", layer.in_features, *common)
    else:
        # a convolution's bias gradient is reduced inside oneDNN's backward, which rounds
        # differently over the wide op's output than over one member's; before BatchNorm that
        # gradient is rounding noise only, which Adam scales to lr-sized steps (enough to move
        # validation accuracy): such layers keep their own op
        if layer.groups != 1 or layer.padding_mode != "zeros" or bias is not None:
            return None
        key = ("conv2d", layer.in_channels, tuple(layer.kernel_size), tuple(layer.stride),
               layer.padding if isinstance(layer.padding, str) else tuple(layer.padding), tuple(layer.dilation), *common)
    return _First(key, key[0], flatten, layer, graph, tuple(dict.fromkeys((placeholders[0], src, n))))


def _check_member(a: _Analysis, first: _First | None,
                  runs: Sequence[Callable[[torch.Tensor], Any]] = ()) -> tuple[str, _First | None, list[bool]]:
    """Run the member's model on the example batch in training and in evaluation mode (its own
    random stream seeded alike, its buffers as they were before each run): ``why`` it cannot join
    a joint step ('' if it can: it does not modify its input in place), ``first`` if
    ``after(layer(batch))`` reproduces the model, and for each of ``runs`` (rewrites of the model
    with exact kernels) whether it gives exactly the model's output. Buffers, flags and the global
    random state are restored."""
    model = a.job.model
    assert model is not None
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    flags = [(m, m.training) for m in model.modules()]
    exact = [True] * len(runs)

    def seeded(f: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Any:
        for b, value in saved:
            b.copy_(value)
        torch.default_generator.manual_seed(0)  # the CPU stream alone (torch.manual_seed also queues every accelerator's)
        return f(x)

    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for mode in (True, False):
                model.train(mode)
                x = a.example.clone()
                version = x._version
                expected = seeded(model, x)
                if x._version != version:
                    return "it modifies its input in place", None, [False] * len(runs)
                if first is not None:
                    inp = a.example.clone()
                    got = seeded(first.after, first.layer(inp.flatten(1) if first.flatten else inp))
                    if not _same(expected, got):
                        first = None
                for i, run in enumerate(runs):
                    if exact[i]:
                        try:
                            got = seeded(run, a.example.clone())
                        except Exception:  # a rewrite that fails is not used
                            exact[i] = False
                            continue
                        exact[i] = (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)
                                    and expected.shape == got.shape and expected.dtype == got.dtype
                                    and torch.equal(expected, got))
    except Exception as err:
        return f"its forward failed ({type(err).__name__})", None, [False] * len(runs)
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
        for m, flag in flags:
            m.training = flag
    return "", first, exact


def _pool_2x2(x: torch.Tensor, relu: bool) -> torch.Tensor:
    """``F.max_pool2d(F.relu(x) if relu else x, 2)`` through the batching module's exact two-pass
    kernel (the fx target the rewrite below inserts)."""
    from ._grouped import _MaxPool2x2

    return _MaxPool2x2.apply(x, relu)


def _ints(value: Any, n: int = 2) -> tuple[Any, ...] | None:
    if isinstance(value, int):
        return (value,) * n
    if isinstance(value, (tuple, list)) and len(value) == n:
        return tuple(value)
    return None


def _is_max_pool_2x2(gm: nn.Module, n: fx.Node) -> bool:
    """A 2x2, stride-2 max-pool without padding, dilation, ceil mode or indices, on ``n.args[0]``."""
    kernel: Any   # a module's typed attributes, or a call's arguments (any value the user wrote)
    stride: Any
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        if type(m) is not nn.MaxPool2d or m._forward_hooks or m._forward_pre_hooks or len(n.args) != 1 or n.kwargs:
            return False
        kernel, stride, padding, dilation = m.kernel_size, m.stride, m.padding, m.dilation
        ceil, indices = m.ceil_mode, m.return_indices
    elif n.op == "call_function" and n.target in (F.max_pool2d, torch.max_pool2d):
        names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
        given: dict[str, Any] = dict(zip(names, n.args))
        if set(n.kwargs) - set(names) or set(n.kwargs) & set(given):
            return False
        given.update(n.kwargs)
        if "kernel_size" not in given:
            return False
        kernel, stride = given["kernel_size"], given.get("stride")
        padding, dilation = given.get("padding", 0), given.get("dilation", 1)
        ceil, indices = given.get("ceil_mode", False), given.get("return_indices", False)
    else:
        return False
    if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0):
        stride = kernel
    return (_ints(kernel) == (2, 2) and _ints(stride) == (2, 2) and _ints(padding) == (0, 0)
            and _ints(dilation) == (1, 1) and ceil is False and indices is False)


def _relu_of(gm: nn.Module, n: fx.Node) -> fx.Node | None:
    """The input of ``n`` if ``n`` is a plain ReLU (module, function or method), else None."""
    if not isinstance(n, fx.Node) or len(n.args) != 1 or not isinstance(n.args[0], fx.Node):
        return None
    inplace = False
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        if type(m) is not nn.ReLU or m._forward_hooks or m._forward_pre_hooks or n.kwargs:
            return None
        inplace = m.inplace
    elif n.op == "call_function" and n.target in (torch.relu, F.relu, torch.relu_):
        if set(n.kwargs) - {"inplace"}:
            return None
        inplace = n.target is torch.relu_ or bool(n.kwargs.get("inplace", False))
    elif n.op == "call_method" and n.target in ("relu", "relu_"):
        if n.kwargs:
            return None
        inplace = n.target == "relu_"
    else:
        return None
    src = n.args[0]
    # an in-place ReLU also changes its input for any other reader: taken over only when it has none
    return None if inplace and len(src.users) != 1 else src


def _fast_pool(root: nn.Module, n: fx.Node) -> bool:
    """Whether node ``n`` (of a graph over ``root``) is a 2x2 max-pool that :func:`_pool_2x2` can
    run: on a floating-point map of even height and width (the graph IR's shape metadata)."""
    if n.op not in ("call_module", "call_function") or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if not _is_max_pool_2x2(root, n):
        return False
    shape, dtype = n.args[0].meta.get(meta.SHAPE), n.args[0].meta.get(meta.DTYPE)
    return (isinstance(shape, torch.Size) and len(shape) == 4 and shape[2] % 2 == 0 and shape[3] % 2 == 0
            and isinstance(dtype, torch.dtype) and dtype.is_floating_point)


def _with_fast_pools(root: nn.Module, source: fx.Graph, class_name: str) -> fx.GraphModule | None:
    """A module over ``root``'s modules running ``source`` (a graph over ``root``) with its 2x2
    max-pools on maps of even height and width (from the graph IR's shape metadata) rewritten into
    :func:`_pool_2x2`, taking over a ReLU that alone feeds one; None if there is none. The caller
    checks the result against the model on real data (:func:`_check_member`)."""
    if not any(_fast_pool(root, n) for n in source.nodes):
        return None
    g = fx.Graph()
    g.output(g.graph_copy(source, {}))
    for n in list(g.nodes):
        if not _fast_pool(root, n):
            continue
        src = n.args[0]
        inp = _relu_of(root, src) if len(src.users) == 1 else None
        with g.inserting_before(n):
            fast = g.call_function(_pool_2x2, (src if inp is None else inp, inp is not None))
        fast.meta = dict(n.meta)
        n.replace_all_uses_with(fast)
        g.erase_node(n)
        if inp is not None:
            g.erase_node(src)
    g.lint()
    return fx.GraphModule(root, g, class_name=class_name)


def _fast_model(a: _Analysis) -> nn.Module | None:
    """The member's model with its 2x2 max-pools rewritten for the exact two-pass kernel, where it
    has one (to be checked on real data by :func:`_check_member`); None where not."""
    graph, model = a.graph, a.job.model
    if graph is None or model is None or a.example.dim() != 4:
        return None
    try:
        return _with_fast_pools(graph.root, graph.fx_graph, "FastPools")
    except Exception:  # an optimization: a graph it cannot rewrite runs as it is
        return None


def _fast_after(a: _Analysis, first: _First) -> nn.Module | None:
    """The member's model after its (wide) first layer with the two-pass max-pools, where that
    reproduces the model exactly on real data."""
    try:
        gm = _with_fast_pools(first.after, first.after.graph, "FastPoolsAfterFirstLayer")
    except Exception:
        return None
    if gm is None:
        return None
    layer = first.layer
    _, _, [exact] = _check_member(a, None, [lambda x: gm(layer(x.flatten(1) if first.flatten else x))])
    return gm if exact else None


def _wide_speedup(firsts: Sequence[_First], x: torch.Tensor, measure_rounds: int, decisions: Decisions) -> float:
    """The wide op's speed-up over the members' own layers, forward and backward on the real batch
    (copies of the layers, the same upstream gradients), ``measure_rounds`` interleaved rounds after
    one warm-up, CPU time on a CPU; kept in the run's ``decisions.wide`` by (layer key, widths,
    batch shape, threads, device type)."""
    f0 = firsts[0]
    widths = tuple(int(f.layer.weight.shape[0]) for f in firsts)
    cache_key = (f0.key, widths, tuple(x.shape), torch.get_num_threads(), x.device.type)
    if cache_key in decisions.wide:
        return decisions.wide[cache_key]
    layers = {i: copy.deepcopy(f.layer) for i, f in enumerate(firsts)}
    wide = _WideLayer(f0.kind, f0.flatten, layers)
    inp = x.flatten(1) if f0.flatten else x
    with torch.no_grad():
        grads = {i: torch.ones_like(m(inp)) for i, m in layers.items()}
    ids = list(layers)

    def fused() -> None:
        outs = wide(x, ids)
        torch.autograd.backward([outs[i] for i in ids], [grads[i] for i in ids])

    def own() -> None:
        for i in ids:
            layers[i](inp).backward(grads[i])

    clock = time.process_time if x.device.type == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {"fused": [], "own": []}
    for round_ in range(measure_rounds + 1):
        for name, run in (("fused", fused), ("own", own)) if round_ % 2 else (("own", own), ("fused", fused)):
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            t0 = clock()
            run()
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            if round_:  # the first round warms up both
                times[name].append(clock() - t0)
    ratio = statistics.median(times["own"]) / max(statistics.median(times["fused"]), 1e-9)
    decisions.wide[cache_key] = ratio
    return ratio


def _joint_member(members: list[PipelineMember], chunk: list[tuple[_Analysis, int, int]], estimate: int,
                  limit: int, cfg0: TrainConfig, settings: CSESettings,
                  decisions: Decisions | None = None) -> tuple[list[PipelineMember], str, int]:
    """Replace the unit's whole-model trainer members by one :class:`JointMember` (with wide first
    layers where they pay), if the memory bound and ``settings`` allow; returns the members, the
    log text and the unit's memory estimate. Trainers with a gradient scaler ("16-mixed") step alone."""
    if not settings.joint or cfg0.precision == "16-mixed":
        return members, "", estimate
    decisions = decisions if decisions is not None else Decisions()
    by_id = {a.job.trial.id: (a, t) for a, _, t in chunk}
    whole = [m for m in members if type(m) is TrainerMember and m.inputs == (BATCH,) and not m.prefix_buffers
             and m.trainer.model is m.job.model and m.trial_id in by_id]
    if len(whole) < 2:
        return members, "", estimate
    joint: list[TrainerMember] = []
    firsts: dict[int, _First] = {}
    apart: dict[str, list[int]] = {}
    fast: dict[int, nn.Module] = {}
    fast_after: dict[int, nn.Module] = {}
    for m in whole:
        a = by_id[m.trial_id][0]
        model = _fast_model(a) if settings.fast_pools else None
        why, _, exact = _check_member(a, None, [] if model is None else [model])
        if why:
            apart.setdefault(why, []).append(m.trial_id)
            continue
        joint.append(m)
        # (a wide op reads the batch as given: not for models the memory-format policy runs channels-last)
        first = _first_layer(a) if settings.wide != "off" and not cfg0.channels_last else None
        if first is not None:
            firsts[m.trial_id] = first
        if model is not None and exact[0]:
            fast[m.trial_id] = model
    if len(joint) < 2:
        return members, "", estimate
    # memory: the joint step holds every joint member's activations at once
    transients = {a.job.trial.id: t for a, _, t in chunk}
    ids = {m.trial_id for m in joint}
    rest = [t for i, t in transients.items() if i not in ids]
    need = estimate - max(transients.values(), default=0) + sum(transients[i] for i in ids) + max(rest, default=0)
    if need > limit:
        return members, (f"members step one at a time (a joint step would need {_mib(need)}, "
                         f"over max_unit_memory {_mib(limit)})"), estimate
    # wide first layers: members with the same first-layer key, where the one op pays
    groups: dict[tuple[Any, ...], list[int]] = {}
    for trial_id, first in firsts.items():
        groups.setdefault(first.key, []).append(trial_id)
    wide: list[_WideLayer] = []
    after_first: dict[int, nn.Module] = {}
    notes: list[str] = []
    x = by_id[joint[0].trial_id][0].example
    for key, trial_ids in groups.items():
        if len(trial_ids) < 2:
            continue
        batch = x[:1].expand(cfg0.batch_size, *x.shape[1:]).contiguous().to(cfg0.device)
        if settings.wide == "auto":  # measured first (cached): the models are split only if it pays
            speedup = _wide_speedup([firsts[t] for t in trial_ids], batch, settings.measure_rounds, decisions)
            if speedup < settings.wide_min_speedup:
                group = _WideLayer(key[0], firsts[trial_ids[0]].flatten, {t: firsts[t].layer for t in trial_ids})
                notes.append(f"first layers of trials [{', '.join(map(str, trial_ids))}] kept apart "
                             f"({group.describe()} as one op measured {speedup:.2f}x)")
                continue
        # each member's model after its first layer, checked on real data to reproduce the model
        kept = [t for t in trial_ids if _check_member(by_id[t][0], firsts[t])[1] is not None]
        if len(kept) < 2:
            continue
        group = _WideLayer(key[0], firsts[kept[0]].flatten, {t: firsts[t].layer for t in kept})
        ids_text = ", ".join(str(t) for t in kept)
        if settings.wide == "auto":
            if kept != trial_ids:
                speedup = _wide_speedup([firsts[t] for t in kept], batch, settings.measure_rounds, decisions)
                if speedup < settings.wide_min_speedup:
                    notes.append(f"first layers of trials [{ids_text}] kept apart ({group.describe()} as one op "
                                 f"measured {speedup:.2f}x)")
                    continue
            notes.append(f"trials [{ids_text}] share their first layer as one {group.describe()} "
                         f"(measured {speedup:.2f}x)")
        else:
            notes.append(f"trials [{ids_text}] share their first layer as one {group.describe()}")
        wide.append(group)
        after_first.update({t: firsts[t].after for t in kept})
        if settings.fast_pools:
            for t in kept:
                after = _fast_after(by_id[t][0], firsts[t]) if t in fast else None
                if after is not None:
                    fast_after[t] = after
    member = JointMember(joint, wide=wide, after_first=after_first, trusted=ids, fast=fast,
                         fast_after=fast_after, foreach_step=settings.foreach_step)
    if fast:
        notes.append(f"2x2 max-pools of trials [{', '.join(str(t) for t in fast)}] run by an exact "
                     f"two-pass kernel")
    out: list[PipelineMember] = []
    for kept_member in members:
        if kept_member in joint:
            if member not in out:
                out.append(member)
        else:
            out.append(kept_member)
    text = f"joint step (one backward) for trials [{', '.join(str(m.trial_id) for m in joint)}]"
    if apart:
        text += "; alone: " + "; ".join(f"trials [{', '.join(map(str, t))}] ({why})" for why, t in apart.items())
    if notes:
        text += "; " + "; ".join(notes)
    return out, text, need
