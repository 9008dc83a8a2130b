"""Per-model kernels of the exact grouped program (``BatchingSettings(exact=True)``): a
convolution or Linear of K stacked models as K calls of the separate model's kernel, each on that
model's rows made contiguous (the layout the separate model's tensors have), so every value and
gradient is the separate model's bit for bit.

Why per model: a grouped convolution, one convolution with K*O outputs or a batched matmul sums
the same products in another order than K ordinary ones (oneDNN and BLAS block their reductions
by the shapes they see): float32 values ~1e-6 relative apart, and float64 weight gradients of a
K*O convolution an ulp apart. Training amplifies such differences -- an adaptive optimizer turns
a rounding-noise gradient (a bias before BatchNorm) into an lr-sized step -- so the fused model
would not be the model separate training gives.

>>> import torch, torch.nn as nn
>>> conv = nn.Conv2d(1, 4, 3)
>>> params = {"c.weight": torch.stack([conv.weight.detach()] * 2), "c.bias": torch.stack([conv.bias.detach()] * 2)}
>>> x = torch.randn(5, 1, 8, 8)
>>> out = conv_per_model(x, params, 2, name="c", dims=2, in_channels=1, stride=1, padding=0, dilation=1, groups=1)
>>> out.shape, torch.equal(out[:, :4], conv(x))
(torch.Size([5, 8, 6, 6]), True)
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

__all__ = ["conv_per_model", "conv_maps_per_model", "conv_rows_per_model", "linear_per_model",
           "batch_norm_per_model", "batch_norm_maps_per_model"]


def conv_per_model(v: torch.Tensor, params: Mapping[str, torch.Tensor], k: int, *, name: str, dims: int,
                   in_channels: int, stride: Any, padding: Any, dilation: Any, groups: int,
                   channels_last: bool = False) -> torch.Tensor:
    """Conv1d/2d ``name`` of each of the K models on the shared input ``(B, C, ...)`` or on packed
    maps ``(B, K*C, ...)``; the outputs packed ``(B, K*O, ...)``."""
    fmt = torch.channels_last if channels_last and dims == 2 else torch.contiguous_format
    outs = conv_maps_per_model(v, params, k, name=name, dims=dims, in_channels=in_channels, stride=stride,
                               padding=padding, dilation=dilation, groups=groups, channels_last=channels_last)
    return torch.cat(outs, dim=1).contiguous(memory_format=fmt)


def conv_maps_per_model(v: torch.Tensor, params: Mapping[str, torch.Tensor], k: int, *, name: str, dims: int,
                        in_channels: int, stride: Any, padding: Any, dilation: Any, groups: int,
                        channels_last: bool = False) -> list[torch.Tensor]:
    """:func:`conv_per_model`'s K outputs, one map per model (not packed)."""
    ws = params[f"{name}.weight"].unbind(0)
    bias = params.get(f"{name}.bias")
    bs = [None] * k if bias is None else list(bias.unbind(0))
    fmt = torch.channels_last if channels_last and dims == 2 else torch.contiguous_format
    if v.shape[1] == in_channels and v.dim() == ws[0].dim():
        inputs = [v] * k
    elif v.shape[1] == k * in_channels:
        inputs = [x.contiguous(memory_format=fmt) for x in v.split(in_channels, dim=1)]
    else:
        raise ValueError(f"{name}: {v.shape[1]} input channels, expected {in_channels} or {k * in_channels}")
    return _convs(inputs, ws, bs, dims=dims, stride=stride, padding=padding, dilation=dilation, groups=groups,
                  channels_last=fmt is torch.channels_last)


def conv_rows_per_model(v: torch.Tensor, params: Mapping[str, torch.Tensor], k: int, *, name: str, dims: int,
                        shared: bool, stride: Any, padding: Any, dilation: Any, groups: int,
                        channels_last: bool = False) -> list[torch.Tensor]:
    """Conv1d/2d ``name`` of each of the K models on the shared input (``shared``) or on maps
    stacked along the batch, ``(K*B, C, ...)`` with model k's examples at rows ``k*B:(k+1)*B``:
    each model's convolution on its rows as they lie (views: a slice of the batch of a contiguous
    or channels-last map is laid out as the separate model's map). The K outputs ``(B, O, ...)``."""
    ws = params[f"{name}.weight"].unbind(0)
    bias = params.get(f"{name}.bias")
    bs = [None] * k if bias is None else list(bias.unbind(0))
    if shared:
        inputs: Sequence[torch.Tensor] = [v] * k
    elif v.shape[0] % k:
        raise ValueError(f"{name}: {v.shape[0]} rows do not stack {k} models' batches")
    else:
        inputs = v.split(v.shape[0] // k)
    return _convs(inputs, ws, bs, dims=dims, stride=stride, padding=padding, dilation=dilation, groups=groups,
                  channels_last=channels_last and dims == 2)


def _convs(inputs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor], bs: Sequence[torch.Tensor | None], *,
           dims: int, stride: Any, padding: Any, dilation: Any, groups: int,
           channels_last: bool) -> list[torch.Tensor]:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if fmt is torch.channels_last:
        # the strides ``Module.to(memory_format=torch.channels_last)`` gives (a weight with one
        # input channel is channels-last contiguous either way, but oneDNN picks its kernel by strides)
        ws = tuple(w.clone(memory_format=fmt) for w in ws)
    fn = F.conv2d if dims == 2 else F.conv1d
    return [fn(x, w, b, stride, padding, dilation, groups) for x, w, b in zip(inputs, ws, bs)]


def linear_per_model(v: torch.Tensor, params: Mapping[str, torch.Tensor], k: int, *, name: str,
                     src: str) -> torch.Tensor:
    """Linear ``name`` of each of the K models on a shared ``(B, F)`` input ("S") or on
    ``(K, B, F)`` ("M"); the outputs ``(K, B, O)``, contiguous."""
    ws = params[f"{name}.weight"].unbind(0)
    bias = params.get(f"{name}.bias")
    bs = [None] * k if bias is None else list(bias.unbind(0))
    if v.dim() == 2 and src == "S":
        return torch.stack([F.linear(v, w, b) for w, b in zip(ws, bs)])
    if v.dim() == 3 and v.shape[0] == k:
        return torch.stack([F.linear(x.contiguous(), w, b) for x, w, b in zip(v.unbind(0), ws, bs)])
    raise ValueError(f"{name}: Linear on a {v.dim()}-d input")


def batch_norm_per_model(v: torch.Tensor, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                         k: int, *, name: str, training: bool, momentum: float, eps: float,
                         relu: bool = False) -> torch.Tensor:
    """BatchNorm2d ``name`` of each of the K models on packed channels-last maps ``(B, K*C, H, W)``,
    each on its own channels made a channels-last map of C channels (the separate model's layout),
    the running statistics updated through views of the stacked buffers; the outputs packed
    (``relu``: a ReLU after it folded in).

    Why per model: the native channels-last kernel computes a channel's input gradient with
    different rounding depending on where the channel falls among the vector lanes of the
    ``(N*H*W, channels)`` rows it sweeps, so BatchNorm over K*C channels is not K BatchNorms
    over C bit for bit (forward and parameter gradients are; the NCHW kernel is in every part)."""
    maps = [x.contiguous(memory_format=torch.channels_last) for x in v.split(v.shape[1] // k, dim=1)]
    return torch.cat(batch_norm_maps_per_model(maps, params, buffers, name=name, training=training,
                                               momentum=momentum, eps=eps, relu=relu), dim=1)


def batch_norm_maps_per_model(maps: Sequence[torch.Tensor], params: Mapping[str, torch.Tensor],
                              buffers: Mapping[str, torch.Tensor], *, name: str, training: bool, momentum: float,
                              eps: float, relu: bool = False, regrade: bool = True) -> list[torch.Tensor]:
    """:func:`batch_norm_per_model` of K maps, one per model; the K outputs. ``regrade``: hand
    each BatchNorm its gradient channels-last contiguous (for maps that are slices of packed
    channels, whose gradients arrive strided); maps that are rows of a batch-stacked map get
    theirs laid out as the separate model's already."""
    weight, bias = params.get(f"{name}.weight"), params.get(f"{name}.bias")
    mean, var = buffers.get(f"{name}.running_mean"), buffers.get(f"{name}.running_var")
    use_batch = training or (mean is None and var is None)
    outs = []
    for i, x in enumerate(maps):
        out = F.batch_norm(x, None if mean is None else mean[i], None if var is None else var[i],
                           None if weight is None else weight[i], None if bias is None else bias[i], use_batch,
                           momentum, eps)
        if regrade:
            out = _channels_last_grad(out)
        outs.append(F.relu(out) if relu else out)
    return outs


class _ChannelsLastGrad(torch.autograd.Function):
    """The identity, whose backward hands on the gradient as a channels-last contiguous map: a
    slice of the packed gradient (the backward of ``cat``) is strided, and the native BatchNorm
    backward takes another code path, with other rounding, for a strided gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous(memory_format=torch.channels_last)


def _channels_last_grad(x: torch.Tensor) -> torch.Tensor:
    return _ChannelsLastGrad.apply(x) if x.requires_grad else x  # type: ignore[no-any-return]
