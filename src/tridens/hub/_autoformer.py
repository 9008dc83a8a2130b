"""AutoFormer's space (Chen et al. 2021): a vision transformer whose embedding width, depth, and
each layer's number of heads and MLP ratio are chosen.

Labels: ``embed_dim``, ``depth``, ``num_heads_{i}`` and ``mlp_ratio_{i}`` (layer ``i``, present when
``depth > i``). With one value per choice it is a fixed ViT: ``AutoFormer(search_embed_dim=(192,),
search_mlp_ratio=(4.0,), search_num_heads=(3,), search_depth=(12,))`` is DeiT-Tiny (5.7 M parameters).

>>> space = AutoFormer(img_size=32, patch_size=8, search_embed_dim=(32, 48), search_depth=(1, 2), num_classes=10)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..space import choice

from .. import nn as tnn

__all__ = ["AutoFormer", "TransformerBlock"]


class TransformerBlock(nn.Module):
    """Pre-norm transformer layer: multi-head self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool = True, drop_rate: float = 0.0):
        super().__init__()
        hidden = math.trunc(dim * mlp_ratio)  # int(), written so a one-shot supernet can follow it
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, num_heads, dropout=drop_rate, bias=qkv_bias, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(drop_rate), nn.Linear(hidden, dim),
                                 nn.Dropout(drop_rate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class AutoFormer(tnn.ModelSpace):
    """A vision transformer space (see the module doc); NNI's ``AutoFormer`` parameters.

    Search it with any strategy; one-shot, the supernet holds the largest ViT and a path uses the
    leading slices of every weight for its width, its layers' heads and MLP widths (AutoFormer's
    weight entanglement), and its first ``depth`` blocks.
    """

    def __init__(self, search_embed_dim: Sequence[int] = (192, 216, 240), search_mlp_ratio: Sequence[float] = (3.0, 3.5, 4.0),
                 search_num_heads: Sequence[int] = (3, 4), search_depth: Sequence[int] = (12, 13, 14),
                 img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 1000,
                 qkv_bias: bool = True, drop_rate: float = 0.0):
        super().__init__()
        dim = choice("embed_dim", list(search_embed_dim))
        self.patch_embed = nn.Conv2d(in_chans, dim, patch_size, patch_size)
        num_patches = (img_size // patch_size) ** 2
        # The class token and the position embedding as embedding tables (one row, one row per
        # position): a supernet slices their width as it slices every layer's.
        self.cls_token = nn.Embedding(1, dim)
        self.pos_embed = nn.Embedding(num_patches + 1, dim)
        self.register_buffer("positions", torch.arange(num_patches + 1), persistent=False)
        nn.init.trunc_normal_(self.pos_embed.weight, std=0.02)
        nn.init.trunc_normal_(self.cls_token.weight, std=0.02)
        self.blocks = tnn.Repeat(
            lambda i: TransformerBlock(dim, choice(f"num_heads_{i}", list(search_num_heads)),
                                       choice(f"mlp_ratio_{i}", list(search_mlp_ratio)), qkv_bias, drop_rate),
            depth=choice("depth", list(search_depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        cls = self.cls_token(self.positions[:1]).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed(self.positions)
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])
