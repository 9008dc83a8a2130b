"""Real data for evaluator tests: scikit-learn's digits (8x8 images, 10 classes) and diabetes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset


@pytest.fixture(scope="session")
def digits() -> tuple[TensorDataset, TensorDataset]:
    """(train, val): 1,400 and 397 digits, pixels scaled to [0, 1], flat 64-vectors."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val = perm[:1400], perm[1400:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


@pytest.fixture(scope="session")
def digit_images(digits) -> tuple[TensorDataset, TensorDataset]:
    """The same digits as 1x8x8 images."""
    train, val = digits
    return (TensorDataset(train.tensors[0].view(-1, 1, 8, 8), train.tensors[1]),
            TensorDataset(val.tensors[0].view(-1, 1, 8, 8), val.tensors[1]))


@pytest.fixture(scope="session")
def diabetes() -> tuple[TensorDataset, TensorDataset]:
    """(train, val) of scikit-learn's diabetes regression (10 standardized features, target / 100)."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(y / 100.0, dtype=torch.float32)
    return TensorDataset(x[:350], y[:350]), TensorDataset(x[350:], y[350:])


def mlp(seed: int = 0, hidden: int = 32, dropout: float = 0.1, out: int = 10, inputs: int = 64) -> nn.Module:
    """A small MLP whose initialization depends on ``seed`` only."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, out))


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models train fastest on one thread (and the machine is shared); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
