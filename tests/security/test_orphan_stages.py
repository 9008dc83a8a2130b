"""Stage cleanup deletes only stage checkpoints: a stage row that no trial uses (an orphan, here
crafted to name a trial's checkpoint) never takes a trial's file with it; and stages whose trials
are gone (a deleted experiment's) are removed, rows and files, when a run starts -- a resume
included -- while every stage a remaining trial went through stays. Real stage-tree runs on
digits, real SQLite files."""

import os
import sqlite3
import time

import torch

import tridens as td
from tridens.store import Store, stage_tree

from tests.xopt.test_stage_store import run, stage_files


def test_an_orphan_stage_row_naming_a_trial_checkpoint_never_deletes_it(tmp_path):
    data = td.datasets.digits()
    store = tmp_path / "runs.db"
    first = run(data, store, "first", [2], [0.1])
    checkpoint = next(iter(first.values())).checkpoint
    rel = os.path.relpath(checkpoint, str(store) + ".files")
    conn = sqlite3.connect(store)
    now = time.time()
    conn.execute("INSERT INTO stages (root, path, parent, experiment_id, label, first_epoch, last_epoch, first_step, "
                 "last_step, hyperparameters, history, status, checkpoint, bytes, created_at, used_at) VALUES "
                 "('r', 'p', NULL, NULL, '9.0', 0, 1, 0, 1, '{}', '[]', 'done', ?, 10, ?, ?)", (rel, now, now))
    conn.commit()
    conn.close()
    run(data, store, "second", [2], [0.5])    # its end-of-run cleanup meets the orphan row
    assert torch.load(checkpoint, weights_only=True)   # the trial's checkpoint is still there and loads
    with Store(store) as db:
        assert db._connection().execute("SELECT COUNT(*) FROM stages WHERE path = 'p'").fetchone()[0] == 0


def test_stages_of_a_deleted_experiment_are_removed_when_a_run_resumes(tmp_path):
    data = td.datasets.digits()
    store = tmp_path / "runs.db"
    run(data, store, "gone", [2], [0.1, 0.5])
    kept = run(data, store, "kept", [3], [0.1])
    with Store(store) as db:
        kept_stages = {s.id for s in stage_tree(db, "kept")}
        kept_files = {s.checkpoint for s in stage_tree(db, "kept") if s.checkpoint}
        gone_only = {s.id for s in stage_tree(db, "gone")} - kept_stages
        assert gone_only and kept_files
        db.delete_experiment("gone")
    again = run(data, store, "kept", [3], [0.1])  # resumed: nothing left to train
    assert {k: t.metrics for k, t in again.items()} == {k: t.metrics for k, t in kept.items()}
    with Store(store) as db:
        ids = {r[0] for r in db._connection().execute("SELECT id FROM stages")}
        assert not ids & gone_only                      # the orphans' rows are gone
        assert kept_stages <= ids                       # every stage a remaining trial went through stays
        assert {s.checkpoint for s in stage_tree(db, "kept") if s.checkpoint} == kept_files
    left = {str(p.relative_to(tmp_path / "runs.db.files")) for p in stage_files(store)}
    assert left == kept_files
