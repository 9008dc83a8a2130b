"""Entangled layers: a layer built at its largest size whose weight is sliced per path (a
sample) or mixed per label weights (DARTS/GDAS) -- convolutions (kernels centred), Linear,
BatchNorm (statistics sliced too), Embedding, LayerNorm and MultiheadAttention (the q/k/v
in-projection blocks and the out-projection sliced to the path's ``embed_dim``, its
``num_heads`` the path's; under weights the outputs of every width and head count are mixed,
each computed on its slice). :func:`~._supernet.build_supernet` swaps them in."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._traced import plain, traced_labels, value_at

from ._arch import ArchState, Sample, _crop, not_one_shot

if TYPE_CHECKING:   # the torch layer a mixin is combined with (EntangledConv2d(_EntangledConv, nn.Conv2d))
    from torch.nn.modules.batchnorm import _BatchNorm as _NormLayer
    from torch.nn.modules.conv import _ConvNd as _ConvLayer
else:
    _ConvLayer = _NormLayer = object


class _Entangled:
    """Mixin of layers built at their largest size and sliced per sample (weight entanglement)."""

    _traced: dict[str, Any]
    _state: ArchState

    def _setup(self, traced: dict[str, Any], state: ArchState) -> None:
        self.__dict__["_traced"] = traced
        self.__dict__["_state"] = state
        for name, value in traced.items():
            object.__setattr__(self, name, plain(value))

    def _at(self, name: str, sample: Sample | None = None) -> Any:
        if name in self._traced:
            return value_at(self._traced[name], self._state.sample if sample is None else sample)
        return getattr(self, name)

    def sliced(self, name: str, sample: Sample) -> torch.Tensor:  # pragma: no cover - per layer
        raise NotImplementedError


class _EntangledConv(_Entangled, _ConvLayer):
    def _weight_bias(self, sample: Sample | None = None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        out_c, in_c, groups = self._at("out_channels", sample), self._at("in_channels", sample), self._at("groups", sample)
        w = self.weight[:out_c, : in_c // groups]
        w = _crop(w, self._at("kernel_size", sample))
        b = None if self.bias is None else self.bias[:out_c]
        return w, b, groups

    def sliced(self, name: str, sample: Sample) -> torch.Tensor:
        w, b, _ = self._weight_bias(sample)
        if name == "weight":
            return w
        if b is None:   # callers ask for the bias only of a layer that has one
            raise ValueError(f"{type(self).__name__} has no bias to slice (bias=False)")
        return b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = F.conv1d if isinstance(self, nn.Conv1d) else F.conv2d
        state = self._state
        if state.weighted:
            w, b = self.weight, self.bias
            if "kernel_size" in self._traced:
                mask = state.kernel_mask(self._traced["kernel_size"], tuple(w.shape[2:]), w.device)
                if mask is not None:
                    w = w * mask
            stride, dilation = self._at("stride"), self._at("dilation")
            y = conv(x, w, b, stride, self.padding, dilation, self.groups)
            if "out_channels" in self._traced:
                mask = state.channel_mask(self._traced["out_channels"], w.shape[0], w.device)
                if mask is not None:
                    y = y * mask.view(1, -1, *([1] * (y.dim() - 2)))
            return y
        w, b, groups = self._weight_bias()
        return conv(x, w, b, self._at("stride"), self._at("padding"), self._at("dilation"), groups)


class EntangledConv2d(_EntangledConv, nn.Conv2d):
    """A ``Conv2d`` at its largest channels/kernel, sliced per sample (kernel centred)."""


class EntangledConv1d(_EntangledConv, nn.Conv1d):
    """A ``Conv1d`` at its largest channels/kernel, sliced per sample (kernel centred)."""


class EntangledLinear(_Entangled, nn.Linear):
    """A ``Linear`` at its largest sizes, sliced per sample."""

    def sliced(self, name: str, sample: Sample) -> torch.Tensor:
        out_f, in_f = self._at("out_features", sample), self._at("in_features", sample)
        return self.weight[:out_f, :in_f] if name == "weight" else self.bias[:out_f]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self._state
        if state.weighted:
            y = F.linear(x, self.weight, self.bias)
            if "out_features" in self._traced:
                mask = state.channel_mask(self._traced["out_features"], self.weight.shape[0], y.device)
                if mask is not None:
                    y = y * mask
            return y
        return F.linear(x, self.sliced("weight", state.sample), None if self.bias is None else self.sliced("bias", state.sample))


class _EntangledNorm(_Entangled, _NormLayer):
    def sliced(self, name: str, sample: Sample) -> torch.Tensor:
        tensor = getattr(self, name)
        if name == "num_batches_tracked":
            return tensor
        return tensor[: self._at("num_features", sample)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self._state
        c = self.num_features if state.weighted else self._at("num_features")
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm does
                momentum = 1.0 / float(self.num_batches_tracked)
        use_batch = self.training or self.running_mean is None
        # Slices of the running buffers are views: batch_norm updates the shared statistics in place.
        y = F.batch_norm(x, None if self.running_mean is None else self.running_mean[:c],
                         None if self.running_var is None else self.running_var[:c],
                         None if self.weight is None else self.weight[:c], None if self.bias is None else self.bias[:c],
                         use_batch, momentum, self.eps)
        if state.weighted and "num_features" in self._traced:
            mask = state.channel_mask(self._traced["num_features"], c, y.device)
            if mask is not None:
                y = y * mask.view(1, -1, *([1] * (y.dim() - 2)))
        return y


class EntangledBatchNorm2d(_EntangledNorm, nn.BatchNorm2d):
    """A ``BatchNorm2d`` at its largest width; parameters and running statistics sliced."""


class EntangledBatchNorm1d(_EntangledNorm, nn.BatchNorm1d):
    """A ``BatchNorm1d`` at its largest width; parameters and running statistics sliced."""


def _mixture(state: ArchState, dims: Any) -> list[tuple[torch.Tensor | None, dict[str, Any]]]:
    """The paths a weighted layer mixes: one per combination of values of the labels in ``dims``
    that have weights, with its probability (the product over those labels). Zero-probability
    combinations of a hard (one-hot, no gradient) sample are left out. No weighted label: the
    argmax path alone, with weight ``None``."""
    labels = sorted(label for label in traced_labels(dims) if label in state.probs)
    if not labels:
        return [(None, state.sample)]
    out: list[tuple[torch.Tensor | None, dict[str, Any]]] = []
    for combo in itertools.product(*(range(len(state.values[label])) for label in labels)):
        p = state.probs[labels[0]][combo[0]]
        for label, i in zip(labels[1:], combo[1:]):
            p = p * state.probs[label][i]
        if not p.requires_grad and float(p) == 0.0:
            continue
        out.append((p, {**state.sample, **{label: state.values[label][i] for label, i in zip(labels, combo)}}))
    return out


def _pad_to(y: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``y`` zero-padded at the end of its last ``len(shape)`` dims up to ``shape``."""
    pads: list[int] = []
    for have, want in zip(reversed(y.shape[y.dim() - len(shape):]), reversed(list(shape))):
        pads += [0, want - have]
    return F.pad(y, pads) if any(pads) else y


def _mix(parts: list[tuple[torch.Tensor | None, torch.Tensor]]) -> torch.Tensor:
    if len(parts) == 1 and parts[0][0] is None:
        return parts[0][1]
    total: torch.Tensor | None = None
    for p, y in parts:
        y = y if p is None else p * y
        total = y if total is None else total + y
    assert total is not None
    return total


class EntangledEmbedding(_Entangled, nn.Embedding):
    """An ``Embedding`` at its largest table; a path looks up the leading ``num_embeddings`` rows
    and ``embedding_dim`` columns (weights: the largest table, columns masked as a Linear's outputs)."""

    def sliced(self, name: str, sample: Sample) -> torch.Tensor:
        return self.weight[: self._at("num_embeddings", sample), : self._at("embedding_dim", sample)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self._state
        weight = self.weight if state.weighted else self.sliced("weight", state.sample)
        y = F.embedding(x, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse)
        if state.weighted and "embedding_dim" in self._traced:
            mask = state.channel_mask(self._traced["embedding_dim"], self.weight.shape[1], y.device)
            if mask is not None:
                y = y * mask
        return y


class EntangledLayerNorm(_Entangled, nn.LayerNorm):
    """A ``LayerNorm`` at its largest shape; a path normalizes the leading slice with the leading
    slice of the affine weights. Weights mix the candidates' outputs (each normalizes its own
    slice of the input, zero-padded to the largest shape): a width's statistics depend on the
    width, so a mask over the largest one would not reproduce any candidate."""

    def _shape(self, sample: Sample | None = None) -> tuple[int, ...]:
        return tuple(self._at("normalized_shape", sample))

    def sliced(self, name: str, sample: Sample) -> torch.Tensor:
        return getattr(self, name)[tuple(slice(0, n) for n in self._shape(sample))]

    def _norm(self, x: torch.Tensor, sample: Sample) -> torch.Tensor:
        shape = self._shape(sample)
        weight = None if self.weight is None else self.sliced("weight", sample)
        bias = None if self.bias is None else self.sliced("bias", sample)
        return F.layer_norm(x, shape, weight, bias, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self._state
        if not state.weighted:
            return self._norm(x, state.sample)
        full = tuple(self.normalized_shape)
        parts: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        for p, sample in _mixture(state, self._traced.get("normalized_shape")):
            shape = self._shape(sample)
            window = x[(Ellipsis,) + tuple(slice(0, n) for n in shape)]
            parts.append((p, _pad_to(self._norm(window, sample), full)))
        return _mix(parts)


class EntangledMultiheadAttention(_Entangled, nn.MultiheadAttention):
    """A ``MultiheadAttention`` at its largest ``embed_dim``; a path of width ``e`` uses the
    leading ``e`` rows of each of the q, k and v blocks of the in-projection (rows ``[0, e)``,
    ``[E, E + e)``, ``[2E, 2E + e)`` of ``in_proj_weight``, columns ``[0, e)``), the leading
    ``e x e`` of the out-projection and of ``bias_k``/``bias_v``, and the path's ``num_heads``
    (AutoFormer's weight entanglement; NNI 3.0's ``MixedMultiHeadAttention`` slices the same).

    Weights (DARTS, GDAS) mix the outputs of every candidate width and head count, each computed
    on its own slice of the input and zero-padded to the largest width: heads split a width into
    equal parts, so no mask over the largest attention computes a smaller one.
    """

    def _setup(self, traced: dict[str, Any], state: ArchState) -> None:
        embed = traced.get("embed_dim")
        for name in ("kdim", "vdim"):
            if name in traced and traced[name] is not embed:
                raise not_one_shot(sorted(traced_labels(traced[name]))[0],
                                   f"sets the attention's {name} apart from its embed_dim; the supernet slices "
                                   "kdim and vdim only when they follow embed_dim (leave them None)")
        super()._setup(traced, state)

    def _proj(self, tensor: torch.Tensor, e: int) -> torch.Tensor:
        big = self.embed_dim
        return torch.cat([tensor[i * big: i * big + e] for i in range(3)])

    def sliced(self, name: str, sample: Sample) -> torch.Tensor:
        e = self._at("embed_dim", sample)
        if name == "in_proj_weight":
            return self._proj(self.in_proj_weight, e)[:, :e]
        if name == "in_proj_bias":
            return self._proj(self.in_proj_bias, e)
        if name in ("bias_k", "bias_v"):
            return getattr(self, name)[:, :, :e]
        if name == "q_proj_weight":
            return self.q_proj_weight[:e, :e]
        if name in ("k_proj_weight", "v_proj_weight"):
            return getattr(self, name)[:e]
        raise KeyError(name)

    def _attend(self, sample: Sample, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        e, heads = self._at("embed_dim", sample), self._at("num_heads", sample)
        separate = not self._qkv_same_embed_dim
        batched = query.dim() == 3
        if self.batch_first and batched:
            query, key, value = (t.transpose(1, 0) for t in (query, key, value))
        out_bias = self.out_proj.bias
        out, weights = F.multi_head_attention_forward(
            query, key, value, e, heads,
            None if separate else self.sliced("in_proj_weight", sample),
            None if self.in_proj_bias is None else self.sliced("in_proj_bias", sample),
            None if self.bias_k is None else self.sliced("bias_k", sample),
            None if self.bias_v is None else self.sliced("bias_v", sample),
            self.add_zero_attn, self._at("dropout", sample),
            self.out_proj.weight[:e, :e], None if out_bias is None else out_bias[:e],
            training=self.training, use_separate_proj_weight=separate,
            q_proj_weight=self.sliced("q_proj_weight", sample) if separate else None,
            k_proj_weight=self.sliced("k_proj_weight", sample) if separate else None,
            v_proj_weight=self.sliced("v_proj_weight", sample) if separate else None,
            **kwargs)
        if self.batch_first and batched:
            out = out.transpose(1, 0)
        return out, weights

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs = dict(key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
                      average_attn_weights=average_attn_weights, is_causal=is_causal)
        state = self._state
        if not state.weighted:
            return self._attend(state.sample, query, key, value, **kwargs)
        mixture = _mixture(state, [self._traced.get("embed_dim"), self._traced.get("num_heads")])
        outs: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        maps: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        kv_fixed = not self._qkv_same_embed_dim  # key and value keep their own (fixed) widths
        for p, sample in mixture:
            e = self._at("embed_dim", sample)
            q = query[..., :e]
            k, v = (key, value) if kv_fixed else (key[..., :e], value[..., :e])
            out, weights = self._attend(sample, q, k, v, **kwargs)
            outs.append((p, _pad_to(out, (self.embed_dim,))))
            if weights is not None:
                maps.append((p, weights))
        mixed = None
        if maps and len({tuple(w.shape) for _, w in maps}) == 1:
            mixed = _mix(maps)
        elif maps:  # per-head maps of different head counts: the most probable path's
            chances = [-1.0 if p is None else float(p) for p, _ in mixture]
            mixed = maps[chances.index(max(chances))][1]
        return _mix(outs), mixed


_ENTANGLED: dict[type, tuple[type, tuple[str, ...]]] = {
    nn.Conv2d: (EntangledConv2d, ("in_channels", "out_channels", "kernel_size", "padding", "stride", "dilation", "groups")),
    nn.Conv1d: (EntangledConv1d, ("in_channels", "out_channels", "kernel_size", "padding", "stride", "dilation", "groups")),
    nn.Linear: (EntangledLinear, ("in_features", "out_features")),
    nn.BatchNorm2d: (EntangledBatchNorm2d, ("num_features",)),
    nn.BatchNorm1d: (EntangledBatchNorm1d, ("num_features",)),
    nn.LayerNorm: (EntangledLayerNorm, ("normalized_shape",)),
    nn.Embedding: (EntangledEmbedding, ("num_embeddings", "embedding_dim")),
    nn.MultiheadAttention: (EntangledMultiheadAttention, ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout")),
    # the out-projection of a MultiheadAttention: a Linear that the attention slices itself
    nn.modules.linear.NonDynamicallyQuantizableLinear: (EntangledLinear, ("in_features", "out_features")),
}
# Attributes that only change how a module computes, never the shape of its weights.
