"""Hand-written CPU kernels of the grouped-kernel batching engine (:mod:`tridens.xopt._batching`).

Written with ordinary torch ops, because the native NCHW kernels they replace are per-element bound
on the small feature maps of many packed models (e.g. ``(64, 16*16, 8, 8)`` for 16 digits CNNs):
the native training BatchNorm forward reduces each channel's ``N`` planes of ``H*W`` values one
plane at a time with double accumulation, where a few vectorized passes over the whole map take a
fraction of that time (BENCHMARKS.md, "Figures behind choices in the code").
"""

from __future__ import annotations

from typing import Any

import torch


def batch_norm_supported(x: torch.Tensor) -> bool:
    """Whether :class:`BatchNormTrain` takes ``x``: a contiguous CPU float map ``(N, C, *spatial)``
    with at least one spatial dimension and more than one value per channel."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() >= 3 and \
        x.is_contiguous() and x.numel() > x.shape[1]


def batch_norm_pays(x: torch.Tensor) -> bool:
    """Whether :class:`BatchNormTrain` is faster than the native kernels on ``x`` (forward +
    backward): on maps of >= 256 Ki values with planes of >= 32 values; on larger maps the two
    are level, and on small maps or planes its extra ops cost more than the native per-plane loops
    (the thresholds come from the timings in BENCHMARKS.md)."""
    return x.numel() >= 1 << 18 and x.numel() // (x.shape[0] * x.shape[1]) >= 32


class BatchNormTrain(torch.autograd.Function):
    """Training-mode ``F.batch_norm`` over dim 1 of a contiguous NCHW map (batch statistics, the
    running statistics updated in place as ``nn.BatchNorm`` does), optionally followed by ReLU.

    The forward computes the statistics as vectorized float sums over each plane (``H*W``
    values) followed by float64 sums over the batch, the variance from ``x - mean`` (two-pass):
    as accurate as the native kernel's double accumulation (~1e-7 relative, the same as native
    against a float64 reference) and faster on packed small maps, where the native forward loops
    plane by plane. The backward is the native kernel
    (``native_batch_norm_backward`` with the saved mean and ``1/sqrt(var + eps)``): a hand-written
    one with the same number of passes was no faster. ReLU runs in place on the output and its
    mask comes from the output in backward (exact: the gradient is zero where the output is 0):
    a ReLU after the BatchNorm costs no map of its own."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
                eps: float, relu: bool) -> torch.Tensor:
        n, c = x.shape[0], x.shape[1]
        count = x.numel() // c
        planes = x.view(n, c, -1)
        mean = planes.sum(2).sum(0, dtype=torch.float64).div_(count)
        centred = planes - mean.to(x.dtype).view(1, c, 1)
        var = torch.linalg.vecdot(centred, centred).sum(0, dtype=torch.float64).div_(count)
        invstd = var.add(eps).rsqrt_()
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.copy_(running_mean.double().mul_(1 - momentum).add_(mean, alpha=momentum))
                unbiased = var * (count / (count - 1))
                running_var.copy_(running_var.double().mul_(1 - momentum).add_(unbiased, alpha=momentum))
        invstd = invstd.to(x.dtype)
        alpha = invstd if weight is None else invstd * weight
        # (x - mean) * alpha + bias: the native x * alpha + (bias - mean * alpha), up to rounding
        out = centred * alpha.view(1, c, 1)
        if bias is not None:
            out += bias.view(1, c, 1)
        if relu:
            out.clamp_min_(0)
        ctx.save_for_backward(x, mean.to(x.dtype), invstd, weight, out if relu else None)
        ctx.relu, ctx.has_bias, ctx.eps = relu, bias is not None, eps
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, invstd, weight, out = ctx.saved_tensors
        if ctx.relu:
            grad = torch.ops.aten.threshold_backward(grad, out.view(grad.shape), 0)
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                ctx.has_bias and ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(grad, x, weight, None, None, mean, invstd, True,
                                                               ctx.eps, mask)
        return gx if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None, None, None, None, None, None
