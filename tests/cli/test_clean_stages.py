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


def test_clean_stages_skips_rows_that_name_files_outside_the_stages_folder(tmp_path, tridens_here):  # noqa: F811
    """Crafted stage rows naming a file outside ``<db>.files/.stages/`` (a relative path out of it,
    an absolute path, a symlink out of it, a trial's checkpoint, the folder itself) are neither
    listed nor removed, by --dry-run or by the real run: each is said to be skipped, one line each,
    while the store's own stage checkpoint is listed and removed."""
    from tests.security.test_stores import make_store

    db = tmp_path / "runs.db"
    make_store(db, {}).close()
    stages = tmp_path / "runs.db.files" / ".stages"
    (stages / "ab").mkdir(parents=True)
    (stages / "ab" / "own.pt").write_bytes(b"x" * 100)
    outside = [tmp_path / "outside.pt", tmp_path / "elsewhere" / "absolute.pt", tmp_path / "linked.pt"]
    for path in outside:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"precious")
    (stages / "ab" / "link.pt").symlink_to(outside[2])
    conn = sqlite3.connect(db)
    trial_id, trial_file = conn.execute("SELECT trial_id, path FROM checkpoints").fetchone()
    named = [".stages/ab/own.pt", "../outside.pt", str(outside[1]), ".stages/ab/link.pt", trial_file, ".stages"]
    for i, path in enumerate(named):
        sid = conn.execute(
            "INSERT INTO stages (root, path, parent, experiment_id, label, first_epoch, last_epoch, first_step, "
            "last_step, hyperparameters, history, status, checkpoint, bytes, created_at, used_at) VALUES "
            "(?, 'p', NULL, 1, ?, 0, 1, 0, 1, '{}', '[]', 'done', ?, 10, 0, 0)", (f"r{i}", f"{i}.0", path)).lastrowid
        conn.execute("INSERT INTO stage_trials (stage_id, trial_id) VALUES (?, ?)", (sid, trial_id))
    conn.commit()
    conn.close()
    checkpoint = tmp_path / "runs.db.files" / trial_file

    for args in (["--dry-run"], []):
        out = tridens_here("clean-stages", *args, "--db", db)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        listed = [line for line in lines if line.startswith(("would remove stage ", "removed stage "))]
        assert len(listed) == 1 and ".stages/ab/own.pt" in listed[0], out.stdout
        skipped = [line for line in lines if line.startswith("skipped stage ")]
        assert [line.split(":")[0] for line in skipped] == [f"skipped stage {i}" for i in range(2, 7)], out.stdout
        assert all("not a stage checkpoint" in line for line in skipped)
        assert not any(str(tmp_path / "outside.pt") in line or "absolute.pt" in line for line in listed)
        assert all(path.read_bytes() == b"precious" for path in outside) and checkpoint.is_file()
    assert not (stages / "ab" / "own.pt").exists()     # the real run removed the store's own stage file
    assert (stages / "ab" / "link.pt").is_symlink()
