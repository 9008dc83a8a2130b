"""Small mistakes refused in one line before a run, or said once: a label that is not a str
(it would come back as another label on resume), a negative max_duration, a dataset whose
items do not batch together, and a run with no budget at all (it says how it will end)."""

import math
import warnings

import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn


@pytest.mark.parametrize("make", [lambda: td.choice(123, [1, 2]), lambda: td.uniform(None, 0.0, 1.0),
                                  lambda: td.loguniform(("lr",), 1e-3, 1e-1), lambda: td.randint("", 1, 3)])
def test_a_label_that_is_not_a_non_empty_str_is_refused(make):
    with pytest.raises(ValueError, match="The 'label' parameter of td.[a-z]+ must be a non-empty str. Got .* instead."):
        make()


def _value(x):
    return float(x)


@pytest.mark.parametrize("duration", [-5, -0.5, math.nan, "-5m", True])
def test_a_negative_max_duration_is_refused(tmp_path, duration):
    evaluator = td.evaluators.FunctionalEvaluator(_value, x=td.choice("x", [1, 2]))
    exp = td.Experiment(None, evaluator, "grid", budget=td.Budget(max_trials=2, max_duration=duration),
                        store=tmp_path / "runs.db", name="e", options=td.RunOptions(verbose=False))
    with pytest.raises(ValueError, match="The 'max_duration' parameter of Experiment must be a non-negative number"):
        exp.run()


def _budget_warnings(exp):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exp.run()
    return [str(w.message) for w in caught if "has no budget" in str(w.message)]


def test_a_run_with_no_budget_says_so_once(tmp_path):
    evaluator = td.evaluators.FunctionalEvaluator(_value, x=td.choice("x", [1, 2, 3]))
    exp = td.Experiment(None, evaluator, "random", store=tmp_path / "runs.db", name="e",
                        options=td.RunOptions(verbose=False))
    said = _budget_warnings(exp)
    assert len(said) == 1 and "Random has nothing more to propose or you stop it" in said[0]
    assert "td.Budget(max_trials=" in said[0]
    assert len(exp.trials()) == 3   # the space ran out of new samples
    # a grid is bounded by itself, and a budget bounds any strategy: nothing to say
    grid = td.Experiment(None, evaluator, "grid", store=tmp_path / "runs.db", name="g",
                         options=td.RunOptions(verbose=False))
    assert not _budget_warnings(grid) and len(grid.trials()) == 3
    bounded = td.Experiment(None, evaluator, "random", budget=2, store=tmp_path / "runs.db", name="b",
                            options=td.RunOptions(verbose=False))
    assert not _budget_warnings(bounded)


class _Uneven(torch.utils.data.Dataset):
    """Digits whose every seventh item carries a third element (a dataset built by hand)."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return (x, y) if i % 7 else (x, y, 0)


class _Mlp(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        width = td.choice("width", [8, 16])
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))

    def forward(self, x):
        return self.net(x)


def test_a_dataset_whose_items_do_not_batch_together_is_one_line(tmp_path):
    from tridens.evaluators import InvalidParameter

    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train=_Uneven(train), val=val, epochs=1, batch_size=32)
    exp = td.Experiment(_Mlp(), evaluator, "grid", budget=2, store=tmp_path / "runs.db", name="e",
                        options=td.RunOptions(verbose=False))
    with pytest.raises(InvalidParameter) as caught:
        exp.run()
    message = str(caught.value)
    assert "\n" not in message and "of the dataset _Uneven do not batch together" in message
    assert "(input, label) pair of the same structure" in message
