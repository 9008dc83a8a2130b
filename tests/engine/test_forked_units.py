"""A group's units side by side in forked processes (the in-process executor with a thread policy
that runs several units at once), against the same experiment one unit at a time: real training on
digits, real SQLite stores, real child processes. A child that hangs or dies is a case of the
executor conformance suite (``test_executor_conformance.py``, the ``"forked"`` backend)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn as nn

import tridens as td
import tridens.nn as tnn
from tridens.engine import ThreadPolicy
from tridens.trial import TrialStatus
from tridens.xopt import Settings

from .spaces import TinyMLP

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forked units need os.fork")

ONE_AT_A_TIME = ThreadPolicy(threads=1, concurrent=1)
SIDE_BY_SIDE = ThreadPolicy(threads=1, concurrent=2)


def evaluator(data, epochs=3, lrs=(0.01, 0.003)):
    train, val = data
    return td.evaluators.Classification(train=train, val=val, epochs=epochs, batch_size=128, optimizer="adam",
                                        lr=td.choice("lr", list(lrs)))


def run(space, ev, strategy, tmp_path, name, policy, optimize, trials, executor=None):
    """``executor`` (made by the caller with ``optimize``), else ``Inline(threads=policy, optimize=optimize)``."""
    executor = executor if executor is not None else td.executors.Inline(threads=policy, optimize=optimize)
    exp = td.Experiment(space, ev, strategy, budget=trials, store=str(tmp_path / f"{name}.db"), name=name,
                        options=td.RunOptions(verbose=False), executor=executor)
    exp.run()
    return {t.id: t for t in exp.trials()}


class Widths(tnn.ModelSpace):
    """Two widths x two depths: four model structures."""

    def __init__(self):
        super().__init__()
        h = td.choice("hidden", [8, 16])
        depth = td.choice("depth", [1, 2])
        layers = [nn.Flatten(), nn.Linear(64, h), nn.ReLU()]
        self.body = nn.Sequential(*layers, tnn.Repeat(lambda i: nn.Sequential(nn.Linear(h, h), nn.ReLU()), depth),
                                  nn.Linear(h, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def test_separate_trials_side_by_side_end_as_one_at_a_time_under_asha(digits_data, tmp_path, caplog):
    # optimize=False: each trial trains alone, so every metric is bit for bit the same; ASHA's
    # rungs need every report of a round before any verdict
    strategy = lambda: td.strategy.ASHA(min_steps=1, max_steps=3, reduction_factor=2, batch_size=8)  # noqa: E731
    alone = run(Widths(), evaluator(digits_data), strategy(), tmp_path, "alone", ONE_AT_A_TIME, False, 8)
    with caplog.at_level(logging.INFO, logger="tridens"):
        side = run(Widths(), evaluator(digits_data), strategy(), tmp_path, "side", SIDE_BY_SIDE, False, 8)
    assert "units in 2 forked processes" in caplog.text
    assert side.keys() == alone.keys() and len(side) == 8
    assert {t.status for t in side.values()} == {TrialStatus.COMPLETED, TrialStatus.STOPPED}
    for tid, trial in side.items():
        assert trial.status is alone[tid].status, tid
        assert trial.metrics == alone[tid].metrics, tid
        assert trial.info["train_seconds"] > 0
        # the final weights came back from the children into the store, as trained alone
        final = tensors(torch.load(trial.checkpoint, weights_only=True))
        assert final and final == tensors(torch.load(alone[tid].checkpoint, weights_only=True)), tid


def tensors(obj, prefix=""):
    """Every tensor in a nested checkpoint, by path, as plain lists (comparable with ==)."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.tolist()}
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            out.update(tensors(value, f"{prefix}/{key}"))
        return out
    return {}


def test_a_mixed_unit_splits_by_members_and_trains_as_in_one_process(digits_data, tmp_path, caplog):
    forced = Settings().with_batching(mode="force")
    alone = run(TinyMLP(), evaluator(digits_data), td.strategy.GridSearch(), tmp_path, "alone", ONE_AT_A_TIME, forced, 4)
    with caplog.at_level(logging.INFO, logger="tridens"):
        side = run(TinyMLP(), evaluator(digits_data), td.strategy.GridSearch(), tmp_path, "side", SIDE_BY_SIDE,
                   forced, 4)
    assert "is split in two for the 2 processes: [1, 2]; [3, 4]" in caplog.text
    for tid, trial in side.items():   # the same batched members, each half reading its own copy of the data
        assert trial.status is TrialStatus.COMPLETED, trial.error
        assert trial.info["unit"]["kind"] == "cse" and len(trial.info["unit"]["trials"]) == 2
        for name, values in alone[tid].metrics.items():
            assert trial.metrics[name] == pytest.approx(values, rel=1e-6, abs=1e-7), (tid, name)


def test_measured_decisions_and_log_records_come_back_from_the_children(digits_data, tmp_path, caplog):
    auto = Settings().with_batching(mode="auto", override_speedup=3.0)
    executor = td.executors.Inline(threads=SIDE_BY_SIDE, optimize=auto)
    with caplog.at_level(logging.INFO, logger="tridens"):
        side = run(TinyMLP(), evaluator(digits_data, epochs=1), td.strategy.GridSearch(), tmp_path, "side",
                   SIDE_BY_SIDE, auto, 4, executor)
    assert all(t.status is TrialStatus.COMPLETED for t in side.values())
    # decided in the children: their log lines reach the driver's handlers, their ratios its planner
    assert caplog.text.count("settings.override_speedup: 3.00x") == 2
    # as data, added to the run's plan context
    assert [v for values in executor.context.plan.decisions.speedups.values() for v in values] == [3.0, 3.0]


def test_stage_trees_stay_in_the_driver(digits_data, tmp_path, caplog):
    from tests.xopt.stage_script import Net, grid_evaluator

    with caplog.at_level(logging.INFO, logger="tridens"):
        exp = td.Experiment(Net(), grid_evaluator(digits_data, [2, 3], [0.1, 0.5]),
                            td.strategy.GridSearch(batch_size=16), store=str(tmp_path / "s.db"),
                            options=td.RunOptions(seeds="per-architecture", verbose=False),
                            executor=td.executors.Inline(threads=SIDE_BY_SIDE))
        exp.run()
    assert "units one at a time in this process: stage tree units read and write the store" in caplog.text
    assert "forked processes" not in caplog.text
    assert all(t.status is TrialStatus.COMPLETED for t in exp.trials())
