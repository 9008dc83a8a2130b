"""The grouped program: K stacked models run without vmap on packed tensors.

``(B, K*C, H, W)`` feature maps (the first convolution as ONE convolution with K*O outputs on the
shared input, later ones as grouped convolutions, BatchNorm over K*C channels) and ``(K, B, F)``
after Flatten (Linear as one ``baddbmm``). Built as an fx pass: :class:`_Grouping`, a
``torch.fx.Transformer``, rewrites the model's traced graph node by node into a ``GraphModule`` of
grouped ops (one handler function per op kind, chosen from a rule table by module class, each node's
layout in ``node.meta["layout"]``); then fx rewrites fold a ReLU into the 2x2 max-pool or the
BatchNorm it feeds, and the graph is linted. The program prints as code, a node it cannot cover
is named in the error (and the unit uses vmap), and it is used only after it reproduced the
vmapped forward; 2x2 max-pools run as :class:`_MaxPool2x2`.
"""

from __future__ import annotations


import linecache
import operator
import sys
import traceback
import warnings
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..graph import meta, trace
from ._exact import (batch_norm_maps_per_model, batch_norm_per_model, conv_maps_per_model, conv_per_model,
                     conv_rows_per_model, linear_per_model)
from ._kernels import BatchNormTrain, batch_norm_pays, batch_norm_supported
from ._stacked import _DROPOUTS, _first_line

if TYPE_CHECKING:  # the member runs this program; the program does not import it
    from ._batched import BatchedMember

# -- packed layout: grouped kernels without vmap ---------------------------------------------------------
class _Unsupported(Exception):
    """The model has an op the packed program does not cover (the unit uses vmap instead)."""


_ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid,
                        nn.Hardswish, nn.Hardtanh, nn.Mish, nn.Softplus, nn.Identity)
_POOL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d,
                 nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_ELEMENTWISE_FUNCTIONS = {torch.relu, F.relu, torch.tanh, torch.sigmoid, F.gelu, F.silu, F.leaky_relu, F.elu,
                          F.relu6, F.hardswish}
_POOL_FUNCTIONS = {F.max_pool1d, F.max_pool2d, F.avg_pool1d, F.avg_pool2d, F.adaptive_avg_pool1d,
                   F.adaptive_avg_pool2d}
_ELEMENTWISE_METHODS = {"relu", "tanh", "sigmoid", "to", "float", "double", "contiguous"}

# Layouts of a value in the packed program (K models, batch B):
#   "S": shared by every model, (B, ...) -- the input, and what is computed from it alone;
#   "C": channel-packed, (B, K*C, ...) -- model k's channels at [k*C, (k+1)*C): convolutions run as ONE
#        convolution (the first with K*O outputs, later ones grouped), BatchNorm/pooling/activations as is;
#   "M": model-major, (K, B, F) -- features after flatten; Linear runs as one batched matmul;
#   "N": batch-stacked maps, (K*B, C, ...) -- model k's examples at rows [k*B, (k+1)*B), each a view
#        laid out as the separate model's map: exact programs run convolutions and BatchNorm per
#        model on these views with no copy, the activations and pooling right after them per model
#        too (:func:`fuse_stacked_chains`), other element-wise ops once over all rows.


class _MaxPool2x2(torch.autograd.Function):
    """``max_pool2d(x, 2)`` on an NCHW map with even height and width, optionally followed by
    ReLU, in two passes (column pairs, then row pairs) with the same values and gradients as
    ``F.max_pool2d(F.relu(x), 2)`` bit for bit.

    Written by hand because the NCHW max-pool kernel is per-element bound on small maps (the
    largest single op of a fused step of small CNNs); two vectorized passes are faster forward
    (BENCHMARKS.md, "Figures behind choices in the code"). Ties: max_pool2d's gradient goes to the first maximum of a window in row-major
    order; taking the first of equal values across columns, then across rows, picks that same
    element. ReLU after the pool instead of before is exact: ``max`` commutes with it, and where
    the maximum is <= 0 both give a zero gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, relu: bool) -> torch.Tensor:
        b, c, h, w = x.shape
        pairs = x.view(b, c, h, w // 2, 2)
        left, right = pairs[..., 0], pairs[..., 1]
        right_wins = torch.gt(right, left).to(x.dtype)  # float masks: products are cheaper than bool ops
        rows = torch.maximum(left, right).view(b, c, h // 2, 2, w // 2)
        top, bottom = rows[:, :, :, 0], rows[:, :, :, 1]
        bottom_wins = torch.gt(bottom, top).to(x.dtype)
        out = torch.maximum(top, bottom)
        if relu:
            out.clamp_min_(0)
        ctx.save_for_backward(right_wins, bottom_wins, out if relu else None)
        ctx.relu = relu
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        right_wins, bottom_wins, out = ctx.saved_tensors
        if ctx.relu:
            grad = torch.ops.aten.threshold_backward(grad, out, 0)
        b, c, h, half = right_wins.shape
        rows = grad.new_empty(b, c, h // 2, 2, half)
        torch.mul(grad, bottom_wins, out=rows[:, :, :, 1])
        torch.sub(grad, rows[:, :, :, 1], out=rows[:, :, :, 0])  # g - g*1 = 0, g - 0 = g: exact
        rows = rows.view(b, c, h, half)
        pairs = grad.new_empty(b, c, h, half, 2)
        torch.mul(rows, right_wins, out=pairs[..., 1])
        torch.sub(rows, pairs[..., 1], out=pairs[..., 0])
        return pairs.view(b, c, h, 2 * half), None


# -- the grouped ops: one handler per op kind, called by the generated program ----------------------------
class GroupedRun:
    """What one call of a grouped program needs besides its input: the member (stacked parameters,
    buffers, dropout streams, activation variants), K, train/eval mode, the memory format and
    whether kernels must be exact (per model where their rounding depends on K: :mod:`._exact`)."""

    __slots__ = ("member", "params", "buffers", "k", "training", "channels_last", "exact")

    def __init__(self, member: "BatchedMember", training: bool, channels_last: bool, exact: bool = False):
        self.exact = exact
        self.member = member
        self.params: Mapping[str, torch.Tensor] = member.params
        self.buffers: Mapping[str, torch.Tensor] = member.buffers
        self.k = len(member.ids)
        self.training = training
        self.channels_last = channels_last


def grouped_input(x: torch.Tensor, run: GroupedRun) -> torch.Tensor:
    """The shared input, channels-last for a model with 2-d convolutions run so (pooling,
    BatchNorm and grouped convolutions over K*C channels run several times faster on CPU)."""
    if run.channels_last and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


def grouped_conv(v: torch.Tensor, run: GroupedRun, *, name: str, dims: int, in_channels: int, stride: Any,
                 padding: Any, dilation: Any, groups: int) -> torch.Tensor:
    """Conv1d/2d of K models: on the shared input ONE convolution with K*O outputs, on packed
    ``(B, K*C, ...)`` maps one convolution with ``K * groups`` groups (exact runs: one per model)."""
    k = run.k
    if run.exact:
        return conv_per_model(v, run.params, k, name=name, dims=dims, in_channels=in_channels, stride=stride,
                              padding=padding, dilation=dilation, groups=groups, channels_last=run.channels_last)
    w = run.params[f"{name}.weight"]
    w = w.reshape(k * w.shape[1], *w.shape[2:])
    b = run.params.get(f"{name}.bias")
    b = None if b is None else b.reshape(-1)
    shared = v.shape[1] == in_channels and v.dim() == w.dim()
    if not shared and v.shape[1] != k * in_channels:
        raise ValueError(f"{name}: {v.shape[1]} input channels, expected {in_channels} or {k * in_channels}")
    last = dims == 2 and run.channels_last
    if last:  # a channels-last weight gives a channels-last output
        w = w.contiguous(memory_format=torch.channels_last)
    fn = F.conv2d if dims == 2 else F.conv1d
    out = fn(v, w, b, stride, padding, dilation, groups if shared else k * groups)
    if last:  # (a 1-channel input does not say its format)
        out = out.contiguous(memory_format=torch.channels_last)
    return out


def grouped_linear(v: torch.Tensor, run: GroupedRun, *, name: str, src: str) -> torch.Tensor:
    """Linear of K models: on a shared ``(B, F)`` input one matmul with K*O outputs, on ``(K, B, F)``
    one batched matmul. Outputs are ``(K, B, O)`` views of contiguous ``(K, O, B)`` tensors:
    activations and dropout then run on contiguous memory, the next Linear is a plain bmm and a
    classifier's cross entropy runs over the class dim of ``(K, C, B)`` (vectorized along B).
    Exact runs: one Linear per model, ``(K, B, O)`` contiguous."""
    k = run.k
    if run.exact:
        return linear_per_model(v, run.params, k, name=name, src=src)
    w, b = run.params[f"{name}.weight"], run.params.get(f"{name}.bias")
    if v.dim() == 2 and src == "S":
        wf = w.reshape(-1, w.shape[-1])
        out = torch.mm(wf, v.t()) if b is None else torch.addmm(b.reshape(-1, 1), wf, v.t())
        return out.view(k, w.shape[1], v.shape[0]).transpose(1, 2)
    if v.dim() == 3 and v.shape[0] == k:
        vt = v.transpose(1, 2)
        out = torch.bmm(w, vt) if b is None else torch.baddbmm(b.unsqueeze(2), w, vt)
        return out.transpose(1, 2)
    raise ValueError(f"{name}: Linear on a {v.dim()}-d input")


def grouped_batch_norm(v: torch.Tensor, run: GroupedRun, *, name: str, src: str, momentum: float | None,
                       eps: float, track_running_stats: bool, relu: bool = False) -> torch.Tensor:
    """BatchNorm1d/2d of K models over K*C channels (the stacked running statistics as views);
    ``relu``: a ReLU after it folded in (:func:`fuse_bn_relu`)."""
    params, buffers, k, training = run.params, run.buffers, run.k, run.training
    weight, bias = params.get(f"{name}.weight"), params.get(f"{name}.bias")
    mean, var = buffers.get(f"{name}.running_mean"), buffers.get(f"{name}.running_var")
    tracked = buffers.get(f"{name}.num_batches_tracked")
    factor = 0.0 if momentum is None else momentum
    if training and track_running_stats and tracked is not None:
        tracked.add_(1)
        if momentum is None:
            factor = 1.0 / float(tracked[0])
    use_batch = training or (mean is None and var is None)
    model_major = src == "M"
    if model_major and v.dim() != 3:
        raise ValueError(f"{name}: BatchNorm on a {v.dim() - 1}-d per-model input")
    if use_batch and not model_major and not run.exact and batch_norm_supported(v) and batch_norm_pays(v):
        # the native NCHW kernel is per-element bound on packed small maps (BENCHMARKS.md: figures behind choices)
        return BatchNormTrain.apply(v, None if weight is None else weight.reshape(-1),
                                    None if bias is None else bias.reshape(-1),
                                    None if mean is None or not training else mean.view(-1),
                                    None if var is None or not training else var.view(-1), factor, eps, relu)
    if run.exact and run.channels_last and not model_major and v.dim() == 4:
        return batch_norm_per_model(v, params, buffers, k, name=name, training=use_batch, momentum=factor, eps=eps,
                                    relu=relu)
    x = v.transpose(0, 1).reshape(v.shape[1], -1) if model_major else v
    out = F.batch_norm(x, None if mean is None else mean.view(-1), None if var is None else var.view(-1),
                       None if weight is None else weight.reshape(-1), None if bias is None else bias.reshape(-1),
                       use_batch, factor, eps)
    if model_major:
        out = out.view(v.shape[1], k, -1).transpose(0, 1)
    return F.relu(out) if relu else out  # (eval mode with running statistics, CUDA: native kernels)


def grouped_conv_batch_norm(v: torch.Tensor, run: GroupedRun, *, conv: dict[str, Any],
                            batch_norm: dict[str, Any]) -> torch.Tensor:
    """A Conv2d whose only user is a BatchNorm2d (:func:`fuse_conv_batch_norm`): in exact
    channels-last runs each model's convolution output goes to its BatchNorm as the map it is
    (no packing and unpacking between the two); otherwise :func:`grouped_conv` then
    :func:`grouped_batch_norm`."""
    if not (run.exact and run.channels_last and conv["dims"] == 2):
        return grouped_batch_norm(grouped_conv(v, run, **conv), run, **batch_norm)
    maps = conv_maps_per_model(v, run.params, run.k, channels_last=True, **conv)
    bn = batch_norm
    factor = _batch_norm_factor(run, bn["name"], bn["momentum"], bn["track_running_stats"])
    outs = batch_norm_maps_per_model(maps, run.params, run.buffers, name=bn["name"],
                                     training=_batch_stats(run, bn["name"]), momentum=factor, eps=bn["eps"],
                                     relu=bn.get("relu", False))
    return torch.cat(outs, dim=1)


def _batch_norm_factor(run: GroupedRun, name: str, momentum: float | None, track_running_stats: bool) -> float:
    """BatchNorm's running-statistics factor for this call, counting the call as ``nn.BatchNorm``
    does in training (``num_batches_tracked``; with ``momentum=None`` a cumulative average)."""
    factor = 0.0 if momentum is None else momentum
    tracked = run.buffers.get(f"{name}.num_batches_tracked")
    if run.training and track_running_stats and tracked is not None:
        tracked.add_(1)
        if momentum is None:
            factor = 1.0 / float(tracked[0])
    return factor


def _batch_stats(run: GroupedRun, name: str) -> bool:
    """Whether BatchNorm ``name`` normalizes by the batch's statistics (training, or no running ones)."""
    return run.training or (run.buffers.get(f"{name}.running_mean") is None
                            and run.buffers.get(f"{name}.running_var") is None)


def _stacked(maps: Sequence[torch.Tensor], after: Sequence[nn.Module]) -> torch.Tensor:
    """K per-model maps, each through the modules ``after`` (activations, pooling: folded in by
    :func:`fuse_stacked_chains`), stacked along the batch. Per model because these ops are
    memory-bound: on one model's maps they run in cache, on K models' maps at once they stream
    them from memory (slower on small CNNs: BENCHMARKS.md, the BN CNN's kernel forms)."""
    out = list(maps)
    for m in after:
        out = [m(x) for x in out]
    return torch.cat(out)


def stacked_conv(v: torch.Tensor, run: GroupedRun, *after: nn.Module, name: str, dims: int, src: str, stride: Any,
                 padding: Any, dilation: Any, groups: int) -> torch.Tensor:
    """Conv1d/2d of K models, each on its own rows (:func:`~._exact.conv_rows_per_model`): on the
    shared input ("S") or on batch-stacked maps ("N"); the outputs (each through ``after``)
    stacked along the batch."""
    maps = conv_rows_per_model(v, run.params, run.k, name=name, dims=dims, shared=src == "S", stride=stride,
                               padding=padding, dilation=dilation, groups=groups, channels_last=run.channels_last)
    return _stacked(maps, after)


def stacked_batch_norm(v: torch.Tensor, run: GroupedRun, *after: nn.Module, name: str, momentum: float | None,
                       eps: float, track_running_stats: bool) -> torch.Tensor:
    """BatchNorm1d/2d of K models on batch-stacked maps: each model's on its own rows (views), with
    its statistics; the running statistics updated through views of the stacked buffers."""
    factor = _batch_norm_factor(run, name, momentum, track_running_stats)
    outs = batch_norm_maps_per_model(v.split(v.shape[0] // run.k), run.params, run.buffers, name=name,
                                     training=_batch_stats(run, name), momentum=factor, eps=eps, regrade=False)
    return _stacked(outs, after)


def stacked_conv_batch_norm(v: torch.Tensor, run: GroupedRun, *after: nn.Module, conv: dict[str, Any],
                            batch_norm: dict[str, Any]) -> torch.Tensor:
    """A convolution whose only user is a BatchNorm (:func:`fuse_conv_batch_norm`), of batch-stacked
    maps: each model's convolution output goes to its BatchNorm as the map it is, then through
    ``after``, and the K outputs are stacked once."""
    maps = conv_rows_per_model(v, run.params, run.k, shared=conv["src"] == "S", channels_last=run.channels_last,
                               **{n: a for n, a in conv.items() if n != "src"})
    bn = batch_norm
    factor = _batch_norm_factor(run, bn["name"], bn["momentum"], bn["track_running_stats"])
    outs = batch_norm_maps_per_model(maps, run.params, run.buffers, name=bn["name"],
                                     training=_batch_stats(run, bn["name"]), momentum=factor, eps=bn["eps"],
                                     regrade=False)
    return _stacked(outs, after)


def stacked_dropout(v: torch.Tensor, run: GroupedRun, *, name: str) -> torch.Tensor:
    """Dropout of batch-stacked maps, each model's rows drawn from its own stream as the separate
    trainer draws them (training only)."""
    return run.member._row_dropout(v, name) if run.training else v


def grouped_max_pool2x2(v: torch.Tensor, *, relu: bool = False) -> torch.Tensor:
    """``max_pool2d(x, 2)`` (after a ReLU folded in: :func:`fuse_pool_relu`) of packed maps, as
    :class:`_MaxPool2x2` on contiguous maps of even size, else as torch's kernel."""
    if v.dim() == 4 and v.shape[-1] % 2 == 0 and v.shape[-2] % 2 == 0 and v.is_contiguous():
        if torch.is_grad_enabled() and v.requires_grad:
            return _MaxPool2x2.apply(v, relu)
        # validation: the same maxima without the gradient-routing masks (a third of the passes)
        b, c, h, w = v.shape
        pairs = v.view(b, c, h, w // 2, 2)
        rows = torch.maximum(pairs[..., 0], pairs[..., 1]).view(b, c, h // 2, 2, w // 2)
        out = torch.maximum(rows[:, :, :, 0], rows[:, :, :, 1])
        return out.clamp_min_(0) if relu else out
    return F.max_pool2d(F.relu(v) if relu else v, 2)  # odd sizes, channels-last


def grouped_flatten(v: torch.Tensor, run: GroupedRun, *, src: str) -> torch.Tensor:
    """``flatten(1)``: shared stays shared; packed maps become model-major ``(K, B, F)``."""
    if src == "S":
        return v.flatten(1)
    if src == "M":
        return v.flatten(2)
    if src == "N":  # (one copy of channels-last maps, in each model's flatten order)
        return v.flatten(1).view(run.k, v.shape[0] // run.k, -1)
    return v.reshape(v.shape[0], run.k, -1).transpose(0, 1)


def grouped_mean(v: torch.Tensor, run: GroupedRun, *, dims: tuple[int, ...], keepdim: bool, src: str,
                 out: str) -> torch.Tensor:
    """A mean over dimensions of each model's value (``dims`` as the model names them): shared
    stays shared; model-major ``(K, B, ...)`` reduces the dimensions one further; packed maps
    reduce their map dimensions and become model-major ``(K, B, F)`` where no map dimension is
    left (``out == "M"``)."""
    if src == "M":
        dims = tuple(d + 1 if d >= 0 else d for d in dims)
    value = v.mean(dims, keepdim=keepdim)
    if out == "M" and src == "C":
        return value.reshape(value.shape[0], run.k, -1).transpose(0, 1)
    if out == "M" and src == "N":
        return value.reshape(run.k, value.shape[0] // run.k, -1)
    return value


def grouped_dropout(v: torch.Tensor, run: GroupedRun, *, name: str, src: str) -> torch.Tensor:
    """Dropout with masks drawn per model from each trial's own stream (training only)."""
    return run.member._packed_dropout(v, name, src) if run.training else v


def grouped_mixed(v: torch.Tensor, run: GroupedRun, *, name: str, src: str) -> torch.Tensor:
    """Each run of rows' own activation at site ``name`` (:mod:`._variants`) on its slice of ``v``:
    "M" ``(K, B, F)`` along the model dim (kept a view of a ``(K, F, B)`` tensor where ``v`` is
    one, as Linear makes them), "C" ``(B, K*C, ...)`` in blocks of C channels."""
    runs = run.member.site_runs(name)
    if len(runs) == 1:
        return runs[0][2](v)
    # one split, not a slice per run: its backward is one concatenation, where each slice's
    # backward writes its gradient into zeros of the whole input
    if src == "M":
        transposed = v.transpose(1, 2).is_contiguous()
        rows = v.split([end - start for start, end, _ in runs])
        parts = [m(part) for part, (_, _, m) in zip(rows, runs)]
        if transposed:
            return torch.cat([part.transpose(1, 2) for part in parts]).transpose(1, 2)
        return torch.cat(parts)
    if src == "N":
        b = v.shape[0] // run.k
        blocks = v.split([(end - start) * b for start, end, _ in runs])
        return torch.cat([m(part) for part, (_, _, m) in zip(blocks, runs)])
    c = v.shape[1] // run.k
    blocks = v.split([(end - start) * c for start, end, _ in runs], dim=1)
    return torch.cat([m(part) for part, (_, _, m) in zip(blocks, runs)], dim=1)


# -- building the program: an fx Transformer of the model's graph -----------------------------------------
_Rule = Callable[["_Grouping", fx.Node, Any, nn.Module | None], tuple[Any, str]]


def _flatten_args(node: fx.Node) -> bool:
    return tuple(node.args[1:]) in ((1,), (1, -1)) and not node.kwargs


class _Grouping(fx.Transformer):
    """The model's graph rewritten over K models: each node becomes the grouped op of its layout
    (``node.meta["layout"]``: "S" shared, "C" channel-packed, "M" model-major, "N" batch-stacked),
    from the rule table :data:`_MODULE_RULES`; a node no rule covers raises :class:`_Unsupported`
    naming it. ``maps``: the layout of the models' feature maps, "C" or "N"."""

    def __init__(self, traced: fx.GraphModule, mixed: Collection[str], maps: str = "C"):
        super().__init__(traced)
        self.mixed = mixed
        self.maps = maps
        self.modules = dict(traced.named_modules())
        self.run_arg: fx.Proxy | None = None

    def run_node(self, n: fx.Node) -> Any:
        out = self._grouped_node(n)
        if isinstance(out, fx.Proxy) and out.node.meta.get("layout") in ("C", "N") and "rank" not in out.node.meta:
            # packed maps keep the rank of the packed maps they came from
            source = next((self.env[a] for a in n.args if isinstance(a, fx.Node)), None)
            if isinstance(source, fx.Proxy) and "rank" in source.node.meta:
                out.node.meta["rank"] = source.node.meta["rank"]
        return out

    def _grouped_node(self, n: fx.Node) -> Any:
        if n.op == "output":
            return super().run_node(n)
        inputs = [a for a in n.args if isinstance(a, fx.Node)]
        if any(isinstance(v, fx.Node) for v in n.kwargs.values()) or any(
                isinstance(a, (list, tuple)) and any(isinstance(b, fx.Node) for b in a) for a in n.args):
            raise _Unsupported(f"node {n.name}: nested inputs")
        if n.op == "placeholder":
            if self.run_arg is not None:
                raise _Unsupported("more than one input")
            x = super().run_node(n)
            self.run_arg = self.tracer.create_proxy("placeholder", "run", (), {})
            out = self.tracer.create_proxy("call_function", grouped_input, (x, self.run_arg), {})
            return self._laid(out, "S")
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        layouts = [self.layout(a) for a in args if isinstance(a, fx.Proxy)]
        if n.target in (operator.add, torch.add, "add") and n.op in ("call_function", "call_method"):
            if len(inputs) != 2 or len(n.args) != 2 or layouts[0] != layouts[1] or n.kwargs:
                raise _Unsupported(f"node {n.name}: add of differently laid-out values")
            return self._laid(self.tracer.create_proxy("call_function", operator.add, tuple(args), {}, name=n.name),
                              layouts[0])
        if len(inputs) != 1 or n.args[0] is not inputs[0]:
            raise _Unsupported(f"node {n.name}: not a chain of single-input ops")
        v, src = args[0], layouts[0]
        if n.op == "call_module" and str(n.target) in self.mixed:
            if src not in "CMN":
                raise _Unsupported(f"module {n.target}: activations differ on the shared input")
            return self._call(grouped_mixed, v, src, node=n, name=str(n.target), src=src)
        if n.op == "call_module":
            m = self.modules[str(n.target)]
            rule = _MODULE_RULES.get(type(m))
            if rule is None:
                raise _Unsupported(f"node {n.name}: module {n.target} ({type(m).__name__})")
            proxy, layout = rule(self, n, v, m)
            return self._laid(proxy, layout)
        if n.op == "call_function" and n.target in _ELEMENTWISE_FUNCTIONS or \
                n.op == "call_function" and n.target in _POOL_FUNCTIONS and src in "SCN" or \
                n.op == "call_method" and n.target in _ELEMENTWISE_METHODS:
            if n.op == "call_function" and n.target is F.max_pool2d and src == "C" and _is_pool2x2(n, None):
                return self._call(grouped_max_pool2x2, v, src, node=n)
            return self._laid(self.tracer.create_proxy(n.op, n.target, tuple(args), dict(kwargs), name=n.name), src)
        if (n.op, n.target) in (("call_function", torch.flatten), ("call_method", "flatten")) and _flatten_args(n):
            return self._call(grouped_flatten, v, "S" if src == "S" else "M", node=n, src=src)
        if (n.op, n.target) in (("call_function", torch.mean), ("call_method", "mean")):
            return self._mean(n, v, src)
        raise _Unsupported(f"node {n.name}: {n.op} {getattr(n.target, '__name__', n.target)}")

    def layout(self, value: Any) -> str:
        return str(value.node.meta["layout"])

    def _mean(self, n: fx.Node, v: fx.Proxy, src: str) -> fx.Proxy:
        """``x.mean(dims[, keepdim])`` / ``torch.mean``: of packed maps only over map dimensions
        (their rank known from the convolution that made them)."""
        given = dict(zip(("dim", "keepdim"), n.args[1:]), **n.kwargs)
        dims, keepdim = given.get("dim"), given.get("keepdim", False)
        if set(given) - {"dim", "keepdim", "dtype"} or given.get("dtype") is not None or dims is None \
                or not isinstance(keepdim, bool):
            raise _Unsupported(f"node {n.name}: mean{tuple(n.args[1:])} (a mean over given dimensions only)")
        dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
        out, rank = src, v.node.meta.get("rank")
        if src in "CN":
            if rank is None:
                raise _Unsupported(f"node {n.name}: mean of packed maps of unknown rank")
            spatial = {d % rank for d in dims}
            if not spatial or min(spatial) < 2 or len(spatial) != len(dims):
                raise _Unsupported(f"node {n.name}: mean over {dims} of packed maps (map dimensions only)")
            left = rank if keepdim else rank - len(spatial)
            out = src if left > 2 else "M"
        elif src == "M" and any(d == 0 for d in dims):
            raise _Unsupported(f"node {n.name}: mean over the batch dimension")
        proxy = self._call(grouped_mean, v, out, node=n, dims=dims, keepdim=keepdim, src=src, out=out)
        if out in "CN":
            proxy.node.meta["rank"] = left
        return proxy

    def _laid(self, proxy: fx.Proxy, layout: str) -> fx.Proxy:
        proxy.node.meta["layout"] = layout
        return proxy

    def _call(self, handler: Callable[..., torch.Tensor], v: fx.Proxy, layout: str, *, node: fx.Node,
              **kwargs: Any) -> fx.Proxy:
        """A node named as ``node`` calling ``handler(v, run, **kwargs)`` (without ``run`` if it takes none)."""
        takes_run = handler is not grouped_max_pool2x2
        args = (v, self.run_arg) if takes_run else (v,)
        return self._laid(self.tracer.create_proxy("call_function", handler, args, kwargs, name=node.name), layout)

    def apply_module(self, n: fx.Node, v: fx.Proxy, src: str) -> fx.Proxy:
        """The module itself (activations, pooling: no parameters) on the value as laid out."""
        return self._laid(self.tracer.create_proxy("call_module", n.target, (v,), {}, name=n.name), src)


def _conv_rule(g: _Grouping, n: fx.Node, v: Any, m: nn.Module | None) -> tuple[Any, str]:
    src = g.layout(v)
    if not isinstance(m, (nn.Conv1d, nn.Conv2d)) or m.padding_mode != "zeros" or src not in "S" + g.maps:
        raise _Unsupported(f"node {n.name}: module {n.target} ({type(m).__name__}) on a per-model input")
    dims = 2 if isinstance(m, nn.Conv2d) else 1
    if g.maps == "N":
        proxy = g._call(stacked_conv, v, "N", node=n, name=str(n.target), dims=dims, src=src, stride=m.stride,
                        padding=m.padding, dilation=m.dilation, groups=m.groups)
    else:
        proxy = g._call(grouped_conv, v, "C", node=n, name=str(n.target), dims=dims, in_channels=m.in_channels,
                        stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups)
    proxy.node.meta["rank"] = dims + 2
    return proxy, g.maps


def _linear_rule(g: _Grouping, n: fx.Node, v: Any, m: nn.Module | None) -> tuple[Any, str]:
    src = g.layout(v)
    if src not in "SM":
        raise _Unsupported(f"node {n.name}: module {n.target} (Linear) on packed maps")
    return g._call(grouped_linear, v, "M", node=n, name=str(n.target), src=src), "M"


def _batch_norm_rule(g: _Grouping, n: fx.Node, v: Any, m: nn.Module | None) -> tuple[Any, str]:
    src = g.layout(v)
    assert isinstance(m, nn.modules.batchnorm._BatchNorm)
    if src not in "CMN":
        raise _Unsupported(f"node {n.name}: module {n.target} ({type(m).__name__}) on a shared input")
    if src == "N":
        return g._call(stacked_batch_norm, v, src, node=n, name=str(n.target), momentum=m.momentum, eps=m.eps,
                       track_running_stats=m.track_running_stats), src
    return g._call(grouped_batch_norm, v, src, node=n, name=str(n.target), src=src, momentum=m.momentum, eps=m.eps,
                   track_running_stats=m.track_running_stats), src


def _elementwise_rule(g: _Grouping, n: fx.Node, v: Any, m: nn.Module | None) -> tuple[Any, str]:
    src = g.layout(v)
    return g.apply_module(n, v, src), src


def _pool_rule(g: _Grouping, n: fx.Node, v: Any, m: nn.Module | None) -> tuple[Any, str]:
    src = g.layout(v)
    if src not in "SCN":
        raise _Unsupported(f"node {n.name}: module {n.target} ({type(m).__name__}) on a per-model input")
    if src == "C" and _is_pool2x2(n, m):
        return g._call(grouped_max_pool2x2, v, src, node=n), src
    return g.apply_module(n, v, src), src


def _flatten_rule(g: _Grouping, n: fx.Node, v: Any, m: nn.Module | None) -> tuple[Any, str]:
    assert isinstance(m, nn.Flatten)
    if m.start_dim != 1 or m.end_dim != -1:
        raise _Unsupported(f"node {n.name}: Flatten({m.start_dim}, {m.end_dim})")
    src = g.layout(v)
    return g._call(grouped_flatten, v, "S" if src == "S" else "M", node=n, src=src), "S" if src == "S" else "M"


def _dropout_rule(g: _Grouping, n: fx.Node, v: Any, m: nn.Module | None) -> tuple[Any, str]:
    src = g.layout(v)
    if src not in "CMN":
        raise _Unsupported(f"node {n.name}: module {n.target} ({type(m).__name__}) on a shared input")
    if src == "N":
        return g._call(stacked_dropout, v, src, node=n, name=str(n.target)), src
    return g._call(grouped_dropout, v, src, node=n, name=str(n.target), src=src), src


# module class -> how the grouped program runs it (new layers: a rule and a handler here)
_MODULE_RULES: dict[type, _Rule] = {
    nn.Conv1d: _conv_rule, nn.Conv2d: _conv_rule, nn.Linear: _linear_rule,
    nn.BatchNorm1d: _batch_norm_rule, nn.BatchNorm2d: _batch_norm_rule, nn.Flatten: _flatten_rule,
    **{t: _elementwise_rule for t in _ELEMENTWISE_MODULES}, **{t: _pool_rule for t in _POOL_MODULES},
    **{t: _dropout_rule for t in _DROPOUTS},
}


def _is_pool2x2(node: fx.Node, m: nn.Module | None) -> bool:
    """A 2x2, stride-2 max-pool without padding, dilation, ceil mode or indices."""
    k: Any   # a module's typed attributes, or a call's arguments (any value the user wrote)
    s: Any
    p: Any
    d: Any
    if m is not None:
        if type(m) is not nn.MaxPool2d:
            return False
        k, s, p, d, ceil, idx = m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, m.return_indices
    else:
        names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
        given: dict[str, Any] = dict(zip(names, node.args[1:]), **node.kwargs)
        if set(given) - set(names):
            return False
        k, s, p, d = (given.get(n) for n in names[:4])
        ceil, idx = given.get("ceil_mode", False), given.get("return_indices", False)
        s = k if s is None or s == [] else s
        p = 0 if p is None else p
        d = 1 if d is None else d
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
    return pair(k) == (2, 2) and pair(s) == (2, 2) and pair(p) == (0, 0) and pair(d) == (1, 1) and \
        not ceil and not idx


# -- rewrites of the grouped graph ------------------------------------------------------------------------
def _is_relu(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))) is nn.ReLU
    if node.op == "call_function":
        return node.target in (torch.relu, F.relu) and len(node.args) == 1 and \
            not node.kwargs.get("inplace", False) and set(node.kwargs) <= {"inplace"}
    return node.op == "call_method" and node.target == "relu" and len(node.args) == 1 and not node.kwargs


def fuse_pool_relu(gm: fx.GraphModule) -> int:
    """A ReLU of packed maps whose only user is a 2x2 max-pool runs inside the pool
    (:func:`grouped_max_pool2x2` ``relu=True``: ReLU on a quarter of the elements; exact, since
    max commutes with ReLU). Returns the number of rewrites."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.target is not grouped_max_pool2x2 or node.kwargs.get("relu"):
            continue
        before = node.args[0]
        if isinstance(before, fx.Node) and len(before.users) == 1 and before.meta.get("layout") == "C" \
                and _is_relu(gm, before):
            node.args = (before.args[0],)
            node.kwargs = {**node.kwargs, "relu": True}
            gm.graph.erase_node(before)
            done += 1
    return done


def fuse_bn_relu(gm: fx.GraphModule) -> int:
    """A ReLU right after a BatchNorm of packed maps (its only user) runs inside it
    (:class:`~tridens.xopt._kernels.BatchNormTrain`: in place on its output, no extra map).
    Returns the number of rewrites."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.target is not grouped_batch_norm or node.kwargs.get("src") != "C" or len(node.users) != 1:
            continue
        after = next(iter(node.users))
        if after.args == (node,) and _is_relu(gm, after):
            node.kwargs = {**node.kwargs, "relu": True}
            after.replace_all_uses_with(node)
            gm.graph.erase_node(after)
            done += 1
    return done


def fuse_conv_batch_norm(gm: fx.GraphModule) -> int:
    """A 2-d convolution of packed maps whose only user is a BatchNorm runs with it as one node
    (:func:`grouped_conv_batch_norm`); a convolution of batch-stacked maps whose only user is a
    BatchNorm, likewise (:func:`stacked_conv_batch_norm`). Returns the number of rewrites."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.target is stacked_batch_norm:
            conv = node.args[0]
            if isinstance(conv, fx.Node) and conv.target is stacked_conv and len(conv.users) == 1:
                node.target = stacked_conv_batch_norm
                node.args = (conv.args[0], conv.args[1])
                node.kwargs = {"conv": dict(conv.kwargs), "batch_norm": dict(node.kwargs)}
                gm.graph.erase_node(conv)
                done += 1
            continue
        if node.target is not grouped_batch_norm or node.kwargs.get("src") != "C":
            continue
        conv = node.args[0]
        if not isinstance(conv, fx.Node) or conv.target is not grouped_conv or len(conv.users) != 1 \
                or conv.kwargs.get("dims") != 2:
            continue
        bn_kwargs = {n: v for n, v in node.kwargs.items() if n != "src"}
        bn_kwargs["src"] = "C"
        node.target = grouped_conv_batch_norm
        node.args = (conv.args[0], conv.args[1])
        node.kwargs = {"conv": dict(conv.kwargs), "batch_norm": bn_kwargs}
        gm.graph.erase_node(conv)
        done += 1
    return done


_STACKED_HEADS = (stacked_conv, stacked_batch_norm, stacked_conv_batch_norm)


def fuse_stacked_chains(gm: fx.GraphModule) -> int:
    """Activation and pooling modules of batch-stacked maps that follow a per-model convolution or
    BatchNorm (each the only user of the one before) run inside it, per model, before its outputs
    are stacked (the modules passed as arguments: ``stacked_conv_batch_norm(x, run, relu, pool,
    ...)``). Returns the number of modules folded in."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.target not in _STACKED_HEADS:
            continue
        while len(node.users) == 1:
            after = next(iter(node.users))
            if after.op != "call_module" or after.args != (node,) or after.kwargs or \
                    not isinstance(gm.get_submodule(str(after.target)), _ELEMENTWISE_MODULES + _POOL_MODULES):
                break
            with gm.graph.inserting_before(node):
                module = gm.graph.get_attr(str(after.target))
            node.args = (*node.args, module)
            after.replace_all_uses_with(node)
            gm.graph.erase_node(after)
            done += 1
    return done


def _traced(model: nn.Module, example_inputs: tuple[torch.Tensor, ...] | None) -> fx.GraphModule:
    """``model`` as an fx GraphModule: with example inputs, traced as the graph IR traces it
    (conditions on shapes decided from them, :func:`tridens.graph.trace`), else plain fx."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the planner's own trace has warned the user already)
        if example_inputs is None:
            try:
                return fx.symbolic_trace(model)
            except Exception as err:
                raise _Unsupported(f"fx: {_first_line(err)}") from err
        graph = trace(model, example_inputs)
    for node in graph.fx_graph.nodes:
        if node.meta.get(meta.OPAQUE):
            raise _Unsupported(f"node {node.name}: opaque ({node.meta.get(meta.OPAQUE_REASON, '')})")
    module = graph.to_module()
    module.graph.eliminate_dead_code()  # the shape reads behind a decided condition
    module.recompile()
    return module


class GroupedProgram:
    """The model's forward over K stacked models without vmap, for chains (and adds) of common
    layers: Conv1d/2d, Linear, BatchNorm1d/2d, pooling, activations, Flatten, means over map
    dimensions (``x.mean((2, 3))``), dropout (masks drawn per model in call order, as separate
    training draws them). ``example_inputs`` (a batch's shape, on any device): conditions on
    shapes in the forward are decided from them as the graph IR decides them. ``module`` is a
    :class:`torch.fx.GraphModule` of grouped ops (:func:`grouped_conv`, :func:`grouped_batch_norm`,
    ...) called as ``module(x, run)``; print it to read the program. Anything the rules do not
    cover raises :class:`_Unsupported` naming the node, and the unit uses vmap. ``channels_last``:
    2-d maps run channels-last (``BatchingSettings.channels_last``). ``mixed``: the activation
    sites where the models' activations differ (:mod:`._variants`). ``exact``: kernels whose
    rounding depends on K run per model (``BatchingSettings.exact``; see :class:`GroupedRun`).

    >>> import torch.nn as nn
    >>> program = GroupedProgram(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2),
    ...                                        nn.Flatten(), nn.Linear(4, 2)))
    >>> [n.target.__name__ for n in program.module.graph.nodes if n.op == "call_function"]
    ['grouped_input', 'grouped_conv', 'grouped_max_pool2x2', 'grouped_flatten', 'grouped_linear']
    """

    def __init__(self, model: nn.Module, *, channels_last: bool = False, mixed: Collection[str] = (),
                 exact: bool = False, example_inputs: tuple[torch.Tensor, ...] | None = None,
                 maps: str | None = None):
        self.exact = exact
        traced = _traced(model, example_inputs)
        if maps is None:
            maps = "N" if exact and channels_last and any(isinstance(m, nn.Conv2d) for m in traced.modules()) else "C"
        if maps not in ("C", "N"):
            raise ValueError(f"maps={maps!r}: 'C' (channel-packed) or 'N' (batch-stacked)")
        self.maps = maps
        grouping = _Grouping(traced, mixed, maps)
        try:
            module = grouping.transform()
        except _Unsupported as err:  # (fx added "While executing <node>" below the first line)
            raise _Unsupported(_first_line(err)) from err
        out = [n for n in module.graph.nodes if n.op == "output"][0]
        if not isinstance(out.args[0], fx.Node) or out.args[0].meta.get("layout") != "M":
            raise _Unsupported("the output is not a (batch, features) tensor per model")
        fuse_pool_relu(module)
        fuse_bn_relu(module)
        self.channels_last = channels_last and any(
            n.target in (grouped_conv, stacked_conv) and n.kwargs["dims"] == 2 for n in module.graph.nodes)
        if exact and self.channels_last or maps == "N":
            fuse_conv_batch_norm(module)
        if maps == "N":
            fuse_stacked_chains(module)
        module.graph.eliminate_dead_code()
        module.graph.lint()
        module.recompile()
        self.module = module

    def __str__(self) -> str:
        return str(self.module.graph)

    def run(self, member: "BatchedMember", x: torch.Tensor, training: bool,
            channels_last: bool | None = None) -> torch.Tensor:
        """The K models' outputs ``(K, B, ...)`` on the shared input ``x``. An error names the
        node that raised it ("While executing %conv1 : ...", a note on the exception)."""
        run = GroupedRun(member, training, self.channels_last if channels_last is None else channels_last, self.exact)
        try:
            return self.module(x, run)  # type: ignore[no-any-return]
        except Exception as err:
            node = self.failed_node(err)
            if node is not None and sys.version_info >= (3, 11):   # (exception notes are 3.11's)
                err.add_note(f"While executing {node.format_node()}")
            raise

    def failed_node(self, err: BaseException) -> fx.Node | None:
        """The node of the generated forward where ``err`` was raised (None if not in it)."""
        filename = type(self.module).forward.__code__.co_filename
        found: fx.Node | None = None
        for frame, lineno in traceback.walk_tb(err.__traceback__):
            if frame.f_code.co_filename == filename:
                target = linecache.getline(filename, lineno).split("=", 1)[0].strip()
                found = next((n for n in self.module.graph.nodes if n.name == target), None) or found
        return found

    def describe_error(self, err: BaseException) -> str:
        """One line: the node where ``err`` was raised and the error's first line."""
        node = self.failed_node(err)
        return f"{node.name}: {_first_line(err)}" if node is not None else _first_line(err)
