"""The grouped program: K stacked models run without vmap on packed tensors.

``(B, K*C, H, W)`` feature maps (the first convolution as ONE convolution with K*O outputs on the
shared input, later ones as grouped convolutions, BatchNorm over K*C channels) and ``(K, B, F)``
after Flatten (Linear as one ``baddbmm``). Built as an fx interpretation of the model's graph and
used only after it reproduced the vmapped forward; 2x2 max-pools run as :class:`_MaxPool2x2`.
"""

from __future__ import annotations


import warnings
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

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
#   "M": model-major, (K, B, F) -- features after flatten; Linear runs as one batched matmul.


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


def _is_pool2x2(kind: str, node: Any, info: Mapping[str, Any]) -> bool:
    """A 2x2, stride-2 max-pool without padding, dilation, ceil mode or indices."""
    if kind == "apply":
        m = info["module"]
        if type(m) is not nn.MaxPool2d:
            return False
        k, s, p, d, ceil, idx = m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, m.return_indices
    elif kind == "call" and info["fn"] is F.max_pool2d:
        names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
        given = dict(zip(names, node.args[1:]), **node.kwargs)
        if set(given) - set(names):
            return False
        k, s, p, d = (given.get(n) for n in names[:4])
        ceil, idx = given.get("ceil_mode", False), given.get("return_indices", False)
        s = k if s is None or s == [] else s
        p = 0 if p is None else p
        d = 1 if d is None else d
    else:
        return False
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
    return pair(k) == (2, 2) and pair(s) == (2, 2) and pair(p) == (0, 0) and pair(d) == (1, 1) and \
        not ceil and not idx


def _is_relu(kind: str, node: Any, info: Mapping[str, Any]) -> bool:
    if kind == "apply":
        return type(info["module"]) is nn.ReLU
    if kind == "call":
        return info["fn"] in (torch.relu, F.relu) and len(node.args) == 1
    return kind == "method" and node.target == "relu" and len(node.args) == 1 and not node.kwargs


class _PackedProgram:
    """The model's forward over the K stacked models without vmap, for chains (and adds) of common
    layers: Conv1d/2d, Linear, BatchNorm1d/2d, pooling, activations, Flatten, dropout (masks drawn
    per model in call order, as separate training draws them). Built from the model's fx graph;
    anything else raises :class:`_Unsupported` and the unit uses vmap. ``channels_last``: run 2-d
    maps channels-last (``BatchingSettings.channels_last``). ``mixed``: the activation sites where
    the models' activations differ (:mod:`._variants`): each run of rows applies its own there."""

    def __init__(self, model: nn.Module, *, channels_last: bool = False, mixed: Collection[str] = ()):
        import operator

        import torch.fx as fx

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = fx.symbolic_trace(model).graph
        except Exception as err:
            raise _Unsupported(f"fx: {_first_line(err)}") from err
        modules = dict(model.named_modules())
        self.channels_last = channels_last
        self.conv2d = False
        self.steps: list[tuple[str, Any, list[Any], dict[str, Any]]] = []
        layout: dict[fx.Node, str] = {}
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            raise _Unsupported("more than one input")
        for node in graph.nodes:
            inputs = [a for a in node.args if isinstance(a, fx.Node)]
            if any(isinstance(v, fx.Node) for v in node.kwargs.values()) or any(
                    isinstance(a, (list, tuple)) and any(isinstance(b, fx.Node) for b in a) for a in node.args):
                raise _Unsupported(f"node {node.name}: nested inputs")
            ins = [layout[a] for a in inputs]
            if node.op == "placeholder":
                layout[node] = "S"
                self.steps.append(("input", node, [], {}))
                continue
            if node.op == "output":
                if ins != ["M"]:
                    raise _Unsupported("the output is not a (batch, features) tensor per model")
                self.steps.append(("output", node, inputs, {}))
                continue
            if node.op in ("call_function", "call_method") and node.target in (operator.add, torch.add, "add"):
                if len(inputs) != 2 or len(node.args) != 2 or ins[0] != ins[1] or node.kwargs:
                    raise _Unsupported(f"node {node.name}: add of differently laid-out values")
                layout[node] = ins[0]
                self.steps.append(("add", node, inputs, {}))
                continue
            if len(inputs) != 1 or node.args[0] is not inputs[0]:
                raise _Unsupported(f"node {node.name}: not a chain of single-input ops")
            src = ins[0]
            if node.op == "call_module" and str(node.target) in mixed:
                if src not in "CM":
                    raise _Unsupported(f"module {node.target}: activations differ on the shared input")
                layout[node] = src
                self.steps.append(("mixed", node, inputs, {"name": str(node.target), "src": src}))
            elif node.op == "call_module":
                m = modules[str(node.target)]
                kind, out = self._module(m, src, str(node.target))
                layout[node] = out
                self.steps.append((kind, node, inputs, {"module": m, "name": str(node.target), "src": src}))
            elif node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS:
                layout[node] = src
                self.steps.append(("call", node, inputs, {"fn": node.target, "src": src}))
            elif node.op == "call_function" and node.target in _POOL_FUNCTIONS and src in "SC":
                layout[node] = src
                self.steps.append(("call", node, inputs, {"fn": node.target, "src": src}))
            elif node.op == "call_method" and node.target in _ELEMENTWISE_METHODS:
                layout[node] = src
                self.steps.append(("method", node, inputs, {"src": src}))
            elif (node.op, node.target) in (("call_function", torch.flatten), ("call_method", "flatten")) and \
                    tuple(node.args[1:]) in ((1,), (1, -1)) and not node.kwargs:
                layout[node] = "S" if src == "S" else "M"
                self.steps.append(("flatten", node, inputs, {"src": src}))
            else:
                raise _Unsupported(f"node {node.name}: {node.op} {getattr(node.target, '__name__', node.target)}")
        self._fuse_pooling()
        self._fuse_bn_relu()

    def _fuse_pooling(self) -> None:
        """2x2 max-pools on per-model maps run as :class:`_MaxPool2x2`, taking over a ReLU right
        before them when the pool is its only user (ReLU then runs on a quarter of the elements)."""
        for i, (kind, node, inputs, info) in enumerate(self.steps):
            if info.get("src") != "C" or not _is_pool2x2(kind, node, info):
                continue
            relu = False
            if i and self.steps[i - 1][1] is inputs[0] and len(inputs[0].users) == 1:
                before, before_node, before_inputs, before_info = self.steps[i - 1]
                if _is_relu(before, before_node, before_info) and before_info.get("src") == "C":
                    self.steps[i - 1] = ("alias", before_node, before_inputs, {})
                    relu = True
            self.steps[i] = ("pool2x2", node, inputs, {"relu": relu, "fallback": (kind, info)})

    def _fuse_bn_relu(self) -> None:
        """A ReLU right after a BatchNorm of per-model maps (its only user) runs inside it
        (:class:`~tridens.xopt._kernels.BatchNormTrain`: in place on its output, no extra map)."""
        for i, (kind, node, inputs, info) in enumerate(self.steps):
            if kind != "bn" or info["src"] != "C" or len(node.users) != 1 or i + 1 == len(self.steps):
                continue
            after, after_node, after_inputs, after_info = self.steps[i + 1]
            if after_inputs == [node] and _is_relu(after, after_node, after_info):
                self.steps[i + 1] = ("alias", after_node, after_inputs, {})
                info["relu"] = True

    def _module(self, m: nn.Module, src: str, name: str) -> tuple[str, str]:
        t = type(m)
        if t in (nn.Conv1d, nn.Conv2d) and m.padding_mode == "zeros" and src in "SC":
            self.conv2d = self.conv2d or t is nn.Conv2d
            return "conv", "C"
        if t is nn.Linear and src in "SM":
            return "linear", "M"
        if t in (nn.BatchNorm1d, nn.BatchNorm2d) and src in "CM":
            return "bn", src
        if t in _ELEMENTWISE_MODULES:
            return "apply", src
        if t in _POOL_MODULES and src in "SC":
            return "apply", src
        if t is nn.Flatten and m.start_dim == 1 and m.end_dim == -1:
            return "flatten", "S" if src == "S" else "M"
        if t in _DROPOUTS and src in "CM":
            return "dropout", src
        raise _Unsupported(f"module {name} ({t.__name__}) on a {'shared' if src == 'S' else 'per-model'} input")

    def run(self, member: "BatchedMember", x: torch.Tensor, training: bool) -> torch.Tensor:
        params, buffers, k = member.params, member.buffers, len(member.ids)
        env: dict[Any, torch.Tensor] = {}
        for kind, node, inputs, info in self.steps:
            if kind == "input":
                # channels-last: pooling, BatchNorm and grouped convolutions over K*C channels run
                # several times faster on CPU than in NCHW
                env[node] = x.contiguous(memory_format=torch.channels_last) if (
                    self.conv2d and self.channels_last and x.dim() == 4) else x
                continue
            if kind == "output":
                return env[inputs[0]]
            if kind == "add":
                env[node] = env[inputs[0]] + env[inputs[1]]
                continue
            if kind == "alias":  # a ReLU folded into the pooling after it
                env[node] = env[inputs[0]]
                continue
            if kind == "pool2x2":
                env[node] = self._pool2x2(node, env[inputs[0]], info)
                continue
            v = env[inputs[0]]
            if kind == "conv":
                m, name = info["module"], info["name"]
                w = params[f"{name}.weight"]
                w = w.reshape(k * w.shape[1], *w.shape[2:])
                b = params.get(f"{name}.bias")
                b = None if b is None else b.reshape(-1)
                shared = v.shape[1] == m.in_channels and v.dim() == w.dim()
                fn = F.conv1d if type(m) is nn.Conv1d else F.conv2d
                if fn is F.conv2d and self.channels_last:  # a channels-last weight gives a channels-last output
                    w = w.contiguous(memory_format=torch.channels_last)
                groups = m.groups if shared else k * m.groups
                if not shared and v.shape[1] != k * m.in_channels:
                    raise _Unsupported(f"{name}: {v.shape[1]} input channels")
                out = fn(v, w, b, m.stride, m.padding, m.dilation, groups)
                if fn is F.conv2d and self.channels_last:  # (a 1-channel input does not say its format)
                    out = out.contiguous(memory_format=torch.channels_last)
                env[node] = out
            elif kind == "linear":
                name = info["name"]
                w, b = params[f"{name}.weight"], params.get(f"{name}.bias")
                # Outputs are (K, B, O) views of contiguous (K, O, B) tensors: activations and
                # dropout then run on contiguous memory, the next Linear is a plain bmm and a
                # classifier's cross entropy runs over the class dim of (K, C, B) (vectorized
                # along B; over rows of 10 classes it is per-row bound), which roughly halves a
                # fused MLP step (BENCHMARKS.md)
                if v.dim() == 2 and info["src"] == "S":  # shared (B, F): one matmul with K*O outputs
                    wf = w.reshape(-1, w.shape[-1])
                    out = torch.mm(wf, v.t()) if b is None else torch.addmm(b.reshape(-1, 1), wf, v.t())
                    env[node] = out.view(k, w.shape[1], v.shape[0]).transpose(1, 2)
                elif v.dim() == 3 and v.shape[0] == k:
                    vt = v.transpose(1, 2)
                    out = torch.bmm(w, vt) if b is None else torch.baddbmm(b.unsqueeze(2), w, vt)
                    env[node] = out.transpose(1, 2)
                else:
                    raise _Unsupported(f"{name}: Linear on a {v.dim()}-d input")
            elif kind == "bn":
                env[node] = self._batch_norm(info["module"], info["name"], v, params, buffers, k, training,
                                             info["src"] == "M", info.get("relu", False))
            elif kind == "apply":
                env[node] = info["module"](v)
            elif kind == "mixed":
                env[node] = self._mixed(member.site_runs(info["name"]), v, info["src"], k)
            elif kind == "call":
                env[node] = info["fn"](v, *node.args[1:], **node.kwargs)
            elif kind == "method":
                env[node] = getattr(v, node.target)(*node.args[1:], **node.kwargs)
            elif kind == "flatten":
                src = info["src"]
                env[node] = v.flatten(1) if src == "S" else v.flatten(2) if src == "M" else \
                    v.reshape(v.shape[0], k, -1).transpose(0, 1)
            elif kind == "dropout":
                env[node] = member._packed_dropout(v, info["name"], info["src"]) if training else v
        raise RuntimeError("the packed program has no output")  # pragma: no cover

    @staticmethod
    def _mixed(runs: Sequence[tuple[int, int, nn.Module]], v: torch.Tensor, src: str, k: int) -> torch.Tensor:
        """Each run of rows' own activation on its slice of ``v``: "M" ``(K, B, F)`` along the
        model dim (kept a view of a ``(K, F, B)`` tensor where ``v`` is one, as Linear makes them),
        "C" ``(B, K*C, ...)`` in blocks of C channels."""
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
        c = v.shape[1] // k
        blocks = v.split([(end - start) * c for start, end, _ in runs], dim=1)
        return torch.cat([m(part) for part, (_, _, m) in zip(blocks, runs)], dim=1)

    @staticmethod
    def _pool2x2(node: Any, v: torch.Tensor, info: Mapping[str, Any]) -> torch.Tensor:
        if v.dim() == 4 and v.shape[-1] % 2 == 0 and v.shape[-2] % 2 == 0 and v.is_contiguous():
            if torch.is_grad_enabled() and v.requires_grad:
                return _MaxPool2x2.apply(v, info["relu"])
            # validation: the same maxima without the gradient-routing masks (a third of the passes)
            b, c, h, w = v.shape
            pairs = v.view(b, c, h, w // 2, 2)
            rows = torch.maximum(pairs[..., 0], pairs[..., 1]).view(b, c, h // 2, 2, w // 2)
            out = torch.maximum(rows[:, :, :, 0], rows[:, :, :, 1])
            return out.clamp_min_(0) if info["relu"] else out
        kind, fallback = info["fallback"]  # odd sizes, channels-last: the module/function itself
        if info["relu"]:
            v = F.relu(v)
        return fallback["module"](v) if kind == "apply" else fallback["fn"](v, *node.args[1:], **node.kwargs)

    @staticmethod
    def _batch_norm(m: nn.Module, name: str, v: torch.Tensor, params: Mapping[str, torch.Tensor],
                    buffers: Mapping[str, torch.Tensor], k: int, training: bool, model_major: bool,
                    relu: bool = False) -> torch.Tensor:
        weight, bias = params.get(f"{name}.weight"), params.get(f"{name}.bias")
        mean, var = buffers.get(f"{name}.running_mean"), buffers.get(f"{name}.running_var")
        tracked = buffers.get(f"{name}.num_batches_tracked")
        factor = 0.0 if m.momentum is None else m.momentum
        if training and m.track_running_stats and tracked is not None:
            tracked.add_(1)
            if m.momentum is None:
                factor = 1.0 / float(tracked[0])
        use_batch = training or (mean is None and var is None)
        if model_major and v.dim() != 3:
            raise _Unsupported(f"{name}: BatchNorm on a {v.dim() - 1}-d per-model input")
        if use_batch and not model_major and batch_norm_supported(v) and batch_norm_pays(v):
            # the native NCHW kernel is per-element bound on packed small maps, slower forward
            return BatchNormTrain.apply(v, None if weight is None else weight.reshape(-1),
                                        None if bias is None else bias.reshape(-1),
                                        None if mean is None or not training else mean.view(-1),
                                        None if var is None or not training else var.view(-1), factor, m.eps, relu)
        x = v.transpose(0, 1).reshape(v.shape[1], -1) if model_major else v
        out = F.batch_norm(x, None if mean is None else mean.view(-1), None if var is None else var.view(-1),
                           None if weight is None else weight.reshape(-1), None if bias is None else bias.reshape(-1),
                           use_batch, factor, m.eps)
        if model_major:
            return out.view(v.shape[1], k, -1).transpose(0, 1)
        return F.relu(out) if relu else out  # (eval mode with running statistics, CUDA: native kernels)
