"""The operations of the NASNet-family cell spaces (DARTS, NASNet, ENAS, AmoebaNet, PNAS), as the
NDS study (Radosavovic et al., "On Network Design Spaces for Visual Recognition") defines them.

Every operation keeps the number of channels; ``stride=2`` halves the resolution.

>>> from tridens.hub import OPS
>>> OPS["sep_conv_3x3"](16, 1)(torch.zeros(1, 16, 8, 8)).shape   # doctest: +SKIP
torch.Size([1, 16, 8, 8])
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

__all__ = ["OPS", "Zero", "FactorizedReduce", "ReLUConvBN", "SepConv", "DilConv", "DilSepConv", "ConvPair"]


class Zero(nn.Module):
    """The ``none`` operation: zeros shaped as the (strided) input."""

    def __init__(self, stride: int = 1):
        super().__init__()
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            return x.mul(0.0)
        return x[:, :, ::self.stride, ::self.stride].mul(0.0)


class FactorizedReduce(nn.Module):
    """Halve the resolution with two 1x1 convolutions of stride 2, the second shifted by one pixel."""

    def __init__(self, c_in: int, c_out: int, affine: bool = True):
        super().__init__()
        self.relu = nn.ReLU(inplace=False)
        self.conv_1 = nn.Conv2d(c_in, c_out // 2, 1, stride=2, padding=0, bias=False)
        self.conv_2 = nn.Conv2d(c_in, c_out - c_out // 2, 1, stride=2, padding=0, bias=False)
        self.bn = nn.BatchNorm2d(c_out, affine=affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(x)
        shifted = nn.functional.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        return self.bn(torch.cat([self.conv_1(x), self.conv_2(shifted)], dim=1))


class ReLUConvBN(nn.Sequential):
    """ReLU, convolution, batch norm."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, padding: int = 0, affine: bool = True):
        super().__init__(nn.ReLU(inplace=False), nn.Conv2d(c_in, c_out, kernel, stride, padding, bias=False),
                         nn.BatchNorm2d(c_out, affine=affine))


class DilConv(nn.Sequential):
    """ReLU, dilated depthwise convolution, pointwise convolution, batch norm."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, padding: int, dilation: int,
                 affine: bool = True):
        super().__init__(nn.ReLU(inplace=False),
                         nn.Conv2d(c_in, c_in, kernel, stride, padding, dilation=dilation, groups=c_in, bias=False),
                         nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out, affine=affine))


class SepConv(nn.Sequential):
    """Two depthwise-separable convolutions (the first strided)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, padding: int, affine: bool = True):
        super().__init__(nn.ReLU(inplace=False),
                         nn.Conv2d(c_in, c_in, kernel, stride, padding, groups=c_in, bias=False),
                         nn.Conv2d(c_in, c_in, 1, bias=False), nn.BatchNorm2d(c_in, affine=affine),
                         nn.ReLU(inplace=False),
                         nn.Conv2d(c_in, c_in, kernel, 1, padding, groups=c_in, bias=False),
                         nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out, affine=affine))


class DilSepConv(nn.Sequential):
    """Two dilated depthwise-separable convolutions (the first strided)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, padding: int, dilation: int,
                 affine: bool = True):
        super().__init__(nn.ReLU(inplace=False),
                         nn.Conv2d(c_in, c_in, kernel, stride, padding, dilation=dilation, groups=c_in, bias=False),
                         nn.Conv2d(c_in, c_in, 1, bias=False), nn.BatchNorm2d(c_in, affine=affine),
                         nn.ReLU(inplace=False),
                         nn.Conv2d(c_in, c_in, kernel, 1, padding, dilation=dilation, groups=c_in, bias=False),
                         nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out, affine=affine))


class ConvPair(nn.Sequential):
    """ReLU, a ``1 x k`` then a ``k x 1`` convolution, batch norm (NASNet's ``conv_7x1_1x7``)."""

    def __init__(self, channels: int, kernel: int, stride: int, affine: bool = True):
        pad = kernel // 2
        super().__init__(nn.ReLU(inplace=False),
                         nn.Conv2d(channels, channels, (1, kernel), stride=(1, stride), padding=(0, pad), bias=False),
                         nn.Conv2d(channels, channels, (kernel, 1), stride=(stride, 1), padding=(pad, 0), bias=False),
                         nn.BatchNorm2d(channels, affine=affine))


def _skip(c: int, stride: int, affine: bool) -> nn.Module:
    return nn.Identity() if stride == 1 else FactorizedReduce(c, c, affine=affine)


OpFactory = Callable[[int, int, bool], nn.Module]

#: name -> ``factory(channels, stride, affine)``.
OPS: dict[str, OpFactory] = {
    "none": lambda c, s, a: Zero(s),
    "avg_pool_3x3": lambda c, s, a: nn.AvgPool2d(3, stride=s, padding=1, count_include_pad=False),
    "avg_pool_5x5": lambda c, s, a: nn.AvgPool2d(5, stride=s, padding=2, count_include_pad=False),
    "max_pool_3x3": lambda c, s, a: nn.MaxPool2d(3, stride=s, padding=1),
    "max_pool_5x5": lambda c, s, a: nn.MaxPool2d(5, stride=s, padding=2),
    "max_pool_7x7": lambda c, s, a: nn.MaxPool2d(7, stride=s, padding=3),
    "skip_connect": _skip,
    "conv_1x1": lambda c, s, a: ReLUConvBN(c, c, 1, s, 0, affine=a),
    "conv_3x3": lambda c, s, a: ReLUConvBN(c, c, 3, s, 1, affine=a),
    "conv_3x1_1x3": lambda c, s, a: ConvPair(c, 3, s, affine=a),
    "conv_7x1_1x7": lambda c, s, a: ConvPair(c, 7, s, affine=a),
    "dil_conv_3x3": lambda c, s, a: DilConv(c, c, 3, s, 2, 2, affine=a),
    "dil_conv_5x5": lambda c, s, a: DilConv(c, c, 5, s, 4, 2, affine=a),
    "sep_conv_3x3": lambda c, s, a: SepConv(c, c, 3, s, 1, affine=a),
    "sep_conv_5x5": lambda c, s, a: SepConv(c, c, 5, s, 2, affine=a),
    "sep_conv_7x7": lambda c, s, a: SepConv(c, c, 7, s, 3, affine=a),
    "dil_sep_conv_3x3": lambda c, s, a: DilSepConv(c, c, 3, s, 2, 2, affine=a),
}
