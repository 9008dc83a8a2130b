"""A pool worker that dies inside a unit (SIGKILL) costs only the work it held: the unit's members
are retried once on a fresh worker, a stage tree from its stored stages, a PBT population's
members from their last rounds (the driver answers that round again, forks and handed states
included); every trial completes with the metrics of an undisturbed run. Real worker processes,
real training on digits."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

import tridens as td
from tridens.trial import TrialStatus

from tests.engine.spaces import TinyMLP
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


KILLING = {}   # the pool whose workers the strategy kills, and the pids it killed (the run copies its strategy)


class PBTKillingTheWorkers(td.strategy.PBT):
    """PBT that SIGKILLs every worker of the pool when the first member's step ``at`` is decided:
    each worker has reported that round and waits for the driver's answer."""

    def __init__(self, at, **kw):
        super().__init__(**kw)
        self.at = at

    def decide(self, trial, step):
        if step == self.at and not KILLING["killed"]:
            KILLING["killed"] = list(KILLING["pool"].pids().values())
            for pid in KILLING["killed"]:
                os.kill(pid, signal.SIGKILL)
        return super().decide(trial, step)


def pbt_run(data, store, executor, strategy):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=4, batch_size=128, optimizer="sgd",
                                      lr=td.loguniform("lr", 1e-3, 0.5))
    exp = td.Experiment(TinyMLP(), ev, strategy, executor=executor, store=store, name="pbt",
                        budget=td.Budget(max_trials=4), options=td.RunOptions(seed=3, verbose=False))
    return {t.number: t for t in exp.run().trials()}


def test_a_worker_killed_during_pbt_has_its_members_go_on_from_their_last_round(data, tmp_path, caplog):
    undisturbed = pbt_run(data, tmp_path / "calm.db", td.executors.Process(workers=2),
                          td.strategy.PBT(population=4, interval=1, hyperparams=["lr"]))
    pool = td.executors.Process(workers=2)
    KILLING.update(pool=pool, killed=[])
    with caplog.at_level(logging.INFO, logger="tridens"):
        trials = pbt_run(data, tmp_path / "killed.db", pool,
                         PBTKillingTheWorkers(at=1, population=4, interval=1, hyperparams=["lr"]))
    assert len(KILLING["killed"]) == 2
    assert "retried once on a fresh worker from the members' last rounds" in caplog.text
    assert trials.keys() == undisturbed.keys() and len(trials) == 4
    for number, trial in trials.items():
        calm = undisturbed[number]
        assert trial.status is TrialStatus.COMPLETED, (number, trial.error)
        assert (trial.sample, trial.seed) == (calm.sample, calm.seed), number
        assert trial.info.get("exploits") == calm.info.get("exploits"), number
        assert trial.metrics == calm.metrics, number
    # the re-answered round forked members again, a source of the other worker handed over too
    exploits = [e for t in trials.values() for e in t.info.get("exploits") or () if e["epoch"] == 2]
    assert exploits
    assert not list((tmp_path / "killed.db.ray").glob("pbt/trial-*/*")), "the members' rounds are removed"
