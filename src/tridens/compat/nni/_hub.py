"""``nni.nas.hub.pytorch`` (and NNI 2.x's ``nni.retiarii.hub.pytorch``) on ``tridens.hub``.

The spaces are ``tridens.hub``'s, with NNI's class names and constructor arguments; an argument
tridens' version does not have is accepted at NNI's default and refused otherwise, naming what
to use. ``DARTS.load_searched_model("darts-v2")`` builds DARTS-V2 (no pretrained weights: tridens
downloads nothing).
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from tridens import hub as _hub

from ._common import NotSupported, only_default

__all__ = ["NasBench101", "NasBench201", "NASNet", "ENAS", "AmoebaNet", "PNAS", "DARTS", "ProxylessNAS",
           "MobileNetV3Space", "ShuffleNetSpace", "AutoFormer"]

NasBench101 = _hub.NasBench101
NASNet, ENAS, AmoebaNet, PNAS = _hub.NASNet, _hub.ENAS, _hub.AmoebaNet, _hub.PNAS
ProxylessNAS = _hub.ProxylessNAS
ShuffleNetSpace = _hub.ShuffleNetSpace


def _pretrained(owner: str, pretrained: bool) -> None:
    only_default(owner, "pretrained", pretrained, False,
                 "tridens ships no pretrained weights (nothing is downloaded): train the model, or load a state_dict "
                 "you have with model.load_state_dict(torch.load(path)).")


class NasBench201(_hub.NasBench201):
    """``NasBench201(stem_out_channels=16, num_modules_per_stack=5, num_labels=10)`` = ``tridens.hub.NasBench201``
    (labels ``edge_{j}_{i}``, valued by operation name as in NAS-Bench-201's table)."""

    def __init__(self, stem_out_channels: int = 16, num_modules_per_stack: int = 5, num_labels: int = 10, **kwargs: Any):
        super().__init__(channels=stem_out_channels, cells=num_modules_per_stack, num_classes=num_labels, **kwargs)


class DARTS(_hub.DARTS):
    """``tridens.hub.DARTS`` with NNI's ``load_searched_model``."""

    @classmethod
    def load_searched_model(cls, name: str, pretrained: bool = False, download: bool = False,
                            progress: bool = True) -> nn.Module:
        """``"darts-v2"``: DARTS-V2 on CIFAR-10 (width 36, 20 cells), freshly initialised."""
        _pretrained("DARTS.load_searched_model", pretrained)
        if name != "darts-v2":
            raise NotSupported(f"DARTS.load_searched_model knows 'darts-v2'. Got {name!r} instead.")
        return _hub.DARTS(width=36, num_cells=20).freeze(_hub.DARTS_V2)


class MobileNetV3Space(_hub.MobileNetV3Space):
    """``tridens.hub.MobileNetV3Space`` with NNI's ``num_labels``/``dropout_rate``; NNI's width
    multipliers and expansion ratios as searched choices are given as ``tridens`` arguments
    instead (``width_multiplier``: one fixed value, ``expand_ratios``, ``kernel_sizes``, ``depths``)."""

    def __init__(self, num_labels: int = 1000, base_widths: Any = None, width_multipliers: Any = None,
                 expand_ratios: Sequence[float] = (1.0, 2.0, 2.3, 2.5, 3.0, 4.0, 6.0), bn_eps: float = 1e-3,
                 bn_momentum: float = 0.1, dropout_rate: float = 0.2, **kwargs: Any):
        for name, value in (("base_widths", base_widths), ("width_multipliers", width_multipliers)):
            only_default("MobileNetV3Space", name, value, None,
                         "tridens.hub.MobileNetV3Space has MobileNetV3-Large's widths times one width_multiplier=.")
        super().__init__(num_labels=num_labels, dropout_rate=dropout_rate, expand_ratios=expand_ratios, **kwargs)

    @classmethod
    def load_searched_model(cls, name: str, pretrained: bool = False, download: bool = False,
                            progress: bool = True) -> nn.Module:
        """``"mobilenetv3-large-100"``: MobileNetV3-Large, freshly initialised."""
        _pretrained("MobileNetV3Space.load_searched_model", pretrained)
        if name != "mobilenetv3-large-100":
            raise NotSupported(f"MobileNetV3Space.load_searched_model knows 'mobilenetv3-large-100'. Got {name!r} instead.")
        return _hub.MobileNetV3Space().freeze(_hub.MOBILENETV3_LARGE)


class AutoFormer(_hub.AutoFormer):
    """``tridens.hub.AutoFormer``; NNI's extra transformer options are accepted at their defaults."""

    def __init__(self, search_embed_dim: Sequence[int] = (192, 216, 240), search_mlp_ratio: Sequence[float] = (3.0, 3.5, 4.0),
                 search_num_heads: Sequence[int] = (3, 4), search_depth: Sequence[int] = (12, 13, 14),
                 img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 1000,
                 qkv_bias: bool = False, drop_rate: float = 0.0, attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0,
                 pre_norm: bool = True, global_pool: bool = False, abs_pos: bool = True, qk_scale: Any = None,
                 rpe: bool = True, rpe_length: int = 14):
        why = "tridens.hub.AutoFormer is a plain pre-norm ViT with a class token and absolute positions."
        for name, value, default in (("attn_drop_rate", attn_drop_rate, 0.0), ("drop_path_rate", drop_path_rate, 0.0),
                                     ("pre_norm", pre_norm, True), ("global_pool", global_pool, False),
                                     ("abs_pos", abs_pos, True), ("qk_scale", qk_scale, None)):
            only_default("AutoFormer", name, value, default, why)
        super().__init__(search_embed_dim, search_mlp_ratio, search_num_heads, search_depth, img_size, patch_size,
                         in_chans, num_classes, qkv_bias, drop_rate)
