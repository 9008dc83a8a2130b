"""``tridens clean-stages`` on a real store of stage-tree runs (digits): ``--dry-run`` lists the
stage checkpoints that would go and removes nothing; then the command removes them, keeps those an
interrupted trial went through (it resumes from them) and what ``--keep`` allows, and removes the
stages of a deleted experiment, rows and files."""

import sqlite3

import pytest

import tridens as td
from tridens.store import Store, stage_tree

from tests.security.test_stores import tridens_here  # noqa: F401  (fixture)
from tests.xopt.test_stage_store import run, stage_files


def test_clean_stages_lists_then_removes_what_no_live_trial_needs(tmp_path, tridens_here):  # noqa: F811
    data = td.datasets.digits()
    db = tmp_path / "runs.db"
    run(data, db, "gone", [2], [0.1, 0.5], lr=0.2)   # its own stages: another learning rate from the start
    run(data, db, "a", [3], [0.1, 0.5])
    with Store(db) as store:
        a_stages = stage_tree(store, "a")
        gone_only = {s.id for s in stage_tree(store, "gone")} - {s.id for s in a_stages}
        store.delete_experiment("gone")
    files = stage_files(db)
    assert gone_only and len(files) >= 3
    # one trial of "a" left interrupted (as a killed run leaves it): the stages it went through stay
    live = max(a_stages, key=lambda s: s.epochs[1])
    conn = sqlite3.connect(db)
    conn.execute("UPDATE trials SET status = 'interrupted' WHERE id = ?", (live.trials[0],))
    conn.commit()
    conn.close()
    with Store(db) as store:
        pinned = {s.checkpoint for s in stage_tree(store, "a") if s.checkpoint and live.trials[0] in s.trials}
    assert pinned

    dry = tridens_here("clean-stages", "--dry-run", "--db", db)
    assert dry.returncode == 0, dry.stderr
    assert stage_files(db) == files                                   # nothing removed
    would = len(files) - len(pinned)
    assert f"would remove {would} stage checkpoint(s)" in dry.stdout, dry.stdout
    listed = [line for line in dry.stdout.splitlines() if line.startswith("would remove stage ")]
    assert len(listed) == would, dry.stdout
    assert any("its experiment deleted" in line and "no trial uses it any more" in line for line in listed)
    assert any("trained by 'a'" in line and "no live trial needs it" in line for line in listed)
    assert not any(p in dry.stdout for p in pinned)                   # what the interrupted trial needs stays

    kept = tridens_here("clean-stages", "--keep", "1GiB", "--db", db)  # every "a" stage fits: only the orphans go
    assert kept.returncode == 0, kept.stderr
    with Store(db) as store:
        ids = {r[0] for r in store._connection().execute("SELECT id FROM stages")}
        assert not ids & gone_only
        assert all(s.checkpoint for s in stage_tree(store, "a"))

    before = len(stage_files(db))
    done = tridens_here("clean-stages", "--db", db)
    assert done.returncode == 0, done.stderr
    assert f"removed {before - len(pinned)} stage checkpoint(s)" in done.stdout, done.stdout
    left = {str(p.relative_to(tmp_path / "runs.db.files")) for p in stage_files(db)}
    assert left == pinned                                             # only what the interrupted trial needs
    with Store(db) as store:
        assert {s.id for s in stage_tree(store, "a")} == {s.id for s in a_stages}   # the tree's rows stay

    again = tridens_here("clean-stages", "--db", db)
    assert again.returncode == 0 and "removed 0 stage checkpoint(s)" in again.stdout
    with pytest.raises(SystemExit):
        tridens_here("clean-stages", "--keep", "lots", "--db", db)
