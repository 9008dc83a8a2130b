"""Per-model kernels of the exact grouped program (``BatchingSettings(exact=True)``): a
convolution or Linear of K stacked models as K calls of the separate model's kernel, each on that
model's rows made contiguous (the layout the separate model's tensors have), so every value and
gradient is the separate model's bit for bit.

Why per model: a grouped convolution, one convolution with K*O outputs or a batched matmul sums
the same products in another order than K ordinary ones (oneDNN and BLAS block their reductions
by the shapes they see): float32 values ~1e-6 relative apart, and float64 weight gradients of a
K*O convolution an ulp apart. Training amplifies such differences -- an adaptive optimizer turns
a rounding-noise gradient (a bias before BatchNorm) into an lr-sized step -- so the fused model
would not be the model separate training gives. A batched matmul does sum each model's products
as its own matmul at many shapes (MKL runs the same kernel per matrix), but not at all: Linear
is batched only at shapes where :class:`BatchedLinear` was checked to be exact.

>>> import torch, torch.nn as nn
>>> conv = nn.Conv2d(1, 4, 3)
>>> params = {"c.weight": torch.stack([conv.weight.detach()] * 2), "c.bias": torch.stack([conv.bias.detach()] * 2)}
>>> x = torch.randn(5, 1, 8, 8)
>>> out = conv_per_model(x, params, 2, name="c", dims=2, in_channels=1, stride=1, padding=0, dilation=1, groups=1)
>>> out.shape, torch.equal(out[:, :4], conv(x))
(torch.Size([5, 8, 6, 6]), True)
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

__all__ = ["BatchedLinear", "conv_per_model", "conv_maps_per_model", "conv_rows_per_model", "linear_per_model",
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
    ``(K, B, F)`` ("M"); the outputs ``(K, B, O)``, contiguous. One batched matmul where that is
    the K Linears bit for bit at this shape (:class:`BatchedLinear`), else K Linears."""
    weight, bias = params[f"{name}.weight"], params.get(f"{name}.bias")
    if v.dim() == 2 and src == "S":
        inputs = v.expand(k, *v.shape)
    elif v.dim() == 3 and v.shape[0] == k:
        inputs = v.contiguous()
    else:
        raise ValueError(f"{name}: Linear on a {v.dim()}-d input")
    device = weight.device.type
    if (v.dtype == weight.dtype and not (v.dim() == 2 and v.requires_grad) and not torch.is_autocast_enabled(device)
            and BatchedLinear.is_exact(k, inputs.shape[1], weight.shape[2], weight.shape[1], bias is not None,
                                       v.dim() == 2, weight.dtype, device, torch.get_num_threads())):
        return BatchedLinear.apply(inputs, weight, bias)
    ws = weight.unbind(0)
    bs = [None] * k if bias is None else list(bias.unbind(0))
    if v.dim() == 2:
        return torch.stack([F.linear(v, w, b) for w, b in zip(ws, bs)])
    return torch.stack([F.linear(x, w, b) for x, w, b in zip(inputs.unbind(0), ws, bs)])


class BatchedLinear(torch.autograd.Function):
    """K Linears as batched matmuls: ``(K, B, F)`` inputs, ``(K, O, F)`` weights, ``(K, O)``
    biases or None; the outputs ``(K, B, O)``. The backward takes the output gradient contiguous
    (each model's rows as the separate model's Linear gets them) and computes what
    ``F.linear``'s backward computes per model, batched: ``g @ W``, ``g^T @ x`` and the sum of
    ``g`` over the batch (a sum over a strided layout adds in another order).

    Whether that is each model's own ``F.linear`` bit for bit depends on the shape: BLAS picks its
    kernel and its split of a reduction over threads by the shapes it sees (a long reduction split
    over two threads in a single matmul, not in a batched one; a tiny batched matmul summed by a
    plain loop). :meth:`is_exact` checks it per shape, dtype, device and thread count, once per
    process, on random values (a different order of a reduction shows in most elements).

    >>> BatchedLinear.is_exact(4, 32, 64, 16, True, False, torch.float64, "cpu", torch.get_num_threads())
    True
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias = bias is not None
        if bias is None:
            return torch.bmm(x, weight.transpose(1, 2))
        return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(1) if ctx.bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b

    @staticmethod
    @functools.lru_cache(maxsize=None)  # a fact of this torch build, device and thread count, per shape
    def is_exact(k: int, batch: int, in_features: int, out_features: int, bias: bool, shared: bool,
                 dtype: torch.dtype, device: str, threads: int) -> bool:
        """Whether :class:`BatchedLinear` gives each model's output and gradients (input, weight,
        bias) bit for bit as its own ``F.linear`` does, at this shape, on a shared ``(B, F)``
        input (``shared``) or one per model, at the current thread count (``threads``: the cache
        key)."""
        gen = torch.Generator().manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)

        x = rand(batch, in_features) if shared else rand(k, batch, in_features)
        w, b = rand(k, out_features, in_features), rand(k, out_features) if bias else None
        grad = rand(k, batch, out_features)
        with torch.enable_grad():
            xs, ws = x.clone().requires_grad_(not shared), w.clone().requires_grad_()
            bs = b.clone().requires_grad_() if b is not None else None
            together = BatchedLinear.apply(xs.expand(k, *x.shape) if shared else xs, ws, bs)
            together.backward(grad)
            for m in range(k):
                xm = (x if shared else x[m]).clone().requires_grad_(not shared)
                wm = w[m].clone().requires_grad_()
                bm = b[m].clone().requires_grad_() if b is not None else None
                alone = F.linear(xm, wm, bm)
                alone.backward(grad[m])
                # (the fused tensor, its row m's counterpart from the model alone)
                pairs = [(together, alone), (ws.grad, wm.grad)]
                if bs is not None and bm is not None:
                    pairs.append((bs.grad, bm.grad))
                if not shared:
                    pairs.append((xs.grad, xm.grad))
                if not together.is_contiguous() or any(
                        a is None or b is None or not torch.equal(a[m], b) for a, b in pairs):
                    return False
        return True


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
