"""Mobile spaces of inverted-residual blocks: ProxylessNAS (MobileNetV2 blocks) and MobileNetV3.

Both are one-shot trainable: block choices are ``tnn.LayerChoice``s (ProxylessNAS) or int choices
inside constructor arguments (MobileNetV3's kernel sizes and expanded widths, sliced from the
largest weight), and stage depths are ``tnn.Repeat`` depths.

>>> space = ProxylessNAS(num_labels=10, base_widths=(16, 8, 16, 24, 32, 48, 64, 256))   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..space import choice

from .. import nn as tnn
from ..errors import InvalidSpace

__all__ = ["InvertedResidual", "ProxylessNAS", "MobileNetV3Space", "SqueezeExcite", "MOBILENETV3_LARGE",
           "make_divisible"]


def make_divisible(value: float, divisor: int = 8) -> int:
    """``value`` rounded to a multiple of ``divisor`` (never below 90 % of it), as MobileNets round widths."""
    new = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * value else new


def _round_up(value: int, divisor: int = 8) -> int:
    """``value`` rounded up to a multiple of ``divisor`` with integer arithmetic only, so that it
    follows a width choice in a one-shot supernet."""
    return (value + divisor - 1) // divisor * divisor


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation with hard-sigmoid gating; the squeeze width is ``channels // 4``
    rounded up to a multiple of 8 (MobileNetV3's widths for its reference expansions)."""

    def __init__(self, channels: int):
        super().__init__()
        squeeze = _round_up(channels // 4)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.relu = nn.ReLU(inplace=False)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.gate = nn.Hardsigmoid(inplace=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.gate(self.fc2(self.relu(self.fc1(x.mean((2, 3), keepdim=True)))))
        return x * scale


class InvertedResidual(nn.Module):
    """MobileNetV2/V3 block: 1x1 expansion (skipped when ``hidden == in``), depthwise ``kernel``
    convolution, optional squeeze-and-excitation, 1x1 projection; a residual when shapes allow."""

    def __init__(self, c_in: int, c_out: int, hidden: int, kernel: int, stride: int,
                 activation: type[nn.Module] = nn.ReLU6, se: bool = False, expand: bool | None = None):
        super().__init__()
        self.residual = stride == 1 and c_in == c_out
        layers: list[nn.Module] = []
        if expand if expand is not None else hidden != c_in:
            layers += [nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), activation()]
        layers += [nn.Conv2d(hidden, hidden, kernel, stride, kernel // 2, groups=hidden, bias=False),
                   nn.BatchNorm2d(hidden), activation()]
        if se:
            layers.append(SqueezeExcite(hidden))
        layers += [nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


# -- ProxylessNAS ------------------------------------------------------------------------------------
class ProxylessNAS(tnn.ModelSpace):
    """ProxylessNAS' space (Cai et al. 2019): a MobileNetV2 skeleton whose every block is a
    ``tnn.LayerChoice`` (label ``s{stage}_b{block}``) among inverted residuals of kernel 3/5/7 and
    expansion 3/6 (``k3_e3`` ... ``k7_e6``) and, except for a stage's first block, ``skip``.

    ``base_widths`` are the stem, the first block, the six stages and the last 1x1 convolution;
    ``depths`` and ``strides`` are per stage. With MobileNetV2's widths
    ``(32, 16, 24, 32, 64, 96, 160, 320, 1280)``, depths ``(2, 3, 4, 3, 3, 1)``, strides
    ``(2, 2, 2, 1, 2, 1)`` and every block ``k3_e6`` the model is MobileNetV2 (3.5 M parameters).

    >>> space = ProxylessNAS(num_labels=10)      # doctest: +SKIP
    """

    labels_unconditional = True  # every label exists in every model

    def __init__(self, num_labels: int = 1000, base_widths: Sequence[int] = (32, 16, 32, 40, 80, 96, 192, 320, 1280),
                 dropout_rate: float = 0.0, width_mult: float = 1.0, bn_eps: float = 1e-3, bn_momentum: float = 0.1,
                 *, depths: Sequence[int] = (4, 4, 4, 4, 4, 1), strides: Sequence[int] = (2, 2, 2, 1, 2, 1),
                 kernel_sizes: Sequence[int] = (3, 5, 7), expand_ratios: Sequence[int] = (3, 6), in_channels: int = 3):
        super().__init__()
        if len(base_widths) != 9 or len(depths) != 6 or len(strides) != 6:
            raise InvalidSpace("ProxylessNAS needs 9 base_widths (stem, first block, six stages, last conv), 6 depths "
                               f"and 6 strides. Got {len(base_widths)}, {len(depths)} and {len(strides)} instead.")
        widths = [make_divisible(w * width_mult) for w in base_widths]
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 2, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU6())
        self.first_block = InvertedResidual(widths[0], widths[1], widths[0], 3, 1, expand=False)
        blocks: list[nn.Module] = []
        c = widths[1]
        for s, (depth, stride) in enumerate(zip(depths, strides)):
            c_out = widths[2 + s]
            for b in range(depth):
                candidates: dict[str, Any] = {}
                for k in kernel_sizes:
                    for e in expand_ratios:
                        candidates[f"k{k}_e{e}"] = (lambda c_in=c, k=k, e=e, st=stride if b == 0 else 1:
                                                    InvertedResidual(c_in, c_out, c_in * e, k, st))
                if b > 0:
                    candidates["skip"] = nn.Identity
                blocks.append(tnn.LayerChoice(candidates, label=f"s{s}_b{b}"))
                c = c_out
        self.blocks = nn.Sequential(*blocks)
        self.feature_mix = nn.Sequential(nn.Conv2d(c, widths[8], 1, bias=False), nn.BatchNorm2d(widths[8]), nn.ReLU6())
        self.dropout = nn.Dropout(dropout_rate)
        self.classifier = nn.Linear(widths[8], num_labels)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eps, m.momentum = bn_eps, bn_momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.feature_mix(self.blocks(self.first_block(self.stem(x))))
        return self.classifier(self.dropout(x.mean((2, 3))))


# -- MobileNetV3 -------------------------------------------------------------------------------------
#: Per stage: (output width, stride, activation, squeeze-excite, the reference blocks' (kernel, expanded width)).
_V3_STAGES: list[tuple[int, int, str, bool, list[tuple[int, int]]]] = [
    (24, 2, "relu", False, [(3, 64), (3, 72)]),
    (40, 2, "relu", True, [(5, 72), (5, 120), (5, 120)]),
    (80, 2, "hswish", False, [(3, 240), (3, 200), (3, 184), (3, 184)]),
    (112, 1, "hswish", True, [(3, 480), (3, 672)]),
    (160, 2, "hswish", True, [(5, 672), (5, 960), (5, 960)]),
]
_ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "hswish": nn.Hardswish}


class MobileNetV3Space(tnn.ModelSpace):
    """MobileNetV3's space: MobileNetV3-Large's skeleton (stem 16, a first 3x3 block, five stages
    of inverted residuals, last convolutions 960 and 1280) where each stage's depth
    (``s{i}_depth``), each block's depthwise kernel (``s{i}_b{j}_kernel``: 3, 5, 7) and expanded
    width (``s{i}_b{j}_hidden``: the block input's width times 1, 2, 2.3, 2.5, 3, 4 or 6, rounded
    to a multiple of 8) are chosen. :data:`MOBILENETV3_LARGE` is MobileNetV3-Large (5.4 M
    parameters at 1000 classes).

    >>> model = MobileNetV3Space().freeze(MOBILENETV3_LARGE)     # doctest: +SKIP
    """

    def __init__(self, num_labels: int = 1000, width_multiplier: float = 1.0, dropout_rate: float = 0.2,
                 kernel_sizes: Sequence[int] = (3, 5, 7), expand_ratios: Sequence[float] = (1.0, 2.0, 2.3, 2.5, 3.0, 4.0, 6.0),
                 depths: Sequence[Sequence[int]] = ((1, 2, 3, 4),) * 5, *, in_channels: int = 3):
        super().__init__()
        def w(c: int) -> int:
            return make_divisible(c * width_multiplier)
        c = w(16)
        self.stem = nn.Sequential(nn.Conv2d(in_channels, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c), nn.Hardswish())
        self.first_block = InvertedResidual(c, c, c, 3, 1, activation=nn.ReLU, expand=False)
        stages: list[nn.Module] = []
        for s, (width, stride, act, se, _) in enumerate(_V3_STAGES):
            c_out = w(width)

            def block(b: int, s: int = s, c_in: int = c, c_out: int = c_out, stride: int = stride, act: str = act,
                      se: bool = se) -> nn.Module:
                inner = c_in if b == 0 else c_out
                hidden_widths = sorted({make_divisible(inner * r) for r in expand_ratios})
                hidden = choice(f"s{s}_b{b}_hidden", hidden_widths)
                kernel = choice(f"s{s}_b{b}_kernel", list(kernel_sizes))
                return InvertedResidual(inner, c_out, hidden, kernel, stride if b == 0 else 1,
                                        activation=_ACTIVATIONS[act], se=se, expand=True)
            stages.append(tnn.Repeat(block, depth=choice(f"s{s}_depth", list(depths[s]))))
            c = c_out
        self.stages = nn.Sequential(*stages)
        last = w(960)
        self.last_conv = nn.Sequential(nn.Conv2d(c, last, 1, bias=False), nn.BatchNorm2d(last), nn.Hardswish())
        self.classifier = nn.Sequential(nn.Linear(last, 1280), nn.Hardswish(), nn.Dropout(dropout_rate),
                                        nn.Linear(1280, num_labels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.last_conv(self.stages(self.first_block(self.stem(x))))
        return self.classifier(x.mean((2, 3)))


def _v3_large() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s, (_, _, _, _, blocks) in enumerate(_V3_STAGES):
        out[f"s{s}_depth"] = len(blocks)
        for b, (kernel, hidden) in enumerate(blocks):
            out[f"s{s}_b{b}_kernel"] = kernel
            out[f"s{s}_b{b}_hidden"] = hidden
    return out


#: MobileNetV3-Large (Howard et al. 2019, Table 1) as a sample of :class:`MobileNetV3Space`.
MOBILENETV3_LARGE: dict[str, Any] = _v3_large()
