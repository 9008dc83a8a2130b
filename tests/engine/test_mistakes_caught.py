"""Mistakes a user coming from Optuna makes, caught before training (or at the first report, where
only the reports say what the evaluator measures): never a silent wrong result."""

import pytest
import torch
from torch import nn

import tridens as td
from tridens.errors import UnknownMetric
from tridens.store import Store
from .spaces import WidthMLP as Net
from .spaces import digits_loop


def train_loss_acc(lr, hidden=32, epochs=2):
    """A user's own loop on digits reporting {"loss": ..., "acc": ...} (no 'accuracy')."""
    digits_loop(lr, hidden, epochs, loss_and_acc=True)


def loop_evaluator():
    return td.evaluators.FunctionalEvaluator(train_loss_acc, lr=td.loguniform("lr", 1e-3, 3e-2))


def classification(data, **kw):
    train, val = data
    return td.evaluators.Classification(train, val, **{"epochs": 2, "batch_size": 128, "optimizer": "adam", "lr": 0.01, **kw})


def _experiments(store):
    if not store.exists():
        return []
    with Store(store, readonly=True) as db:
        return [r.name for r in db.experiments()]


# -- names the evaluator never reports ---------------------------------------------------------------

@pytest.mark.parametrize("executor", [None, td.executors.Process(workers=1)], ids=["inline", "process"])
def test_a_misspelled_objective_stops_the_run_at_the_first_report(tmp_path, executor):
    store = tmp_path / "typo.db"
    exp = td.Experiment(None, loop_evaluator(), "random", budget=3, store=store, name="typo", objective="accuracy",
                        executor=executor, options=td.RunOptions(verbose=False))
    with pytest.raises(UnknownMetric, match=r"'accuracy', which its evaluator does not report: trial 0 reported 'loss', 'acc'"):
        exp.run()
    assert _experiments(store) == []  # nothing was learned: no experiment left behind
    exp.objective = "acc"
    exp.run()
    trials = exp.trials()
    assert len(trials) == 3 and all(t.metric == t.metrics["acc"][-1] > 0.3 for t in trials)


def test_a_misspelled_second_objective_of_a_user_loop_stops_the_run_at_the_first_report(tmp_path):
    exp = td.Experiment(None, loop_evaluator(), "random", budget=2, store=tmp_path / "s.db", name="s",
                        objective="acc", options=td.RunOptions(second_objective=("los", "min"), verbose=False))
    with pytest.raises(UnknownMetric, match=r"'second_objective' of experiment 's' is 'los'.*reported 'acc', 'loss'"):
        exp.run()


def test_the_error_is_one_line():
    from tridens.engine._preflight import check_names

    with pytest.raises(UnknownMetric) as info:
        check_names([], ("flop", "min"), td.Objective(), ["val_acc"])
    assert "\n" not in str(info.value)


# -- typos in settings, refused before training -------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    ({"constraints": [td.strategy.Constraint("param", max=1e5)]},
     r"Constraint\(metric='param'.*bounds 'param'; the facts measured before training are 'params', 'flops', 'latency'"),
    ({"second_objective": ("flop", "min")},
     r"'second_objective' of Experiment is 'flop', which is neither a measured fact \('params', 'flops', 'latency'\) "
     r"nor a metric the evaluator reports \('val_acc', 'val_loss', 'train_loss'\)"),
    ({"strategy": td.strategy.ASHA(max_steps=50)},
     r"'max_steps' parameter of ASHA is 50, more than the evaluator's epochs=2: pass max_steps in the range \[1, 2\]"),
    ({"strategy": td.strategy.TPE(stopping=td.strategy.ASHA(max_steps=50))},
     r"'max_steps' parameter of ASHA is 50, more than the evaluator's epochs=2: pass max_steps in the range \[1, 2\]"),
])
def test_typos_in_settings_are_refused_before_training(tmp_path, data, kw, match):
    store = tmp_path / "typo.db"
    options = {k: v for k, v in kw.items() if k != "strategy"}
    exp = td.Experiment(Net(), classification(data), kw.get("strategy", "random"), budget=4, store=store, name="typo",
                        options=td.RunOptions(verbose=False, **options))
    with pytest.raises(ValueError, match=match):
        exp.run()
    assert _experiments(store) == []


def test_a_constraint_on_a_search_without_a_model_is_refused(tmp_path):
    exp = td.Experiment(None, loop_evaluator(), "random", budget=2, store=tmp_path / "c.db", name="c",
                        objective="acc",
                        options=td.RunOptions(constraints=[td.strategy.Constraint("params", max=1e5)], verbose=False))
    with pytest.raises(UnknownMetric, match="none: there is no model to measure"):
        exp.run()


def test_the_right_names_still_run(tmp_path, data):
    exp = td.Experiment(Net(), classification(data), td.strategy.ASHA(max_steps=2), budget=3,
                        store=tmp_path / "ok.db", name="ok",
                        options=td.RunOptions(constraints=[td.strategy.Constraint("params", max=1e5)], second_objective=("val_loss", "min"), verbose=False))
    exp.run()
    assert len(exp.trials()) == 2 and exp.best().metric > 0.3  # (two widths)


# -- errors under plain `python script.py` -------------------------------------------------------------

SCRIPT = '''
import sys
import tridens as td
from torch import nn
from tridens import nn as tnn


class Net(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [16, 32])
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, w), nn.ReLU(), nn.Linear(w, 10))

    def forward(self, x):
        return self.net(x)


train, val = td.datasets.digits()
evaluator = td.evaluators.Classification(train, val, epochs=1, batch_size=128, optimizer="adam", lr=0.01)
if sys.argv[1] == "typo":
    td.Experiment(Net(), evaluator, td.strategy.ASHA(max_steps=50), budget=2, store="s.db").run()
else:
    td.Experiment(Net(), evaluator, "random", budget=1, store="s.db",
                  options=td.RunOptions(verbose=False)).run()
    raise ValueError("my own bug")
'''


def test_a_pre_run_error_under_plain_python_prints_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "search.py").write_text(SCRIPT)
    typo = subprocess.run([sys.executable, "search.py", "typo"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert typo.returncode == 1
    assert typo.stderr.strip().splitlines() == [
        "tridens: error: The 'max_steps' parameter of ASHA is 50, more than the evaluator's epochs=1: pass max_steps "
        "in the range [1, 1] (or leave it out to take the epochs). (TRIDENS_DEBUG=1 shows the traceback)"]
    own = subprocess.run([sys.executable, "search.py", "own"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert own.returncode == 1 and "Traceback" in own.stderr and own.stderr.strip().endswith("ValueError: my own bug")
    debug = subprocess.run([sys.executable, "search.py", "typo"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env={**__import__("os").environ, "TRIDENS_DEBUG": "1"})
    assert "Traceback" in debug.stderr


# -- trials as a user reads them ------------------------------------------------------------------------

def test_a_trial_reads_short_with_its_epochs_and_status(tmp_path):
    exp = td.Experiment(None, loop_evaluator(), "random", budget=2, store=tmp_path / "r.db", name="r",
                        objective="acc", options=td.RunOptions(verbose=False))
    exp.run()
    best = exp.best()
    assert best.epochs == 2 == len(best.metrics["acc"])
    assert str(best.status) == "completed" and f"{best.status}" == "completed"
    text = repr(best)
    assert text.startswith(f"Trial(number={best.number}, status='completed', metric=") and "epochs=2" in text
    assert "\n" not in text and len(text) < 160 and "metrics=" not in text


# -- labels checked against the loss before the first trial -------------------------------------------

def _with_labels(data, cast):
    from torch.utils.data import TensorDataset

    return tuple(TensorDataset(ds.tensors[0], cast(ds.tensors[1])) for ds in data)


@pytest.mark.parametrize("cast, match", [
    (lambda y: y.float(), r"The 'train' data of Classification has float32 labels holding class indices, .* pass y\.long\(\)"),
    (lambda y: nn.functional.one_hot(y, 10), r"The 'train' data of Classification has one-hot labels \(int64 rows of 10\).*y\.argmax\(dim=1\)"),
    (lambda y: nn.functional.one_hot(y, 10).float(), r"one-hot labels \(float32 rows of 10\)"),
])
def test_labels_a_classification_loss_cannot_take_are_refused_before_training(tmp_path, data, cast, match):
    store = tmp_path / "labels.db"
    exp = td.Experiment(Net(), classification(_with_labels(data, cast)), "random", budget=2, store=store,
                        name="labels", options=td.RunOptions(verbose=False))
    with pytest.raises(ValueError, match=match) as info:
        exp.run()
    assert "\n" not in str(info.value) and _experiments(store) == []


def test_narrow_integer_labels_train_as_int64_labels_do(tmp_path, data):
    runs = {}
    for name, dtype in (("int64", torch.int64), ("int32", torch.int32), ("uint8", torch.uint8)):
        exp = td.Experiment(Net(), classification(_with_labels(data, lambda y: y.to(dtype))), "grid", budget=2,
                            store=tmp_path / "n.db", name=name, options=td.RunOptions(verbose=False))
        exp.run()
        runs[name] = [(t.sample, t.metrics) for t in exp.trials()]
    assert runs["int32"] == runs["int64"] == runs["uint8"] and len(runs["int64"]) == 2


# -- a rerun after a failure trains; a changed evaluator is named --------------------------------------

def train_with_labels(lr, labels="float", epochs=1):
    """A user's loop whose first version passes float labels to cross entropy (every trial fails)."""
    digits_loop(lr, 32, epochs, float_labels=labels == "float")


@pytest.mark.parametrize("retry_failed", [True, False])
def test_a_rerun_after_every_trial_failed_trains(tmp_path, retry_failed):
    store = tmp_path / "fix.db"

    def experiment(labels, **options):
        evaluator = td.evaluators.FunctionalEvaluator(train_with_labels, lr=td.loguniform("lr", 1e-3, 3e-2), labels=labels)
        return td.Experiment(None, evaluator, "random", budget=3, store=store, name="fix",
                             options=td.RunOptions(verbose=False, **options))

    with pytest.raises(td.TridensError, match="every trial of 'fix' failed"):
        experiment("float").run()
    exp = experiment("long", retry_failed=retry_failed)  # the fix: a changed setting, but nothing trained to compare
    exp.run()
    trials = exp.trials()
    done = [t for t in trials if t.status is td.TrialStatus.COMPLETED]
    assert len(done) == 3 and all(t.metric > 0.2 for t in done)  # (one epoch)
    if retry_failed:  # the failed trials trained again: same numbers, samples and seeds
        assert [t.number for t in trials] == [0, 1, 2]
    else:  # kept as they were; new trials took their place in the budget
        assert [t.number for t in done] == [3, 4, 5] and sum(t.status is td.TrialStatus.FAILED for t in trials) == 3
    assert "max_trials=3 reached" in exp.stop_reason


def test_a_rerun_with_changed_epochs_or_data_is_refused_naming_the_change(tmp_path, data):
    from tridens.engine._preflight import EvaluatorChanged
    from torch.utils.data import Subset

    store = tmp_path / "changed.db"

    def experiment(evaluator, **options):
        return td.Experiment(Net(), evaluator, "grid", budget=2, store=store, name="c",
                             options=td.RunOptions(verbose=False, **options))

    experiment(classification(data, epochs=1)).run()
    with pytest.raises(EvaluatorChanged, match=r"another evaluator \(changed: epochs 1 -> 2\).*resume='force'"):
        experiment(classification(data, epochs=2)).run()
    train, val = data
    with pytest.raises(EvaluatorChanged, match=r"changed: the 'val' data\)"):
        experiment(classification((train, Subset(val, range(200))), epochs=1)).run()
    exp = experiment(classification(data, epochs=1))
    exp.run()  # the same evaluator (a new Classification object, the same data) resumes
    assert len(exp.trials()) == 2


def test_a_rerun_with_changed_training_code_is_refused(tmp_path):
    from tridens.engine._preflight import EvaluatorChanged

    def train_v2(lr, labels="long", epochs=1):
        return train_with_labels(lr * 0.5, labels, epochs)  # the user changed what the loop computes

    store = tmp_path / "code.db"
    for fn, error in ((train_with_labels, None), (train_v2, r"changed: the code of .*train_v2")):
        evaluator = td.evaluators.FunctionalEvaluator(fn, lr=td.loguniform("lr", 1e-3, 3e-2), labels="long")
        exp = td.Experiment(None, evaluator, "random", budget=1, store=store, name="code",
                            options=td.RunOptions(verbose=False))
        if error is None:
            exp.run()
        else:
            with pytest.raises(EvaluatorChanged, match=error):
                exp.run()
