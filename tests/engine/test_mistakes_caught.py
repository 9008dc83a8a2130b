"""Mistakes a user coming from Optuna makes, caught before training (or at the first report, where
only the reports say what the evaluator measures): never a silent wrong result."""

import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.errors import UnknownMetric
from tridens.store import Store


def train_loss_acc(lr, hidden=32, epochs=2):
    """A user's own loop on digits reporting {"loss": ..., "acc": ...} (no 'accuracy')."""
    train, val = td.datasets.digits()
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = train.tensors
    for epoch in range(epochs):
        for i in range(0, len(x), 128):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 128]), y[i:i + 128]).backward()
            opt.step()
        with torch.no_grad():
            out = model(val.tensors[0])
            loss = nn.functional.cross_entropy(out, val.tensors[1]).item()
            acc = (out.argmax(1) == val.tensors[1]).float().mean().item()
        td.report({"loss": loss, "acc": acc}, step=epoch)


def loop_evaluator():
    return td.evaluators.FunctionalEvaluator(train_loss_acc, lr=td.loguniform("lr", 1e-3, 3e-2))


class Net(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [16, 32])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, w), nn.ReLU())
        self.head = nn.Linear(w, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


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
    exp = td.Experiment(None, loop_evaluator(), "random", max_trials=3, store=store, name="typo",
                        objective="accuracy", executor=executor, verbose=False)
    with pytest.raises(UnknownMetric, match=r"'accuracy', which its evaluator does not report: trial 0 reported 'loss', 'acc'"):
        exp.run()
    assert _experiments(store) == []  # nothing was learned: no experiment left behind
    exp.objective = "acc"
    exp.run()
    trials = exp.trials()
    assert len(trials) == 3 and all(t.metric == t.metrics["acc"][-1] > 0.3 for t in trials)


def test_a_misspelled_second_objective_of_a_user_loop_stops_the_run_at_the_first_report(tmp_path):
    exp = td.Experiment(None, loop_evaluator(), "random", max_trials=2, store=tmp_path / "s.db", name="s",
                        objective="acc", second_objective=("los", "min"), verbose=False)
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
])
def test_typos_in_settings_are_refused_before_training(tmp_path, data, kw, match):
    store = tmp_path / "typo.db"
    kw = {"strategy": "random", **kw}
    exp = td.Experiment(Net(), classification(data), max_trials=4, store=store, name="typo", verbose=False, **kw)
    with pytest.raises(ValueError, match=match):
        exp.run()
    assert _experiments(store) == []


def test_a_constraint_on_a_search_without_a_model_is_refused(tmp_path):
    exp = td.Experiment(None, loop_evaluator(), "random", max_trials=2, store=tmp_path / "c.db", name="c",
                        objective="acc", constraints=[td.strategy.Constraint("params", max=1e5)], verbose=False)
    with pytest.raises(UnknownMetric, match="none: there is no model to measure"):
        exp.run()


def test_the_right_names_still_run(tmp_path, data):
    exp = td.Experiment(Net(), classification(data), td.strategy.ASHA(max_steps=2), max_trials=3,
                        store=tmp_path / "ok.db", name="ok", constraints=[td.strategy.Constraint("params", max=1e5)],
                        second_objective=("val_loss", "min"), verbose=False)
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
    td.Experiment(Net(), evaluator, td.strategy.ASHA(max_steps=50), max_trials=2, store="s.db").run()
else:
    td.Experiment(Net(), evaluator, "random", max_trials=1, store="s.db", verbose=False).run()
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
    exp = td.Experiment(None, loop_evaluator(), "random", max_trials=2, store=tmp_path / "r.db", name="r",
                        objective="acc", verbose=False)
    exp.run()
    best = exp.best()
    assert best.epochs == 2 == len(best.metrics["acc"])
    assert str(best.status) == "completed" and f"{best.status}" == "completed"
    text = repr(best)
    assert text.startswith(f"Trial(number={best.number}, status='completed', metric=") and "epochs=2" in text
    assert "\n" not in text and len(text) < 160 and "metrics=" not in text
