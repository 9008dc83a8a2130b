"""An offline stand-in for the few ``torchvision`` names NNI's example scripts use (torchvision is not
installed here and nothing is downloaded): ``transforms`` (Compose, ToTensor, Normalize, RandomCrop,
RandomHorizontalFlip, RandomResizedCrop) on image tensors, and ``datasets.MNIST`` / ``CIFAR10`` / ``CIFAR100`` /
``ImageNet`` made of real images tridens installs offline. It has a name of its own (a script's
``torchvision`` import lines are pointed at it), so that libraries probing for the real torchvision
(torchmetrics, Lightning) do not find it.
"""

from . import datasets, transforms

__all__ = ["datasets", "transforms"]
__version__ = "0.0+tridens.standin"
