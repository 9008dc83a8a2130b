"""Models whose input is a tuple of tensors (a dataset of ``((left, right), label)``): the planner
collates its example batch as the trainer does, leaves the graph analyses that need one input
tensor, and the trials train as they do alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.data import Dataset

import tridens as td
from tridens.trial import TrialStatus
from tridens.xopt._prefix import _example_batch, example_bytes, example_tensor


class HalfImages(Dataset):
    """scikit-learn's digits, each image cut into its left and right halves: ``((left, right), label)``."""

    def __init__(self, base: torch.utils.data.TensorDataset) -> None:
        self.x, self.y = base.tensors

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        image = self.x[i]
        return (image[..., :4], image[..., 4:]), self.y[i]


class TwoHalves(td.ModelSpace):
    def __init__(self) -> None:
        super().__init__()
        width = td.choice("width", [16, 32])
        self.left, self.right = nn.Linear(32, width), nn.Linear(32, width)
        self.head = nn.Linear(2 * width, 10)

    def forward(self, halves: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        left, right = halves
        features = torch.cat([torch.relu(self.left(left.flatten(1))), torch.relu(self.right(right.flatten(1)))], 1)
        return self.head(features)


def test_tuple_inputs_train_under_the_planner_as_alone(tmp_path) -> None:
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(HalfImages(train), HalfImages(val), epochs=2, batch_size=64, optimizer="sgd",
                                      lr=0.1)
    results = {}
    for optimize in (False, True):
        exp = td.Experiment(TwoHalves(), ev, td.strategy.GridSearch(), budget=2, store=tmp_path / f"{optimize}.db",
                            name="halves", executor=td.executors.Inline(optimize=optimize),
                            options=td.RunOptions(verbose=False, seed=1))
        exp.run()
        results[optimize] = {t.sample["width"]: t for t in exp.trials()}
    assert sorted(results[True]) == [16, 32]
    for width, alone in results[False].items():
        planned = results[True][width]
        assert alone.status is planned.status is TrialStatus.COMPLETED
        assert planned.metric > 0.5  # learned from both halves in 2 epochs (10 classes)
        for name, values in alone.metrics.items():
            assert planned.metrics[name] == pytest.approx(values, abs=1e-5), (width, name)
    # the two trials read one data pipeline
    assert {t.info["unit"]["kind"] for t in results[True].values()} == {"cse"}


def test_example_batch_is_collated_as_the_trainer_collates() -> None:
    train, _ = td.datasets.digits()
    cfg = td.evaluators.Classification(HalfImages(train), HalfImages(train), epochs=1, batch_size=4).config()
    example = _example_batch(cfg)
    assert isinstance(example, list) and [t.shape for t in example] == [torch.Size([8, 1, 8, 4])] * 2
    assert not example_tensor(example) and example_bytes(example) == 2 * 32 * 4
    plain = td.evaluators.Classification(train, train, epochs=1, batch_size=4).config()
    assert example_tensor(_example_batch(plain)) and example_bytes(_example_batch(plain)) == 64 * 4
