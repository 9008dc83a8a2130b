"""The versioned schema: fresh files, upgrades from older files, refusal of newer ones."""

from __future__ import annotations

import sqlite3

import pytest

from tridens.errors import StoreError
from tridens.store import CURRENT_VERSION, Store
from tridens.store._schema import MIGRATIONS, upgrade
from tridens.trial import Trial, TrialStatus


def version_of(path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT version FROM schema_version").fetchone()[0]
    finally:
        conn.close()


def tables_of(path) -> set[str]:
    conn = sqlite3.connect(path)
    try:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                if not r[0].startswith("sqlite_")}
    finally:
        conn.close()


def test_fresh_store_is_current_and_in_wal_mode(tmp_path):
    path = tmp_path / "t.db"
    Store(path).close()
    assert CURRENT_VERSION == len(MIGRATIONS) == 2 and version_of(path) == CURRENT_VERSION
    assert tables_of(path) == {"schema_version", "experiments", "trials", "metrics", "checkpoints", "stages",
                               "stage_trials"}
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent in the file
    conn.close()


@pytest.mark.parametrize("kind", ["empty file", "version-0 file"])
def test_upgrade_from_version_0(tmp_path, kind):
    path = tmp_path / "old.db"
    if kind == "empty file":
        path.write_bytes(b"")
    else:  # what a tridens with no migrations yet would have written
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (0)")
        conn.commit()
        conn.close()
    with Store(path) as s:
        s.create_experiment("e")
        assert s.add_trial("e", Trial(id=-1, sample={"a": 1}, seed=0)).id == 1
    assert version_of(path) == CURRENT_VERSION


def _next_version(conn: sqlite3.Connection) -> None:
    """A synthetic next version: a column with a default and a new table."""
    conn.execute("ALTER TABLE trials ADD COLUMN note TEXT NOT NULL DEFAULT ''")
    conn.execute("CREATE TABLE zoo (id INTEGER PRIMARY KEY, trial_id INTEGER REFERENCES trials(id))")


def test_migration_mechanism_keeps_data_and_newer_files_are_refused(tmp_path):
    path = tmp_path / "t.db"
    with Store(path) as s:
        s.create_experiment("e", {"max_trials": 3})
        t = s.add_trial("e", Trial(id=-1, sample={"w": 8}, seed=1))
        s.add_metrics(t.id, 0, {"acc": 0.5})
        t.status, t.metric = TrialStatus.COMPLETED, 0.5
        s.update_trial(t)
    conn = sqlite3.connect(path, isolation_level=None)
    assert upgrade(conn, str(path), [*MIGRATIONS, _next_version]) == CURRENT_VERSION + 1
    row = conn.execute("SELECT id, sample, status, metric, note FROM trials").fetchone()
    assert row == (1, '{"w":8}', "completed", 0.5, "")
    assert conn.execute("SELECT name, step, value FROM metrics").fetchall() == [("acc", 0, 0.5)]
    conn.close()
    assert version_of(path) == CURRENT_VERSION + 1 and "zoo" in tables_of(path)
    before = path.read_bytes()
    for kw in ({}, {"readonly": True}):
        with pytest.raises(StoreError) as err:
            Store(path, **kw)
        msg = str(err.value)
        assert str(path) in msg and f"schema version {CURRENT_VERSION + 1}" in msg and f"up to {CURRENT_VERSION}" in msg
        assert "Upgrade tridens" in msg
        assert "\n" not in msg
    assert path.read_bytes() == before and version_of(path) == CURRENT_VERSION + 1  # refused, never modified


def test_failing_migration_rolls_back_every_step(tmp_path):
    path = tmp_path / "t.db"
    Store(path).close()

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE half_done (x INTEGER)")
        raise RuntimeError("migration bug")

    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(RuntimeError, match="migration bug"):
        upgrade(conn, str(path), [*MIGRATIONS, _next_version, broken])
    conn.close()
    assert version_of(path) == CURRENT_VERSION
    assert "half_done" not in tables_of(path) and "zoo" not in tables_of(path)
    Store(path).close()  # still a good store of the current version


def test_readonly_open_of_an_older_store_asks_for_an_upgrade(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    conn.execute("INSERT INTO schema_version VALUES (0)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match=r"old\.db read-only: it has schema version 0 .* open it once writable"):
        Store(path, readonly=True)


def test_other_sqlite_databases_are_left_alone(tmp_path):
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match=r"app\.db is a SQLite database but not a tridens store .*\['users'\]"):
        Store(path)
    assert tables_of(path) == {"users"}


def test_upgrade_from_version_1_adds_the_stage_tables_and_keeps_trials(tmp_path):
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path, isolation_level=None)
    assert upgrade(conn, str(path), MIGRATIONS[:1]) == 1      # a store as the first release wrote it
    conn.execute("INSERT INTO experiments (name, status, config, created_at, updated_at) VALUES ('e', 'done', '{}', 0, 0)")
    conn.execute("INSERT INTO trials (experiment_id, sample, seed, status, info, created_at) "
                 "VALUES (1, '{\"w\":8}', 3, 'completed', '{}', 0)")
    conn.close()
    with Store(path) as s:
        assert [t.sample for t in s.trials("e")] == [{"w": 8}]
    assert version_of(path) == CURRENT_VERSION and {"stages", "stage_trials"} <= tables_of(path)
