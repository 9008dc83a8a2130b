import pytest

import tridens as td
from tridens.datasets import digits


@pytest.fixture(scope="session")
def digits_data():
    return digits()


@pytest.fixture
def classification(digits_data):
    train, val = digits_data
    return td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=128, optimizer="adam",
                                        lr=td.choice("lr", [0.01, 0.003]))
