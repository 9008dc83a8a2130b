"""``torchvision.transforms`` on ``(C, H, W)`` float tensors: the images of the stand-in datasets."""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Compose", "ToTensor", "Normalize", "RandomCrop", "RandomHorizontalFlip"]


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for t in self.transforms:
            image = t(image)
        return image


class ToTensor:
    """A tensor stays as it is (float); an ``(H, W[, C])`` uint8 array becomes ``(C, H, W)`` in [0, 1]."""

    def __call__(self, image: Any) -> torch.Tensor:
        if isinstance(image, torch.Tensor):
            return image.float()
        array = np.asarray(image)
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(array.transpose(2, 0, 1).copy()).float().div(255.0)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(list(mean)).view(-1, 1, 1)
        self.std = torch.tensor(list(std)).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std


class RandomCrop:
    def __init__(self, size: int, padding: int = 0) -> None:
        self.size, self.padding = size, padding

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if self.padding:
            image = F.pad(image, (self.padding,) * 4)
        h, w = image.shape[-2:]
        top, left = random.randint(0, h - self.size), random.randint(0, w - self.size)
        return image[..., top:top + self.size, left:left + self.size]


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.flip(-1) if random.random() < self.p else image
