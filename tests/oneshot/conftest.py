import pytest

from tridens.datasets import digits


@pytest.fixture(scope="session")
def digits_data():
    return digits()
