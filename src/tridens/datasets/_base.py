"""The dataset type every loader returns, seeded splits, and the loaders' errors."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ..errors import TridensError

__all__ = ["ImageDataset", "DatasetError", "DatasetNotFound", "stratified_split", "seeded_subset", "to_images",
           "make_pair", "normalize_pair"]


class DatasetError(TridensError, ValueError):
    """A dataset file is there but malformed (wrong magic number, truncated, shapes that disagree)."""


class DatasetNotFound(TridensError, FileNotFoundError):
    """A dataset file is missing; the message names the path and how to install it."""


class ImageDataset(TensorDataset):
    """Images ``(N, 1, H, W)`` float32 and labels ``(N,)`` int64, as a ``TensorDataset``.

    ``.tensors`` is ``(images, labels)`` so the engine can batch by slicing. ``.name`` is the
    dataset (``"digits"``), ``.split`` is ``"train"`` or ``"val"``, ``.spec`` identifies dataset,
    split and every option that changes the contents: two datasets with the same ``.spec`` hold the
    same data. The tensors are cached and shared between calls of a loader: don't modify them in place.

    >>> ds = ImageDataset(torch.zeros(4, 1, 8, 8), torch.arange(4), name="toy", split="train", spec="toy:train")
    >>> len(ds), ds[0][0].shape, ds.spec
    (4, torch.Size([1, 8, 8]), 'toy:train')
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, name: str, split: str, spec: str,
                 classes: Sequence[str] = ()) -> None:
        if images.ndim != 4 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"ImageDataset {spec!r} needs images (N, C, H, W) and labels (N,); got "
                             f"{tuple(images.shape)} and {tuple(labels.shape)}")
        super().__init__(images, labels)
        self.name = name
        self.split = split
        self.spec = spec
        self.classes = tuple(classes)

    @property
    def images(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def labels(self) -> torch.Tensor:
        return self.tensors[1]

    @property
    def num_classes(self) -> int:
        return len(self.classes) if self.classes else int(self.labels.max()) + 1

    def __repr__(self) -> str:
        return f"ImageDataset({self.spec!r}, n={len(self)}, shape={tuple(self.images.shape[1:])})"


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, val)``: ``round(val_fraction * n_c)`` samples of each class ``c`` go to val.

    Both are in a seeded random order (a dataset stored sorted by label comes out mixed). Uses
    ``numpy.random.RandomState``, whose stream numpy keeps stable across versions.

    >>> labels = np.array([0] * 10 + [1] * 10)
    >>> tr, va = stratified_split(labels, 0.2, seed=0)
    >>> len(tr), len(va), np.bincount(labels[va]).tolist()
    (16, 4, [2, 2])
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"The 'val_fraction' parameter must be a float in the range (0, 1). Got {val_fraction!r} "
                         f"instead.")
    rng = np.random.RandomState(seed)
    train, val = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        k = int(round(val_fraction * len(idx)))
        val.append(idx[:k])
        train.append(idx[k:])
    tr, va = np.concatenate(train), np.concatenate(val)
    return tr[rng.permutation(len(tr))], va[rng.permutation(len(va))]


def seeded_subset(n: int, limit: int | None, seed: int, what: str) -> np.ndarray:
    """``limit`` indices out of ``range(n)`` drawn with ``seed`` (sorted), or all of them."""
    if limit is None:
        return np.arange(n)
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or not 1 <= limit:
        raise ValueError(f"The '{what}' parameter must be an int in the range [1, {n}] or None. Got {limit!r} instead.")
    if limit >= n:
        return np.arange(n)
    return np.sort(np.random.RandomState(seed).permutation(n)[:limit])


def to_images(array: np.ndarray, scale: float) -> torch.Tensor:
    """``(N, H, W)`` or ``(N, H*W)`` raw values -> float32 ``(N, 1, H, W)`` divided by ``scale``."""
    x = torch.from_numpy(np.ascontiguousarray(array)).to(torch.float32).div_(scale)
    if x.ndim == 2:
        side = int(round(x.shape[1] ** 0.5))
        x = x.reshape(-1, side, side)
    return x.unsqueeze(1).contiguous()


def make_pair(name: str, spec: str, classes: Sequence[str], train: tuple[torch.Tensor, torch.Tensor],
              val: tuple[torch.Tensor, torch.Tensor]) -> tuple[ImageDataset, ImageDataset]:
    return (ImageDataset(*train, name=name, split="train", spec=f"{name}:train:{spec}", classes=classes),
            ImageDataset(*val, name=name, split="val", spec=f"{name}:val:{spec}", classes=classes))


def normalize_pair(train_x: torch.Tensor, val_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardize both with the mean and std of the training images (one scalar each)."""
    mean, std = train_x.mean(), train_x.std()
    return (train_x - mean) / std, (val_x - mean) / std
