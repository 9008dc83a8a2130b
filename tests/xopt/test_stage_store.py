"""Stages in the store: a later experiment (or a resumed run) starts from the stages an earlier one
trained instead of training them again; checkpoints are cleaned up under a policy; a failed branch
is recorded failed while its parent and siblings stay as they were. Real SQLite files, real
training on digits, real subprocesses for kill -9."""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tridens as td
from tridens.engine._experiment import ExperimentFailed
from tridens.evaluators import TrainConfig
from tridens.store import StagePolicy, Store, stage_tree
from tridens.trial import TrialStatus

from tests.xopt.stage_script import Net, grid_evaluator

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


def run(data, store, name, epochs, gammas, lr=0.05, stage_policy=None, optimize=None):
    exp = td.Experiment(Net(), grid_evaluator(data, epochs, gammas, lr),
                        td.strategy.GridSearch(batch_size=16), store=store, name=name,
                        executor=td.executors.Inline(optimize=optimize),
                        options=td.RunOptions(seeds="per-architecture", verbose=False, stage_policy=stage_policy))
    exp.run()
    return {json.dumps(t.sample, sort_keys=True): t for t in exp.trials()}


def keys_of(evaluator, sample) -> list:
    cfg: TrainConfig = evaluator.config(sample)
    return [cfg.stage_key(e) for e in range(cfg.epochs)]


def shared_depth(keys, others) -> int:
    """The most leading epochs ``keys`` shares with any of ``others``."""
    best = 0
    for other in others:
        n = 0
        while n < min(len(keys), len(other)) and keys[n] == other[n]:
            n += 1
        best = max(best, n)
    return best


def test_a_second_study_reuses_the_stages_of_the_first(data, tmp_path, caplog):
    store = tmp_path / "studies.db"
    first = run(data, store, "first", [2, 3], [0.1])
    with caplog.at_level(logging.INFO, logger="tridens"):
        second = run(data, store, "second", [2, 3, 4], [0.1, 0.5])       # a superset grid
    alone = run(data, tmp_path / "alone.db", "second", [2, 3, 4], [0.1, 0.5])  # the same grid, nothing stored before
    assert len(first) == 4 and len(second) == len(alone) == 12 and first.keys() <= second.keys()
    for key, trial in second.items():   # the same per-epoch metrics as trained without reuse
        assert trial.status is TrialStatus.COMPLETED
        assert trial.metrics == alone[key].metrics, key
    ev = grid_evaluator(data, [2, 3, 4], [0.1, 0.5])
    first_keys = [keys_of(ev, t.sample) for t in first.values()]
    for key, trial in second.items():   # every epoch the first study trained is loaded, none trained again
        depth = shared_depth(keys_of(ev, trial.sample), first_keys)
        start = trial.info.get("stage_store", {})
        assert start.get("epochs", 0) >= depth, (key, start, depth)
        if depth:
            assert start["experiment"] == "first"
    assert any(t.info["stage_store"]["epochs"] == t.sample["epochs"] for k, t in second.items() if k in first)
    assert "trained by experiment 'first'): not trained again" in caplog.text
    with Store(store) as db:
        stages = stage_tree(db, "second")
    trained = {s.experiment for s in stages}
    assert trained == {"first", "second"}
    by_id = {s.id: s for s in stages}
    assert all(s.parent is None or s.parent in by_id for s in stages)        # the tree is whole
    for s in stages:   # every trial of a stage also went through its parent
        if s.parent is not None:
            assert set(s.trials) <= set(by_id[s.parent].trials)
    files = list((tmp_path / "studies.db.files" / ".stages").rglob("*.pt"))
    with sqlite3.connect(store) as conn:
        assert len(files) == conn.execute("SELECT COUNT(*) FROM stages WHERE checkpoint IS NOT NULL").fetchone()[0] > 0
    out = subprocess.run([sys.executable, "-m", "tridens.cli", "show", "second", "--db", str(store)], cwd=ROOT,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "stage tree:" in out.stdout and "reused from other experiments" in out.stdout
    assert "from 'first'" in out.stdout and "epochs 0–1" in out.stdout


def test_each_stored_stage_names_only_the_trials_that_went_through_it(data, tmp_path):
    store = tmp_path / "paths.db"
    trials = run(data, store, "paths", [2, 3, 4], [0.1, 0.5])
    stages = {sid: (parent, first, last) for sid, parent, first, last in
              rows(store, "SELECT id, parent, first_epoch, last_epoch FROM stages WHERE status = 'done'")}
    linked: dict[int, set[int]] = {}
    for sid, tid in rows(store, "SELECT stage_id, trial_id FROM stage_trials"):
        linked.setdefault(tid, set()).add(sid)
    numbers = {t.id for t in trials.values()}
    assert set(linked) <= numbers and len(stages) > 3
    for tid, sids in linked.items():   # one path from the root: a parent each, never two siblings
        parents = [stages[s][0] for s in sids]
        assert len(parents) == len(set(parents)), (tid, sorted(sids))
        assert all(p is None or p in sids for p in parents), (tid, sorted(sids))
        limit = next(t.sample["epochs"] for t in trials.values() if t.id == tid)
        assert all(stages[s][1] < limit for s in sids), (tid, sorted(sids))


def test_reuse_within_the_experiment_only_when_asked(data, tmp_path):
    store = tmp_path / "own.db"
    run(data, store, "first", [2], [0.1])
    second = run(data, store, "second", [2], [0.1], stage_policy=StagePolicy(reuse="experiment"))
    assert not any("stage_store" in t.info for t in second.values())
    with pytest.raises(ValueError, match="'reuse' parameter of StagePolicy"):
        td.Experiment(Net(), grid_evaluator(data, [2], [0.1]), store=tmp_path / "x.db",
                      options=td.RunOptions(stage_policy=StagePolicy(reuse="everywhere"))).run()


def stage_files(store: Path) -> list[Path]:
    return sorted((store.parent / (store.name + ".files") / ".stages").rglob("*.pt"))


def test_cleanup_keeps_what_live_trials_need_then_the_most_recent_within_the_budget(data, tmp_path):
    store = tmp_path / "clean.db"
    run(data, store, "all", [2, 4], [0.1, 0.5], stage_policy=StagePolicy(max_bytes=0))
    with Store(store) as db:
        stages = stage_tree(db, "all")
    assert stages and all(s.checkpoint is None for s in stages)      # every trial finished: none kept
    assert stage_files(store) == []
    again = run(data, store, "again", [2], [0.1])                     # nothing stored to start from
    assert not any("stage_store" in t.info for t in again.values())

    budget = tmp_path / "budget.db"
    run(data, budget, "a", [2, 4], [0.1, 0.5])
    sizes = [p.stat().st_size for p in stage_files(budget)]
    assert len(sizes) >= 4
    limit = sum(sorted(sizes)[:2]) + 1
    run(data, budget, "b", [2], [0.1], stage_policy=StagePolicy(max_bytes=limit))
    assert sum(p.stat().st_size for p in stage_files(budget)) <= limit
    with Store(budget) as db:
        kept = [s for s in stage_tree(db, "a") if s.checkpoint]
        assert all((budget.parent / "budget.db.files" / s.checkpoint).is_file() for s in kept)
        # a live trial pins the stages it went through, whatever the budget
        live = db.trials("a")[0]
        live.status = TrialStatus.INTERRUPTED
        db.update_trial(live)
        archive = td.store.StageArchive(db, "a", StagePolicy(max_bytes=0))
        archive.collect()
        pinned = [s for s in stage_tree(db, "a") if s.checkpoint]
        assert pinned and all(live.id in s.trials for s in pinned)
        live.status = TrialStatus.COMPLETED
        db.update_trial(live)
        archive.collect()
        assert not any(s.checkpoint for s in stage_tree(db, "a")) and stage_files(budget) == []


def test_stage_checkpoints_of_a_deleted_experiment_go_and_rows_naming_outside_files_are_refused(data, tmp_path):
    store = tmp_path / "gone.db"
    run(data, store, "gone", [2], [0.1, 0.5])
    run(data, store, "kept", [3], [0.1])
    assert stage_files(store)
    with Store(store) as db:
        kept = {s.checkpoint for s in stage_tree(db, "kept") if s.checkpoint}
        db.delete_experiment("gone")
        td.store.StageArchive(db, "kept").collect()
        left = {str(p.relative_to(tmp_path / "gone.db.files")) for p in stage_files(store)}
        assert left == kept                      # only the stages the remaining experiment's trials used
        outside = tmp_path / "precious.pt"
        outside.write_bytes(b"not a checkpoint")
        conn = db._connection()
        conn.execute("UPDATE stages SET checkpoint = ? WHERE checkpoint IS NOT NULL", ("../precious.pt",))
        archive = td.store.StageArchive(db, "kept")
        root, path = conn.execute("SELECT root, path FROM stages ORDER BY last_epoch DESC LIMIT 1").fetchone()
        assert archive.load(root, path, 1) is None            # refused: outside <db>.files
        conn.execute("DELETE FROM stage_trials")
        archive.collect()
        assert outside.read_bytes() == b"not a checkpoint"    # never deleted either


def executor_of(kind: str):
    return td.executors.Process(workers=2) if kind == "process" else td.executors.Inline()


@pytest.mark.parametrize("kind", ["inline", "process"])
def test_a_nan_branch_is_recorded_failed_and_its_parent_and_siblings_are_untouched(data, tmp_path, kind):
    train, val = data
    store = tmp_path / "nan.db"
    ev = td.evaluators.Classification(train, val, batch_size=128, lr=0.05, schedule="step", epochs=3, milestones=[1],
                                      gamma=td.choice("gamma", [0.1, 0.5, 1e32]), data_seed=0)
    exp = td.Experiment(Net(), ev, td.strategy.GridSearch(), store=store, name="nan",
                        options=td.RunOptions(seeds="per-architecture", verbose=False), executor=executor_of(kind))
    exp.run()
    trials = {t.sample["gamma"]: t for t in exp.trials()}
    assert trials[1e32].status is TrialStatus.FAILED and "NonFiniteLoss" in trials[1e32].error
    assert trials[0.1].status is trials[0.5].status is TrialStatus.COMPLETED
    ev_alone = td.evaluators.Classification(train, val, batch_size=128, lr=0.05, schedule="step", epochs=3, milestones=[1],
                                            gamma=td.choice("gamma", [0.1, 0.5]), data_seed=0)
    alone = td.Experiment(Net(), ev_alone, td.strategy.GridSearch(), store=tmp_path / "alone.db", name="nan",
                          options=td.RunOptions(seeds="per-architecture", verbose=False),
                          executor=td.executors.Inline(optimize=False))
    alone.run()
    for t in alone.trials():
        assert trials[t.sample["gamma"]].metrics == t.metrics     # siblings as if the NaN branch never was
    with Store(store) as db:
        stages = stage_tree(db, "nan")
    failed = [s for s in stages if s.status == "failed"]
    assert len(failed) == 1 and failed[0].trials == [trials[1e32].id] and failed[0].checkpoint is None
    assert "NonFiniteLoss" in failed[0].error
    parent = next(s for s in stages if s.id == failed[0].parent)
    assert parent.status == "done" and parent.epochs == (0, 1) and trials[1e32].id in parent.trials
    assert sorted(parent.trials) == sorted(t.id for t in trials.values())
    # a later run never starts from a failed stage
    again = td.Experiment(Net(),
                          td.evaluators.Classification(train, val, batch_size=128, lr=0.05, schedule="step", epochs=3,
                                                              milestones=[1], gamma=1e32, data_seed=0),
                          td.strategy.GridSearch(), store=store, name="nan-again",
                          options=td.RunOptions(seeds="per-architecture", verbose=False), executor=executor_of(kind))
    with pytest.raises(ExperimentFailed):
        again.run()
    assert again.trials()[0].info["stage_store"]["epochs"] == 1


# -- kill -9 of a tree run, then resume (real subprocesses) ----------------------------------------
def start(store: Path, pause: float, executor: str = "inline") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.xopt.stage_script", str(store), str(pause), executor], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def rows(store: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=30) as conn:
        return conn.execute(sql).fetchall()


def batches(store: Path) -> int:
    path = Path(str(store) + ".batches")
    return len(path.read_text()) if path.exists() else 0


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (pool workers)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def gone(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("executor", ["inline", pytest.param("process", marks=pytest.mark.slow)])
def test_kill_9_during_a_tree_run_then_resume_retrains_no_finished_stage(tmp_path, executor):
    """On the process pool the stage trees train in the workers; they exit with the killed driver."""
    store = tmp_path / "tree.db"
    proc = start(store, 0.02, executor)
    end = time.monotonic() + 120
    while time.monotonic() < end:   # kill once some stages are stored, long before the end
        try:
            if rows(store, "SELECT COUNT(*) FROM stages WHERE status = 'done'")[0][0] >= 3:
                break
        except sqlite3.OperationalError:
            pass
        time.sleep(0.05)
    workers = children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + 60
    while not all(gone(pid) for pid in workers) and time.monotonic() < end:   # no batch counted after this
        time.sleep(0.1)
    assert all(gone(pid) for pid in workers)
    before = rows(store, "SELECT id, path, checkpoint, last_epoch - first_epoch FROM stages ORDER BY id")
    assert len(before) >= 3
    files = {p: (store.parent / "tree.db.files" / p).stat().st_mtime_ns for _, _, p, _ in before}
    assert rows(store, "SELECT COUNT(*) FROM trials WHERE status = 'completed'")[0][0] < 8   # killed mid-run
    first_batches = batches(store)
    resumed = start(store, 0.0, executor)
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, out
    after = rows(store, "SELECT id, path, checkpoint, last_epoch - first_epoch FROM stages ORDER BY id")
    assert after[:len(before)] == before                       # what was stored stays, unchanged
    assert all((store.parent / "tree.db.files" / p).stat().st_mtime_ns == files[p] for p in files)
    assert len({r[1] for r in after}) == len(after)            # no stage twice
    new_epochs = sum(r[3] for r in after[len(before):])
    assert batches(store) - first_batches == 12 * new_epochs  # the resumed run trained only new stages
    trials = rows(store, "SELECT status, COUNT(*) FROM trials GROUP BY status")
    assert trials == [("completed", 8)]
    # the same per-epoch metrics as a run never killed
    reference = tmp_path / "ref.db"
    ref = start(reference, 0.0, executor)
    assert ref.communicate(timeout=300)[0] is not None and ref.returncode == 0
    with Store(store, readonly=True) as a, Store(reference, readonly=True) as b:
        got = {json.dumps(t.sample, sort_keys=True): t.metrics for t in a.trials("tree")}
        want = {json.dumps(t.sample, sort_keys=True): t.metrics for t in b.trials("tree")}
    assert got == want
    assert sum(r[3] for r in after) == sum(r[0] for r in rows(reference, "SELECT last_epoch - first_epoch FROM stages"))


def test_a_store_that_cannot_take_stages_does_not_fail_the_trials(data, tmp_path, caplog):
    store = tmp_path / "full.db"
    (tmp_path / "full.db.files").mkdir()
    (tmp_path / "full.db.files" / ".stages").write_text("a file where the stage folder goes")
    with caplog.at_level(logging.WARNING, logger="tridens"):
        trials = run(data, store, "full", [2, 3], [0.1])
    assert all(t.status is TrialStatus.COMPLETED for t in trials.values())
    assert "stage store: save failed" in caplog.text
    alone = run(data, tmp_path / "alone.db", "full", [2, 3], [0.1], optimize=False)
    assert {k: t.metrics for k, t in trials.items()} == {k: t.metrics for k, t in alone.items()}


def test_a_stored_checkpoint_the_trainer_cannot_continue_from_is_trained_again(data, tmp_path, caplog):
    import torch

    store = tmp_path / "odd.db"
    first = run(data, store, "first", [2], [0.1])
    for path in stage_files(store):   # e.g. written by another checkpoint format
        torch.save({"format": 999}, path)
    with caplog.at_level(logging.WARNING, logger="tridens"):
        second = run(data, store, "second", [2], [0.1])
    assert "not used (InvalidParameter" in caplog.text
    assert not any("stage_store" in t.info for t in second.values())
    assert {k: t.metrics for k, t in second.items()} == {k: t.metrics for k, t in first.items()}
