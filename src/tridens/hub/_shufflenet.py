"""ShuffleNet's space of Single Path One-Shot (Guo et al. 2020): ShuffleNetV2 stages whose every
block is a ``tnn.LayerChoice`` (label ``layer_{i}``) of a ShuffleNetV2 unit with a 3x3, 5x5 or 7x7
depthwise kernel, or an Xception-style unit of three 3x3 depthwise convolutions.

>>> space = ShuffleNetSpace(num_labels=10, stage_repeats=(1, 1, 1, 1))   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .. import nn as tnn
from ..errors import InvalidSpace

__all__ = ["ShuffleNetSpace", "ShuffleNetBlock", "channel_shuffle"]


def channel_shuffle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``x``'s channels into the even and the odd ones (ShuffleNetV2's shuffle and split)."""
    b, c, h, w = x.shape
    x = x.reshape(b * c // 2, 2, h * w).permute(1, 0, 2).reshape(2, b, c // 2, h, w)
    return x[0], x[1]


class ShuffleNetBlock(nn.Module):
    """A ShuffleNetV2 unit from ``c_in`` to ``c_out`` channels with a ``kernel`` depthwise
    convolution (``sequence="dpd"``: 1x1, depthwise, 1x1) or Xception's three depthwise-separable
    3x3 convolutions (``sequence="dpdpdp"``). Stride 2 processes the whole input in two branches."""

    def __init__(self, c_in: int, c_out: int, mid: int, kernel: int, stride: int, sequence: str = "dpd"):
        super().__init__()
        self.stride = stride
        pad = kernel // 2
        branch_in = c_in if stride == 2 else c_in // 2
        out_main = c_out - branch_in if stride == 2 else c_out - c_in // 2
        if sequence == "dpd":
            self.main = nn.Sequential(
                nn.Conv2d(branch_in, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=False),
                nn.Conv2d(mid, mid, kernel, stride, pad, groups=mid, bias=False), nn.BatchNorm2d(mid),
                nn.Conv2d(mid, out_main, 1, bias=False), nn.BatchNorm2d(out_main), nn.ReLU(inplace=False))
        else:
            layers: list[nn.Module] = []
            c = branch_in
            for i, (s, c_next) in enumerate(((stride, mid), (1, mid), (1, out_main))):
                layers += [nn.Conv2d(c, c, 3, s, 1, groups=c, bias=False), nn.BatchNorm2d(c),
                           nn.Conv2d(c, c_next, 1, bias=False), nn.BatchNorm2d(c_next), nn.ReLU(inplace=False)]
                c = c_next
            self.main = nn.Sequential(*layers)
        if stride == 2:
            self.proj = nn.Sequential(
                nn.Conv2d(c_in, c_in, kernel, 2, pad, groups=c_in, bias=False), nn.BatchNorm2d(c_in),
                nn.Conv2d(c_in, c_in, 1, bias=False), nn.BatchNorm2d(c_in), nn.ReLU(inplace=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 2:
            return torch.cat([self.proj(x), self.main(x)], dim=1)
        kept, processed = channel_shuffle(x)
        return torch.cat([kept, self.main(processed)], dim=1)


class ShuffleNetSpace(tnn.ModelSpace):
    """SPOS' ShuffleNet space: a 3x3 stem, four stages of ``stage_repeats`` blocks of
    ``stage_out_channels`` (each block a choice of ``choice3``, ``choice5``, ``choice7``,
    ``xception``), a 1x1 convolution, global pooling and a classifier. SPOS' paper setting is
    ``stage_repeats=(4, 4, 8, 4)``, ``stage_out_channels=(16, 64, 160, 320, 640, 1024)``.

    >>> model = ShuffleNetSpace(num_labels=10).freeze({f"layer_{i}": "choice3" for i in range(20)})  # doctest: +SKIP
    """

    labels_unconditional = True  # every label exists in every model

    def __init__(self, num_labels: int = 1000, channel_search: bool = False, affine: bool = False,
                 *, stage_repeats: Sequence[int] = (4, 4, 8, 4),
                 stage_out_channels: Sequence[int] = (16, 64, 160, 320, 640, 1024), in_channels: int = 3):
        super().__init__()
        if channel_search:
            raise InvalidSpace("ShuffleNetSpace(channel_search=True) (a choice of each block's middle width) is not "
                               "provided; search the blocks with channel_search=False, or write the width as "
                               "td.choice in a copy of ShuffleNetBlock")
        c = stage_out_channels[0]
        self.stem = nn.Sequential(nn.Conv2d(in_channels, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=False))
        blocks: list[nn.Module] = []
        index = 0
        for stage, repeats in enumerate(stage_repeats):
            c_out = stage_out_channels[stage + 1]
            for i in range(repeats):
                stride = 2 if i == 0 else 1
                c_in = c if i == 0 else c_out
                mid = c_out // 2
                candidates = {
                    "choice3": lambda c_in=c_in, s=stride: ShuffleNetBlock(c_in, c_out, mid, 3, s),
                    "choice5": lambda c_in=c_in, s=stride: ShuffleNetBlock(c_in, c_out, mid, 5, s),
                    "choice7": lambda c_in=c_in, s=stride: ShuffleNetBlock(c_in, c_out, mid, 7, s),
                    "xception": lambda c_in=c_in, s=stride: ShuffleNetBlock(c_in, c_out, mid, 3, s, "dpdpdp"),
                }
                blocks.append(tnn.LayerChoice(candidates, label=f"layer_{index}"))
                index += 1
            c = c_out
        self.features = nn.Sequential(*blocks)
        last = stage_out_channels[-1]
        self.conv_last = nn.Sequential(nn.Conv2d(c, last, 1, bias=False), nn.BatchNorm2d(last), nn.ReLU(inplace=False))
        self.classifier = nn.Linear(last, num_labels, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_last(self.features(self.stem(x)))
        return self.classifier(x.mean((2, 3)))
