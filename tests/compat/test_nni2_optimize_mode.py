"""NNI 2.x's ``optimize_mode`` on a strategy sets the direction of the run's objective: the search,
the live line's best and the stored objective follow it."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

import tridens.compat.nni as nni
import tridens.compat.nni.retiarii.nn.pytorch as nn
import tridens.compat.nni.retiarii.strategy as strategy
from tridens.compat.nni.retiarii import model_wrapper
from tridens.compat.nni.retiarii.evaluator import FunctionalEvaluator
from tridens.compat.nni.retiarii.experiment.pytorch import RetiariiExeConfig, RetiariiExperiment
from tridens.datasets import digits
from tridens.store import Store

TRAIN, VAL = digits()


@model_wrapper
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        hidden = nn.ValueChoice([4, 8, 16, 32], label="hidden")
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.body(x)


def fit(model_cls):
    """NNI 2.x's evaluation function: one epoch on digits, the validation loss (lower is better) reported."""
    model = model_cls()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    (x, y), (vx, vy) = TRAIN.tensors, VAL.tensors
    for i in range(0, len(x), 64):
        opt.zero_grad()
        F.cross_entropy(model(x[i:i + 64]), y[i:i + 64]).backward()
        opt.step()
    with torch.no_grad():
        nni.report_final_result(F.cross_entropy(model(vx), vy).item())


def test_optimize_mode_minimize_sets_the_runs_objective_and_its_live_best(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRIDENS_DB", str(tmp_path / "nni.db"))
    evolution = strategy.RegularizedEvolution(optimize_mode="minimize", population_size=2, sample_size=2)
    exp = RetiariiExperiment(Net(), FunctionalEvaluator(fit), [], evolution)
    config = RetiariiExeConfig("local")
    config.experiment_name = "val-loss"
    config.max_trial_number = 4
    exp.run(config)
    lines = re.findall(r"trial \d+ completed value=(\d+\.\d+) best=(\d+\.\d+)", capsys.readouterr().err)
    assert len(lines) == 4
    values = [float(v) for v, _ in lines]
    assert [float(b) for _, b in lines] == [min(values[:i + 1]) for i in range(4)]  # the lowest loss so far
    assert len(set(values)) > 1  # (the minimum differs from the maximum somewhere)
    with Store(tmp_path / "nni.db", readonly=True) as store:
        assert store.get_experiment("val-loss").objective().mode == "min"
    trials = exp.experiment.trials()
    lowest = min(trials, key=lambda t: (t.metric, t.id))
    highest = max(trials, key=lambda t: (t.metric, -t.id))
    assert exp.export_top_models(formatter="dict") == [lowest.sample]  # by default, the run's mode
    assert exp.export_top_models(optimize_mode="minimize", formatter="dict") == [lowest.sample]
    assert exp.export_top_models(optimize_mode="maximize", formatter="dict") == [highest.sample]
