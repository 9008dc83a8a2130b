"""A user's loop reporting dicts names the objective by their first key: the run records that
name, strategies read the curves under it, and a resumed run keeps it."""

from __future__ import annotations

import torch
from torch import nn

import tridens as td
from tridens.store import Store

TRAIN, VAL = td.datasets.digits()


def train(lr, hidden):
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    (x, y), (vx, vy) = TRAIN.tensors, VAL.tensors
    for epoch in range(3):
        for i in range(0, len(x), 128):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[i:i + 128]), y[i:i + 128])
            loss.backward()
            opt.step()
        with torch.no_grad():
            td.report({"val_acc": (model(vx).argmax(1) == vy).float().mean().item(), "loss": loss.item()}, step=epoch)


def test_the_first_reported_key_names_the_objective_for_the_strategy_the_store_and_a_resume(tmp_path, capsys):
    store = tmp_path / "t.db"
    evaluator = td.evaluators.FunctionalEvaluator(train, lr=td.loguniform("lr", 1e-3, 0.5), hidden=td.choice("hidden", [8, 32]))

    def run(max_trials: int) -> td.Experiment:
        strategy = td.strategy.ASHA(min_steps=1, max_steps=3, reduction_factor=3, batch_size=3)
        return td.Experiment(None, evaluator, strategy, budget=max_trials, store=store, name="hpo").run()

    run(3)
    assert "completed val_acc=" in capsys.readouterr().err
    exp = run(6)  # resumed: the recorded name holds
    assert "completed val_acc=" in capsys.readouterr().err
    with Store(store, readonly=True) as db:
        assert db.get_experiment("hpo").objective() == td.Objective("val_acc", "max")
        trials = db.trials("hpo")
    assert len(trials) == 6 and all(set(t.metrics) == {"val_acc", "loss"} for t in trials)
    assert all(t.metric == t.metrics["val_acc"][-1] for t in trials)
    # ASHA promoted by the val_acc curves: some trial stopped at its first rung, the best went on
    assert {len(t.metrics["val_acc"]) for t in trials} >= {1, 3}
    assert max(trials, key=lambda t: t.metric).metric == exp.best().metric
