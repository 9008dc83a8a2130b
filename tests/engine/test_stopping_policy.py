"""Any proposing strategy with any stopping rule, as Optuna pairs a sampler with a pruner: TPE
proposes, ASHA stops, on real training (an MLP on scikit-learn's digits)."""

import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.trial import TrialStatus


class Net(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [16, 32, 64])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, w), nn.ReLU())
        self.head = nn.Linear(w, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.head(self.body(x))


def test_tpe_proposes_and_asha_stops_on_digits(tmp_path):
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=9, batch_size=128, optimizer="sgd",
                                             lr=td.loguniform("lr", 1e-4, 0.3))
    strategy = td.strategy.TPE(batch_size=4, n_startup_trials=4, stopping=td.strategy.ASHA(reduction_factor=3))
    exp = td.Experiment(Net(), evaluator, strategy, budget=12, store=tmp_path / "s.db", name="tpe-asha",
                        options=td.RunOptions(seed=3, verbose=False))
    exp.run()
    trials = exp.trials()
    assert len(trials) == 12
    stopped = [t for t in trials if t.status is TrialStatus.STOPPED]
    completed = [t for t in trials if t.status is TrialStatus.COMPLETED]
    # ASHA took max_steps from the evaluator's epochs: rungs after steps 1 and 3, trials train 9 at most
    assert stopped and completed
    assert {len(t.metrics["val_acc"]) for t in stopped} <= {1, 3}
    assert all(len(t.metrics["val_acc"]) == 9 for t in completed)
    assert sum(len(t.metrics["val_acc"]) for t in trials) < 12 * 9
    assert exp.best().status is TrialStatus.COMPLETED and exp.best().metric > 0.8


def test_a_users_loop_without_epochs_names_the_stopping_rule_to_give_max_steps(tmp_path):
    def train(lr):
        td.report(lr, step=0)

    exp = td.Experiment(None, td.evaluators.FunctionalEvaluator(train, lr=td.choice("lr", [0.1, 0.2])),
                        td.strategy.TPE(stopping=td.strategy.ASHA()), budget=2, store=tmp_path / "f.db",
                        options=td.RunOptions(verbose=False))
    with pytest.raises(ValueError, match=r"^The 'max_steps' parameter of ASHA must be an int in the range \[1, inf\). "
                                         r"Got None instead. FunctionalEvaluator has no fixed 'epochs' to take it from: "
                                         r"pass td.strategy.ASHA\(max_steps=N\)"):
        exp.run()
