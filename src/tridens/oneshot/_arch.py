"""What every mixed and entangled module of a supernet reads: the :class:`ArchState` (a path or
per-label weights), the one-line refusal of a space that cannot be one-shot, and the centred
kernel crop that slices a larger kernel to a chosen size."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import InvalidSample, InvalidSpace
from ..space import same_value
from ._traced import traced_labels, value_at

Sample = Mapping[str, Any]


def not_one_shot(label: str | None, reason: str) -> InvalidSpace:
    """The error of a space that cannot be made one-shot, naming the label and the way out."""
    what = f"label {label!r}" if label else "the space"
    return InvalidSpace(f"this space cannot be trained as a one-shot supernet: {what} {reason}. "
                        "Use a multi-trial strategy for it (e.g. td.strategy.RegularizedEvolution() or "
                        "td.strategy.Random()), which builds each model on its own.")


# ---------------------------------------------------------------------------------------------
class ArchState:
    """What the supernet computes right now: a path (``sample``) or per-label probabilities.

    ``values[label]`` lists the domain values of a finite label; ``probs[label]`` is a tensor
    over them (weights mode). In weights mode ``sample`` is the most probable value of every
    label, used by what cannot be mixed (strides, pooling sizes, dimensions that depend on
    several labels).
    """

    def __init__(self) -> None:
        self.mode = "path"
        self.sample: dict[str, Any] = {}
        self.probs: dict[str, torch.Tensor] = {}
        self.values: dict[str, list[Any]] = {}
        self._cache: dict[Any, torch.Tensor] = {}

    def set_path(self, sample: Sample) -> None:
        self.mode, self.sample, self.probs = "path", dict(sample), {}

    def set_weights(self, probs: Mapping[str, torch.Tensor], argmax: Sample) -> None:
        self.mode, self.probs, self.sample = "weights", dict(probs), dict(argmax)

    @property
    def weighted(self) -> bool:
        return self.mode == "weights"

    def index(self, label: str) -> int:
        """Index of the path's value of ``label`` among its domain values (0 when inactive)."""
        if label not in self.sample:
            return 0
        value = self.sample[label]
        for i, v in enumerate(self.values[label]):
            if same_value(v, value):
                return i
        raise InvalidSample(f"value {value!r} of label {label!r} is outside its domain {self.values[label]!r}")

    def single(self, dim: Any) -> str | None:
        """The label a traced dimension depends on, when it is exactly one label with weights."""
        labels = traced_labels(dim)
        if len(labels) == 1:
            (label,) = labels
            if label in self.probs:
                return label
        return None

    def channel_mask(self, dim: Any, size: int, device: torch.device) -> torch.Tensor | None:
        """The soft mask over ``size`` channels: ``sum_i p_i [c < dim(v_i)]`` (weights mode)."""
        label = self.single(dim)
        if label is None:
            n = value_at(dim, self.sample)
            return None if n >= size else (torch.arange(size, device=device) < n).float()
        key = ("channels", id(dim), size, str(device))
        table = self._cache.get(key)
        if table is None:
            sizes = torch.tensor([value_at(dim, {label: v}) for v in self.values[label]], device=device)
            table = (torch.arange(size, device=device)[None, :] < sizes[:, None]).float()
            self._cache[key] = table
        return self.probs[label].to(device) @ table

    def kernel_mask(self, dim: Any, kmax: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
        """The soft mask over a ``kmax`` kernel: ``sum_i p_i centred_box(k(v_i))`` (weights mode)."""
        label = self.single(dim[0]) if isinstance(dim, tuple) else self.single(dim)
        if label is None:
            k = value_at(dim, self.sample)
            return None if tuple(k) == tuple(kmax) else _box(tuple(k), kmax, device)
        key = ("kernel", id(dim), kmax, str(device))
        table = self._cache.get(key)
        if table is None:
            table = torch.stack([_box(tuple(value_at(dim, {label: v})), kmax, device) for v in self.values[label]])
            self._cache[key] = table
        return torch.tensordot(self.probs[label].to(device), table, dims=1)


def _box(k: tuple[int, ...], kmax: tuple[int, ...], device: torch.device) -> torch.Tensor:
    mask = torch.zeros(kmax, device=device)
    index = tuple(slice((m - s) // 2, (m - s) // 2 + s) for s, m in zip(k, kmax))
    mask[index] = 1.0
    return mask


def _crop(weight: torch.Tensor, k: tuple[int, ...]) -> torch.Tensor:
    """The centred ``k`` window of the spatial dims (the last ones) of ``weight``."""
    spatial = weight.shape[2:]
    if tuple(k) == tuple(spatial):
        return weight
    for d, (s, m) in enumerate(zip(k, spatial)):
        if s > m:
            raise InvalidSample(f"kernel size {s} is larger than the supernet's {m}")
        weight = weight.narrow(2 + d, (m - s) // 2, s)
    return weight


# ---------------------------------------------------------------------------------------------
