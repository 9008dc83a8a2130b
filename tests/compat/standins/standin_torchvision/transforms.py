"""``torchvision.transforms`` as the scripts use them: geometric transforms on PIL images (what the
stand-in datasets return, as torchvision's do) or on ``(C, H, W)`` tensors, ``ToTensor`` from a PIL
image or an ``(H, W[, C])`` uint8 array to a float tensor in [0, 1], ``Normalize`` on tensors."""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch
import torch.nn.functional as F

__all__ = ["Compose", "ToTensor", "Normalize", "RandomCrop", "RandomHorizontalFlip", "RandomResizedCrop"]


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for t in self.transforms:
            image = t(image)
        return image


class ToTensor:
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


def _size(image: Any) -> tuple[int, int]:
    """(height, width) of a PIL image or a tensor."""
    if isinstance(image, PIL.Image.Image):
        return image.height, image.width
    return int(image.shape[-2]), int(image.shape[-1])


def _crop(image: Any, top: int, left: int, height: int, width: int) -> Any:
    if isinstance(image, PIL.Image.Image):
        return image.crop((left, top, left + width, top + height))
    return image[..., top:top + height, left:left + width]


class RandomCrop:
    def __init__(self, size: int, padding: int = 0) -> None:
        self.size, self.padding = size, padding

    def __call__(self, image: Any) -> Any:
        if self.padding:
            if isinstance(image, PIL.Image.Image):
                image = PIL.ImageOps.expand(image, border=self.padding, fill=0)
            else:
                image = F.pad(image, (self.padding,) * 4)
        h, w = _size(image)
        return _crop(image, random.randint(0, h - self.size), random.randint(0, w - self.size), self.size, self.size)


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: Any) -> Any:
        if random.random() >= self.p:
            return image
        return PIL.ImageOps.mirror(image) if isinstance(image, PIL.Image.Image) else image.flip(-1)


class RandomResizedCrop:
    """A random crop of 8% to 100% of the area and 3/4 to 4/3 aspect ratio, resized to ``size`` (bilinear)."""

    def __init__(self, size: int, scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, image: Any) -> Any:
        h, w = _size(image)
        area = h * w * random.uniform(*self.scale)
        aspect = random.uniform(*self.ratio)
        ch = max(1, min(h, int(round((area / aspect) ** 0.5))))
        cw = max(1, min(w, int(round((area * aspect) ** 0.5))))
        crop = _crop(image, random.randint(0, h - ch), random.randint(0, w - cw), ch, cw)
        if isinstance(crop, PIL.Image.Image):
            return crop.resize((self.size, self.size), PIL.Image.BILINEAR)
        return F.interpolate(crop[None], size=(self.size, self.size), mode="bilinear", align_corners=False)[0]
