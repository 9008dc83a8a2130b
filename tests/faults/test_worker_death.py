"""A pool worker that dies inside a unit (SIGKILL) costs only the work it held: the unit's members
are retried once on a fresh worker, a stage tree from its stored stages; every trial completes
with the metrics of an undisturbed run. Real worker processes, real training on digits."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

import tridens as td
from tridens.trial import TrialStatus

from tests.xopt.stage_script import Net, grid_evaluator


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


class KillWorkersOnce(td.loggers.Callback):
    """When the first trial ends (its tree trained on: stages stored), SIGKILL every live worker
    of the pool (in the driver)."""

    def __init__(self, executor):
        self.executor, self.killed = executor, []

    def on_trial_end(self, trial):
        if not self.killed:
            self.killed = list(self.executor.pids().values())
            for pid in self.killed:
                os.kill(pid, signal.SIGKILL)


def run(data, store, executor, callbacks=()):
    exp = td.Experiment(Net(), grid_evaluator(data, [2, 3], [0.1, 0.5]), td.strategy.GridSearch(batch_size=16),
                        store=store, name="tree", options=td.RunOptions(seeds="per-architecture", verbose=False),
                        executor=executor, callbacks=list(callbacks))
    exp.run()
    return {json.dumps(t.sample, sort_keys=True): t for t in exp.trials()}


def test_a_worker_killed_inside_a_stage_tree_has_its_members_retried_from_the_stored_stages(data, tmp_path, caplog):
    undisturbed = run(data, tmp_path / "inline.db", td.executors.Inline())
    pool = td.executors.Process(workers=2)
    killer = KillWorkersOnce(pool)
    with caplog.at_level(logging.INFO, logger="tridens"):
        trials = run(data, tmp_path / "pool.db", pool, [killer])
    assert killer.killed
    assert trials.keys() == undisturbed.keys() and len(trials) == 8
    for key, trial in trials.items():
        assert trial.status is TrialStatus.COMPLETED, (key, trial.error)
        assert trial.metrics == undisturbed[key].metrics, key
    assert "retried once on a fresh worker" in caplog.text
    assert "trained by this experiment before) sent to a pool worker: not trained again" in caplog.text
    resumed = [t for t in trials.values() if t.info.get("stage_store")]   # from the stages stored before the kill
    assert resumed and all(t.info["stage_store"]["experiment"] == "tree" for t in resumed)
