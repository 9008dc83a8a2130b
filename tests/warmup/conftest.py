import pytest
import torch
from torch import nn

from tridens.datasets import digits


@pytest.fixture(scope="session")
def digits_data():
    return digits()


def _train(model, data, epochs=2):
    train, _ = data
    x, y = train.tensors[0], train.tensors[1]
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        for i in range(0, len(x), 128):
            idx = perm[i:i + 128]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


@pytest.fixture(scope="session")
def train():
    return _train
