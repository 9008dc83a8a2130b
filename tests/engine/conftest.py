import pytest

import tridens as td
from tridens.datasets import digits


@pytest.fixture(scope="session")
def digits_data():
    return digits()


@pytest.fixture(scope="session")
def data(digits_data):
    return digits_data


@pytest.fixture
def classification(digits_data):
    train, val = digits_data
    return td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=128, optimizer="adam",
                                        lr=td.choice("lr", [0.01, 0.003]))


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray per test module, started as td.executors.Ray(address=None) starts it (on
    127.0.0.1); a Ray already running in the process is used as is."""
    ray = pytest.importorskip("ray")
    from tridens.executors._ray_local import start_local_ray

    started = not ray.is_initialized()
    if started:
        start_local_ray(2)  # as td.executors.Ray(address=None) starts it: on 127.0.0.1
    yield ray
    if started:
        ray.shutdown()
