import pytest
import torch
from sklearn.datasets import load_digits


@pytest.fixture(scope="session")
def digits_batch() -> torch.Tensor:
    """32 real 8x8 digits, shaped (N, 1, 8, 8), scaled to [0, 1]."""
    x = load_digits().images[:32] / 16.0
    return torch.tensor(x, dtype=torch.float32).unsqueeze(1)
