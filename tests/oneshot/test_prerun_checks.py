"""A one-shot search checks what a multi-trial search checks before it trains: the objective's
name, the names the second objective and the constraints read, the data against the loss."""

import pytest
import torch

import tridens as td
from tridens.errors import UnknownMetric
from tridens.store import Store

from .spaces import DigitsCNN


def _nothing_stored(db):
    if not db.exists():
        return True
    with Store(db, readonly=True) as store:
        return not store.experiments()


@pytest.mark.parametrize("kw, match", [
    ({"objective": "accuracy"},
     r"^The 'objective' of the experiment is 'accuracy', which Classification does not report; it reports "
     r"\['val_acc', 'val_loss', 'train_loss'\]\.$"),
    ({"options": td.RunOptions(verbose=False, second_objective=("flop", "min"))},
     r"'second_objective' of Experiment is 'flop', which is neither a measured fact"),
])
def test_misspelled_names_are_refused_before_the_supernet_trains(tmp_path, digits_data, kw, match):
    train, val = digits_data
    evaluator = td.evaluators.Classification(train, val, epochs=1, batch_size=64, optimizer="adam", lr=0.01)
    db = tmp_path / "t.db"
    kw = {"options": td.RunOptions(verbose=False), **kw}
    exp = td.Experiment(DigitsCNN(), evaluator, td.oneshot.DARTS(samples=2), store=db, name="typo", **kw)
    with pytest.raises(UnknownMetric, match=match):
        exp.run()
    assert _nothing_stored(db)


def test_labels_that_do_not_fit_the_loss_are_refused_before_the_supernet_trains(tmp_path, digits_data):
    train, val = digits_data
    x, y = train.tensors
    one_hot = torch.utils.data.TensorDataset(x, torch.nn.functional.one_hot(y, 10).float())
    evaluator = td.evaluators.Classification(one_hot, val, epochs=1, batch_size=64, optimizer="adam", lr=0.01)
    db = tmp_path / "t.db"
    exp = td.Experiment(DigitsCNN(), evaluator, td.oneshot.RandomOneShot(samples=2, population=2), store=db,
                        name="labels", options=td.RunOptions(verbose=False))
    with pytest.raises(ValueError, match="label"):
        exp.run()
    assert _nothing_stored(db)
