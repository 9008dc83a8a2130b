"""td.retrain: a found architecture trained again with an evaluator of the user's choice, from an
export, a trial or a module (real training on scikit-learn's digits)."""

import pytest
import torch

import tridens as td
from tridens.errors import TridensError

from .spaces import WidthMLP as Net


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


@pytest.fixture(scope="module")
def searched(tmp_path_factory, data):
    """A 4-trial search (width x lr), its best trial and its export."""
    root = tmp_path_factory.mktemp("retrain")
    train, val = data
    evaluator = td.evaluators.Classification(train, val, epochs=2, batch_size=128, optimizer="adam",
                                             lr=td.choice("lr", [0.01, 0.003]))
    exp = td.Experiment(Net(), evaluator, "grid", budget=4, store=root / "s.db", name="s",
                        options=td.RunOptions(verbose=False))
    exp.run()
    [folder] = exp.export(root / "best")
    return exp, evaluator, exp.best(), folder


def test_from_scratch_with_the_trials_evaluator_reproduces_its_metrics(searched):
    exp, evaluator, best, folder = searched
    again = td.retrain(folder.parent, evaluator)  # the export directory: its best model
    assert again.sample == best.sample and again.seed == best.seed
    assert set(again.metrics) >= {"val_acc", "val_loss", "train_loss"}
    torch.testing.assert_close(again.metrics["val_acc"], best.metrics["val_acc"], rtol=0, atol=1e-4)
    assert again.metric == pytest.approx(best.metric, abs=1e-4)
    # a trial and its experiment's space do the same
    from_trial = td.retrain(best, evaluator, space=Net())
    torch.testing.assert_close(from_trial.metrics["val_acc"], best.metrics["val_acc"], rtol=0, atol=1e-4)


def test_another_evaluator_longer_training(searched, data):
    _, _, best, folder = searched
    train, val = data
    final = td.evaluators.Classification(train, val, epochs=4, batch_size=64, optimizer="adam", lr=0.005)
    result = td.retrain(folder, final, seed=7)
    assert len(result.metrics["val_acc"]) == 4 and result.seed == 7
    assert result.metric == result.metrics["val_acc"][-1] > 0.85
    assert result.model.head.in_features == best.sample["width"]  # the exported architecture
    x = val.tensors[0][:16]
    with torch.no_grad():
        assert result.model.eval()(x).shape == (16, 10)


def test_fine_tuning_starts_from_the_exported_weights(searched, data):
    _, _, best, folder = searched
    train, val = data
    one = td.evaluators.Classification(train, val, epochs=1, batch_size=128, optimizer="adam", lr=1e-4)
    tuned = td.retrain(folder, one, weights="trained")
    scratch = td.retrain(folder, one)
    assert tuned.metrics["val_acc"][0] > best.metric - 0.05 > scratch.metrics["val_acc"][0]


def test_mistakes_are_one_line(searched, data):
    _, evaluator, best, folder = searched
    train, val = data
    needs_momentum = td.evaluators.Classification(train, val, epochs=1, optimizer="sgd", lr=0.1,
                                                  momentum=td.choice("momentum", [0.0, 0.9]))
    with pytest.raises(TridensError, match=r"hyperparameter 'momentum' has no value in the sample .*pass sample="):
        td.retrain(folder, needs_momentum)
    assert len(td.retrain(folder, needs_momentum, sample={"momentum": 0.9}).metrics["val_acc"]) == 1
    with pytest.raises(TridensError, match=rf"retrain\(trial {best.label}, \.\.\.\) needs space="):
        td.retrain(best, evaluator)
    with pytest.raises(ValueError, match=r"'weights' parameter of retrain must be one of \['init', 'trained'\]"):
        td.retrain(folder, evaluator, weights="pretrained")
