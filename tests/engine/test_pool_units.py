"""Stage trees on the process pool (real worker subprocesses) and on Ray (a real local Ray), with
real SQLite stores and real training on digits: the trees train on the workers with their stages
stored once in the store (the driver writes it), and a second experiment reuses them. (PBT on the pool, and stage trees
against trials trained alone, are cases of tests/engine/test_executor_conformance.py.)"""

from __future__ import annotations

import json
import logging
import sqlite3

import pytest

import tridens as td
from tridens.store import Store, stage_tree
from tridens.trial import TrialStatus

from tests.xopt.stage_script import Net, grid_evaluator


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


def run(data, store, name, epochs, gammas, executor):
    exp = td.Experiment(Net(), grid_evaluator(data, epochs, gammas), td.strategy.GridSearch(batch_size=16),
                        store=store, name=name, options=td.RunOptions(seeds="per-architecture", verbose=False),
                        executor=executor)
    exp.run()
    return {json.dumps(t.sample, sort_keys=True): t for t in exp.trials()}


def stored(store):
    with sqlite3.connect(store) as conn:
        rows = conn.execute("SELECT root, path, checkpoint FROM stages WHERE status = 'done'").fetchall()
    files = sorted((store.parent / (store.name + ".files") / ".stages").rglob("*.pt"))
    return rows, files


def executor_of(kind, tmp_path, request):
    if kind == "process":
        return td.executors.Process(workers=2)
    request.getfixturevalue("local_ray")
    return td.executors.Ray(workers=2, storage=tmp_path / "ray")


@pytest.mark.parametrize("kind", ["process", "ray"])
def test_stage_trees_train_on_the_workers_store_once_and_a_second_study_reuses_them(kind, data, tmp_path, caplog,
                                                                                    request):
    inline = run(data, tmp_path / "inline.db", "first", [2, 3], [0.1, 0.5], td.executors.Inline())
    pool_db = tmp_path / "pool.db"
    pool = run(data, pool_db, "first", [2, 3], [0.1, 0.5], executor_of(kind, tmp_path, request))
    assert pool.keys() == inline.keys() and len(pool) == 8
    for key, trial in pool.items():   # the same per-epoch metrics as the in-process stage tree
        assert trial.status is TrialStatus.COMPLETED, (key, trial.error)
        assert trial.info["unit"]["kind"] == "stage tree"
        assert trial.metrics == inline[key].metrics, key
        assert [s[0] for s in trial.info["stages"]] == [s[0] for s in inline[key].info["stages"]]
    rows, files = stored(pool_db)
    inline_rows, _ = stored(tmp_path / "inline.db")
    assert sorted((r, p) for r, p, _ in rows) == sorted((r, p) for r, p, _ in inline_rows)   # each stage once
    assert len(files) == sum(c is not None for _, _, c in rows) > 0

    with caplog.at_level(logging.INFO, logger="tridens"):
        second = run(data, pool_db, "second", [2, 3, 4], [0.1, 0.5], executor_of(kind, tmp_path, request))
    alone = run(data, tmp_path / "alone.db", "second", [2, 3, 4], [0.1, 0.5], td.executors.Inline())
    assert len(second) == 12
    reused = [t for t in second.values() if t.info.get("stage_store")]
    assert reused and all(t.info["stage_store"]["experiment"] == "first" for t in reused)
    assert any(t.info["stage_store"]["epochs"] == t.sample["epochs"] for k, t in second.items() if k in pool)
    for key, trial in second.items():
        assert trial.metrics == alone[key].metrics, key
    assert "trained by experiment 'first') sent to " in caplog.text and "not trained again" in caplog.text
    with Store(pool_db) as db:
        assert {s.experiment for s in stage_tree(db, "second")} == {"first", "second"}
    rows, files = stored(pool_db)
    assert len({(r, p) for r, p, _ in rows}) == len(rows)
    assert len(files) == sum(c is not None for _, _, c in rows)
    if kind == "ray":   # the checkpoints handed through storage= are gone once the driver took them
        assert not list((tmp_path / "ray").rglob("handoff/*.pt"))


def test_members_of_a_tree_past_their_timeout_fail_and_the_run_ends(data, tmp_path):
    """trial_timeout counts each member's share of its tree's training: past it after an epoch, the
    member fails on the driver and leaves the tree in its worker; the run still ends."""
    exp = td.Experiment(Net(), grid_evaluator(data, [2, 3], [0.1, 0.5]), td.strategy.GridSearch(batch_size=16),
                        store=tmp_path / "t.db", name="late",
                        options=td.RunOptions(seeds="per-architecture", verbose=False),
                        executor=td.executors.Process(workers=2), budget=td.Budget(trial_timeout=1e-6))
    with pytest.raises(Exception, match="every trial of 'late' failed"):
        exp.run()
    trials = exp.trials()
    assert len(trials) == 8
    for t in trials:
        assert t.status is TrialStatus.FAILED and "exceeded trial_timeout=1e-06 s after epoch 0" in t.error
        assert len(t.metrics["val_acc"]) == 1
