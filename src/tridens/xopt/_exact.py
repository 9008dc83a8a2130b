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

from typing import Any, Mapping

import torch
import torch.nn.functional as F

__all__ = ["conv_per_model", "linear_per_model"]


def conv_per_model(v: torch.Tensor, params: Mapping[str, torch.Tensor], k: int, *, name: str, dims: int,
                   in_channels: int, stride: Any, padding: Any, dilation: Any, groups: int,
                   channels_last: bool = False) -> torch.Tensor:
    """Conv1d/2d ``name`` of each of the K models on the shared input ``(B, C, ...)`` or on packed
    maps ``(B, K*C, ...)``; the outputs packed ``(B, K*O, ...)``."""
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
    fn = F.conv2d if dims == 2 else F.conv1d
    outs = [fn(x, w.contiguous(memory_format=fmt), b, stride, padding, dilation, groups)
            for x, w, b in zip(inputs, ws, bs)]
    return torch.cat(outs, dim=1).contiguous(memory_format=fmt)


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
