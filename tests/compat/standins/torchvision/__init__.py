"""An offline stand-in for the few ``torchvision`` names NNI's example scripts use (torchvision is not
installed here and nothing is downloaded): ``transforms`` (Compose, ToTensor, Normalize, RandomCrop,
RandomHorizontalFlip) on image tensors, and ``datasets.MNIST`` / ``datasets.CIFAR10`` made of real
images tridens installs offline. Only the tests that run NNI's scripts put this folder on ``sys.path``.
"""

from . import datasets, transforms

__all__ = ["datasets", "transforms"]
__version__ = "0.0+tridens.standin"
