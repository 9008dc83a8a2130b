"""A zoo of ten common architectures written as tridens model spaces.

Each entry of :data:`ZOO` is a ``tnn.ModelSpace`` with real choices (widths, depths via
``tnn.Repeat``, kernels, ``tnn.LayerChoice`` / ``tnn.InputChoice`` / ``tnn.Cell``), its own
``example_inputs``, and the outcome expected from ``td.graph.trace``: every model traces to a full
graph except :class:`EarlyExitNet`, whose exit cascade has real data-dependent control flow (it
stops as soon as the classifier is confident) and must become one opaque node.

Used by ``bench/zoo_trace.py`` (the table in BENCHMARKS.md) and ``tests/bench/test_zoo.py``.

>>> import random
>>> from zoo import ZOO                              # doctest: +SKIP
>>> entry = ZOO["lenet"]                              # doctest: +SKIP
>>> space = entry.build()                             # doctest: +SKIP
>>> model = space.freeze(space.random_sample(random.Random(0)))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import tridens as td
from tridens import nn as tnn

__all__ = ["ZooEntry", "ZOO",
           "MLP", "LeNet", "VGG", "ResNet", "MobileNetV2", "Transformer", "LSTMClassifier",
           "DartsNet", "UNet", "EarlyExitNet"]


def _act(label: str) -> nn.Module:
    """An activation chosen by name under ``label``."""
    return tnn.LayerChoice({"relu": nn.ReLU(), "gelu": nn.GELU(), "silu": nn.SiLU()}, label=label)


# ---------------------------------------------------------------------------------------------
# 1. MLP
class MLP(tnn.ModelSpace):
    """Flatten -> ``depth`` x (Linear, activation, Dropout) -> Linear. 8x8 digit images."""

    def __init__(self, in_features: int = 64, num_classes: int = 10):
        super().__init__()
        hidden = td.choice("hidden", [64, 128, 256])
        act = td.choice("act", ["relu", "gelu", "tanh"])
        drop = td.choice("dropout", [0.0, 0.1, 0.3])
        acts = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}

        def layer(i: int) -> nn.Module:
            return nn.Sequential(nn.Linear(in_features if i == 0 else hidden, hidden), acts[act](), nn.Dropout(drop))

        self.body = tnn.Repeat(layer, depth=td.choice("depth", [1, 2, 3]))
        self.head = nn.Linear(hidden, num_classes)
        self.example_inputs = (torch.randn(2, 1, 8, 8),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.flatten(x, 1)))


# ---------------------------------------------------------------------------------------------
# 2. LeNet
class LeNet(tnn.ModelSpace):
    """LeNet-5 on 1x28x28: two conv+pool stages and three linear layers, with choices for the
    channels, the first kernel, the pooling and the activation."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        c1 = td.choice("conv1.channels", [6, 12])
        c2 = td.choice("conv2.channels", [16, 32])
        k = td.choice("conv1.kernel", [5, 3])
        pool = {"max": lambda: nn.MaxPool2d(2), "avg": lambda: nn.AvgPool2d(2)}
        self.conv1 = nn.Conv2d(1, c1, k, padding=k // 2)  # 28x28 either way
        self.act1 = _act("act")
        self.pool1 = tnn.LayerChoice(pool, label="pool")
        self.conv2 = nn.Conv2d(c1, c2, 5)                   # 14 -> 10
        self.act2 = _act("act")
        self.pool2 = tnn.LayerChoice(pool, label="pool")   # 10 -> 5
        fc = td.choice("fc.width", [120, 84])
        self.fc1 = nn.Linear(c2 * 5 * 5, fc)
        self.fc2 = nn.Linear(fc, 84)
        self.fc3 = nn.Linear(84, num_classes)
        self.example_inputs = (torch.randn(2, 1, 28, 28),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.act1(self.conv1(x)))
        x = self.pool2(self.act2(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


# ---------------------------------------------------------------------------------------------
# 3. VGG
class VGG(tnn.ModelSpace):
    """VGG-style 3x32x32 classifier: three stages of ``n`` 3x3 convs (optional BatchNorm) and a
    max-pool, then a two-layer classifier."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        batchnorm = td.choice("batchnorm", [True, False])
        layers: list[nn.Module] = []
        c_in = 3
        for s, widths in enumerate(([16, 32], [32, 64], [64, 128])):
            width = td.choice(f"stage{s}.width", widths)

            def conv(i: int, c_in: int = c_in, width: int = width) -> nn.Module:
                parts = [nn.Conv2d(c_in if i == 0 else width, width, 3, padding=1)]
                parts += [nn.BatchNorm2d(width)] if batchnorm else []
                return nn.Sequential(*parts, nn.ReLU(inplace=True))

            layers += [tnn.Repeat(conv, depth=td.choice(f"stage{s}.convs", [1, 2, 3])), nn.MaxPool2d(2)]
            c_in = width
        self.features = nn.Sequential(*layers)
        hidden = td.choice("classifier.width", [128, 256])
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c_in * 4 * 4, hidden), nn.ReLU(inplace=True),
                                        nn.Dropout(td.choice("dropout", [0.5, 0.0])), nn.Linear(hidden, num_classes))
        self.example_inputs = (torch.randn(2, 3, 32, 32),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


# ---------------------------------------------------------------------------------------------
# 4. ResNet
class _Basic(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, kernel: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.short = (nn.Identity() if stride == 1 and c_in == c_out else
                      nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class _Bottleneck(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, kernel: int):
        super().__init__()
        mid = max(c_out // 4, 4)
        self.body = nn.Sequential(
            nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.short = (nn.Identity() if stride == 1 and c_in == c_out else
                      nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.short(x))


class ResNet(tnn.ModelSpace):
    """A small CIFAR ResNet: three stages whose width and block count are chosen, a per-block
    kernel, and a space-wide block type (basic or bottleneck)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        kind = td.choice("block", ["basic", "bottleneck"])
        block_cls = {"basic": _Basic, "bottleneck": _Bottleneck}[kind]
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        c_in, stages = 16, []
        for s, widths in enumerate(([16, 32], [32, 64], [64, 128])):
            width = td.choice(f"stage{s}.width", widths)

            def block(b: int, s: int = s, c_in: int = c_in, width: int = width) -> nn.Module:
                kernel = td.choice(f"stage{s}.block{b}.kernel", [3, 5])
                return block_cls(c_in if b == 0 else width, width, (1 if s == 0 else 2) if b == 0 else 1, kernel)

            stages.append(tnn.Repeat(block, depth=td.choice(f"stage{s}.depth", [1, 2, 3])))
            c_in = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c_in, num_classes)
        self.example_inputs = (torch.randn(2, 3, 32, 32),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


# ---------------------------------------------------------------------------------------------
# 5. MobileNetV2
class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, kxk depthwise, 1x1 project; residual when shapes allow."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int, kernel: int):
        super().__init__()
        mid = c_in * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(inplace=True)]
        layers += [nn.Conv2d(mid, mid, kernel, stride, kernel // 2, groups=mid, bias=False), nn.BatchNorm2d(mid),
                   nn.ReLU6(inplace=True), nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.residual:  # a Python bool fixed at construction: not data-dependent
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(tnn.ModelSpace):
    """MobileNetV2 on 3x32x32: a width multiplier, and per stage a block count, an expansion
    ratio and a depthwise kernel size."""

    # (base channels, stride) per stage
    STAGES = ((16, 1), (24, 2), (32, 2), (64, 2))

    def __init__(self, num_classes: int = 10):
        super().__init__()
        mult = td.choice("width_mult", [1.0, 0.5, 0.75])
        def ch(c: int) -> int:
            return max(8, int(c * mult) // 8 * 8)
        c_in = ch(32)
        self.stem = nn.Sequential(nn.Conv2d(3, c_in, 3, 1, 1, bias=False), nn.BatchNorm2d(c_in), nn.ReLU6(inplace=True))
        stages = []
        for s, (c, stride) in enumerate(self.STAGES):
            expand = td.choice(f"stage{s}.expand", [6, 3, 1])
            kernel = td.choice(f"stage{s}.kernel", [3, 5, 7])
            c_out = ch(c)

            def block(b: int, c_in: int = c_in, c_out: int = c_out, stride: int = stride,
                      expand: int = expand, kernel: int = kernel) -> nn.Module:
                return InvertedResidual(c_in if b == 0 else c_out, c_out, stride if b == 0 else 1, expand, kernel)

            stages.append(tnn.Repeat(block, depth=td.choice(f"stage{s}.depth", [2, 1, 3])))
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        last = ch(256)
        self.last = nn.Sequential(nn.Conv2d(c_in, last, 1, bias=False), nn.BatchNorm2d(last), nn.ReLU6(inplace=True))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Dropout(td.choice("dropout", [0.2, 0.0])), nn.Linear(last, num_classes))
        self.example_inputs = (torch.randn(2, 3, 32, 32),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.last(self.stages(self.stem(x))))


# ---------------------------------------------------------------------------------------------
# 6. Transformer encoder
class SelfAttention(nn.Module):
    """Hand-written multi-head self-attention (reshapes read the traced input's shape)."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = self.drop(torch.softmax((q @ k.transpose(-2, -1)) * self.scale, dim=-1))
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, d))


class EncoderBlock(nn.Module):
    """Pre- or post-norm transformer block built from :class:`SelfAttention` and an MLP."""

    def __init__(self, dim: int, heads: int, ffn: int, dropout: float, norm_first: bool):
        super().__init__()
        self.norm_first = norm_first
        self.attn = SelfAttention(dim, heads, dropout)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Dropout(dropout), nn.Linear(ffn, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_first:
            x = x + self.attn(self.norm1(x))
            return x + self.ffn(self.norm2(x))
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.ffn(x))


class Transformer(tnn.ModelSpace):
    """Transformer-encoder sequence classifier on token ids (batch, 16): token + learned position
    embeddings, ``depth`` blocks, mean pooling. Each block is a LayerChoice between the
    hand-written :class:`EncoderBlock` and ``nn.TransformerEncoderLayer``."""

    def __init__(self, vocab: int = 100, max_len: int = 16, num_classes: int = 4):
        super().__init__()
        dim = td.choice("dim", [32, 64])
        heads = td.choice("heads", [2, 4])
        ffn = dim * td.choice("ffn_ratio", [2, 4])
        dropout = td.choice("dropout", [0.1, 0.0])
        norm_first = td.choice("norm_first", [True, False])
        self.tokens = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(1, max_len, dim))

        def block(i: int) -> nn.Module:
            return tnn.LayerChoice({
                "custom": lambda: EncoderBlock(dim, heads, ffn, dropout, norm_first),
                "torch": lambda: nn.TransformerEncoderLayer(dim, heads, ffn, dropout, batch_first=True,
                                                            norm_first=norm_first),
            }, label=f"block{i}.impl")

        self.blocks = tnn.Repeat(block, depth=td.choice("depth", [1, 2, 3]))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.example_inputs = (torch.randint(0, vocab, (2, max_len)),)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.position[:, : ids.shape[1]]
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


# ---------------------------------------------------------------------------------------------
# 7. LSTM classifier
class LSTMClassifier(tnn.ModelSpace):
    """Embedding -> (bi)LSTM -> last state or mean over time -> Linear, on token ids (batch, 20)."""

    def __init__(self, vocab: int = 100, num_classes: int = 4):
        super().__init__()
        emb = td.choice("embedding", [32, 64])
        hidden = td.choice("hidden", [32, 64, 128])
        bidirectional = td.choice("bidirectional", [False, True])
        self.readout = td.choice("readout", ["last", "mean"])
        self.embed = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, num_layers=td.choice("layers", [1, 2]), batch_first=True,
                            bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), num_classes)
        self.example_inputs = (torch.randint(0, vocab, (2, 20)),)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        features = out[:, -1] if self.readout == "last" else out.mean(dim=1)  # a str fixed at freeze
        return self.head(features)


# ---------------------------------------------------------------------------------------------
# 8. DARTS-cell network
class _SepConv(nn.Sequential):
    def __init__(self, c: int, kernel: int, stride: int, dilation: int = 1):
        pad = dilation * (kernel - 1) // 2
        super().__init__(nn.ReLU(), nn.Conv2d(c, c, kernel, stride, pad, dilation=dilation, groups=c, bias=False),
                         nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))


def _darts_ops(c: int, reduction: bool) -> dict[str, Callable[[int, int, int], nn.Module]]:
    """The DARTS operation set; ops reading a cell input of a reduction cell use stride 2."""

    def stride(i: int) -> int:
        return 2 if reduction and i < 2 else 1

    return {
        "sep_conv_3x3": lambda j, k, i: _SepConv(c, 3, stride(i)),
        "sep_conv_5x5": lambda j, k, i: _SepConv(c, 5, stride(i)),
        "dil_conv_3x3": lambda j, k, i: _SepConv(c, 3, stride(i), dilation=2),
        "max_pool_3x3": lambda j, k, i: nn.MaxPool2d(3, stride(i), 1),
        "avg_pool_3x3": lambda j, k, i: nn.AvgPool2d(3, stride(i), 1, count_include_pad=False),
        "skip_connect": lambda j, k, i: (nn.Identity() if stride(i) == 1 else
                                         nn.Sequential(nn.Conv2d(c, c, 1, 2, bias=False), nn.BatchNorm2d(c))),
    }


class DartsCell(nn.Module):
    """Preprocess the two predecessors to ``c`` channels (halving a larger one), then a
    ``tnn.Cell`` whose decisions are shared by every cell with the same label."""

    def __init__(self, c_prev_prev: int, c_prev: int, c: int, reduction: bool, reduction_prev: bool,
                 nodes: int, label: str):
        super().__init__()
        self.pre0 = nn.Sequential(nn.ReLU(), nn.Conv2d(c_prev_prev, c, 1, 2 if reduction_prev else 1, bias=False),
                                  nn.BatchNorm2d(c))
        self.pre1 = nn.Sequential(nn.ReLU(), nn.Conv2d(c_prev, c, 1, bias=False), nn.BatchNorm2d(c))
        self.cell = tnn.Cell(_darts_ops(c, reduction), num_nodes=nodes, num_ops_per_node=2, num_predecessors=2,
                             label=label)

    def forward(self, s0: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        return self.cell(self.pre0(s0), self.pre1(s1))


class DartsNet(tnn.ModelSpace):
    """DARTS network on 3x32x32: stem, then cells of the ``layout`` (all normal cells share one
    genotype, the reduction cells another), global pooling, classifier."""

    def __init__(self, channels: int = 8, num_classes: int = 10,
                 layout: tuple[str, ...] = ("normal", "reduce", "normal")):
        super().__init__()
        nodes = td.choice("nodes", [4, 3])
        c = channels
        self.stem = nn.Sequential(nn.Conv2d(3, 3 * c, 3, padding=1, bias=False), nn.BatchNorm2d(3 * c))
        c_pp, c_p, reduction_prev = 3 * c, 3 * c, False
        cells = []
        for kind in layout:
            reduction = kind == "reduce"
            if reduction:
                c *= 2
            cells.append(DartsCell(c_pp, c_p, c, reduction, reduction_prev, nodes, label=kind))
            c_pp, c_p, reduction_prev = c_p, nodes * c, reduction
        self.cells = nn.ModuleList(cells)
        self.head = nn.Linear(c_p, num_classes)
        self.example_inputs = (torch.randn(2, 3, 32, 32),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s0 = s1 = self.stem(x)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.head(s1.mean(dim=(2, 3)))


# ---------------------------------------------------------------------------------------------
# 9. U-Net
class _DoubleConv(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, kernel: int):
        super().__init__(nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU(inplace=True),
                         nn.Conv2d(c_out, c_out, kernel, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU(inplace=True))


class UNet(tnn.ModelSpace):
    """U-Net segmenter on 1x32x32: ``levels`` down/up levels with skip concatenation; choices of
    base width, level count, kernel, and per level the upsampling (transposed conv or bilinear)."""

    def __init__(self, in_channels: int = 1, classes: int = 2):
        super().__init__()
        base = td.choice("base_width", [16, 8])
        levels = td.choice("levels", [3, 2])
        kernel = td.choice("kernel", [3, 5])
        widths = [base * 2 ** i for i in range(levels + 1)]
        self.inc = _DoubleConv(in_channels, widths[0], kernel)
        self.down = nn.ModuleList(nn.Sequential(nn.MaxPool2d(2), _DoubleConv(widths[i], widths[i + 1], kernel))
                                  for i in range(levels))
        ups, convs = [], []
        for i in reversed(range(levels)):
            hi, lo = widths[i + 1], widths[i]
            ups.append(tnn.LayerChoice({
                "transposed": lambda hi=hi, lo=lo: nn.ConvTranspose2d(hi, lo, 2, stride=2),
                "bilinear": lambda hi=hi, lo=lo: nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"),
                                                               nn.Conv2d(hi, lo, 1)),
            }, label=f"up{i}"))
            convs.append(_DoubleConv(2 * lo, lo, kernel))
        self.up = nn.ModuleList(ups)
        self.up_conv = nn.ModuleList(convs)
        self.out = nn.Conv2d(widths[0], classes, 1)
        self.example_inputs = (torch.randn(2, in_channels, 32, 32),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(skips[-1]))
        y = skips.pop()
        for up, conv in zip(self.up, self.up_conv):
            y = conv(torch.cat([skips.pop(), up(y)], dim=1))
        return self.out(y)


# ---------------------------------------------------------------------------------------------
# 10. Early exit (data-dependent control flow)
class ExitCascade(nn.Module):
    """Stages with a classifier after each; returns the first classifier's logits whose every
    prediction in the batch is more confident than ``threshold``. The number of stages run
    depends on the data: torch.fx cannot trace this, so it becomes one opaque node."""

    def __init__(self, stages: list[nn.Module], exits: list[nn.Module], threshold: float):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.exits = nn.ModuleList(exits)
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x
        for stage, exit_head in zip(self.stages, self.exits):
            x = stage(x)
            logits = exit_head(x)
            if torch.softmax(logits, dim=1).max(dim=1).values.min() > self.threshold:
                break  # confident enough: skip the remaining stages
        return logits


class EarlyExitNet(tnn.ModelSpace):
    """CNN on 1x28x28 with an early-exit cascade: a traced stem, then :class:`ExitCascade` (opaque)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        width = td.choice("width", [16, 32])
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        n = td.choice("exits", [2, 3])
        stages = [nn.Sequential(nn.Conv2d(width, width, td.choice(f"stage{i}.kernel", [3, 5]),
                                          padding="same"), nn.BatchNorm2d(width), nn.ReLU()) for i in range(n)]
        exits = [nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)) for _ in range(n)]
        self.cascade = ExitCascade(stages, exits, td.choice("threshold", [0.9, 0.5, 0.99]))
        self.example_inputs = (torch.randn(2, 1, 28, 28),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cascade(self.stem(x))


# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One zoo model: how to build its space and what tracing should give."""

    name: str
    build: Callable[[], tnn.ModelSpace]
    expect_opaque: bool
    note: str

    @property
    def description(self) -> str:
        return (self.build.__doc__ or "").strip().split("\n")[0]


ZOO: dict[str, ZooEntry] = {e.name: e for e in [
    ZooEntry("mlp", MLP, False, "Repeat of Linear blocks"),
    ZooEntry("lenet", LeNet, False, "shared LayerChoice label for both pools"),
    ZooEntry("vgg", VGG, False, "conditional BatchNorm, Repeat per stage"),
    ZooEntry("resnet", ResNet, False, "basic/bottleneck, per-block kernel"),
    ZooEntry("mobilenetv2", MobileNetV2, False, "inverted residuals, depthwise kernels"),
    ZooEntry("transformer", Transformer, False, "hand-written attention vs nn.TransformerEncoderLayer"),
    ZooEntry("lstm", LSTMClassifier, False, "nn.LSTM leaf, tuple outputs"),
    ZooEntry("darts", DartsNet, False, "tnn.Cell, shared normal/reduce genotypes"),
    ZooEntry("unet", UNet, False, "skip concatenation, upsampling choice"),
    ZooEntry("early_exit", EarlyExitNet, True, "data-dependent break: must be opaque"),
]}
