"""The store's versioned schema: one ``schema_version`` table and migrations applied in order.

``MIGRATIONS[v]`` takes a database from version ``v`` to ``v + 1``; version 0 is a database without
tridens tables (a new file). A file whose version is higher than ``len(MIGRATIONS)`` was written by
a newer tridens and is refused, never modified. To change the schema, append a function to
``MIGRATIONS`` (never edit a released one) and add an upgrade test from a file of the old version.

>>> import sqlite3
>>> conn = sqlite3.connect(":memory:", isolation_level=None)
>>> upgrade(conn, ":memory:")
2
"""

from __future__ import annotations

import sqlite3
from typing import Callable, Sequence

from ..errors import StoreError

__all__ = ["CURRENT_VERSION", "MIGRATIONS", "Migration", "check_not_newer", "read_version", "upgrade"]

Migration = Callable[[sqlite3.Connection], None]


def _v0_to_v1(conn: sqlite3.Connection) -> None:
    """The first layout: experiments, trials, per-step metrics, checkpoint files."""
    statements = [
        """CREATE TABLE experiments (
            id          INTEGER PRIMARY KEY AUTOINCREMENT,
            name        TEXT NOT NULL UNIQUE,
            status      TEXT NOT NULL,
            config      TEXT NOT NULL,          -- JSON object (space path, evaluator, strategy, ...)
            created_at  REAL NOT NULL,
            updated_at  REAL NOT NULL
        )""",
        """CREATE TABLE trials (
            id            INTEGER PRIMARY KEY AUTOINCREMENT,
            experiment_id INTEGER NOT NULL REFERENCES experiments(id) ON DELETE CASCADE,
            sample        TEXT NOT NULL,        -- JSON object label -> value
            fingerprint   TEXT,
            seed          INTEGER NOT NULL,
            status        TEXT NOT NULL,
            metric        REAL,                 -- NULL with metric_nan = 0: no value yet
            metric_nan    INTEGER NOT NULL DEFAULT 0,
            group_id      INTEGER,
            max_steps     INTEGER,
            info          TEXT NOT NULL,        -- JSON object
            parent        INTEGER REFERENCES trials(id),
            created_at    REAL NOT NULL,
            started_at    REAL,
            finished_at   REAL,
            error         TEXT
        )""",
        "CREATE INDEX trials_by_experiment ON trials(experiment_id, id)",
        "CREATE INDEX trials_by_fingerprint ON trials(fingerprint)",
        """CREATE TABLE metrics (
            trial_id INTEGER NOT NULL REFERENCES trials(id) ON DELETE CASCADE,
            name     TEXT NOT NULL,
            step     INTEGER NOT NULL,
            value    REAL,                      -- NULL is NaN (SQLite has no NaN)
            PRIMARY KEY (trial_id, name, step)
        ) WITHOUT ROWID""",
        """CREATE TABLE checkpoints (
            id       INTEGER PRIMARY KEY AUTOINCREMENT,
            trial_id INTEGER NOT NULL REFERENCES trials(id) ON DELETE CASCADE,
            kind     TEXT NOT NULL,
            path     TEXT NOT NULL,             -- relative to <db name>.files/
            saved_at REAL NOT NULL,
            UNIQUE (trial_id, kind)
        )""",
    ]
    for sql in statements:
        conn.execute(sql)


def _v1_to_v2(conn: sqlite3.Connection) -> None:
    """Stage trees: the stages trained (a step range of one tree, its hyperparameters, a trainer
    checkpoint at its end) and the trials that went through each."""
    statements = [
        """CREATE TABLE stages (
            id            INTEGER PRIMARY KEY AUTOINCREMENT,
            root          TEXT NOT NULL,        -- digest: model fingerprint, seed, initial weights
            path          TEXT NOT NULL,        -- digest of the stage records of epochs 0 .. last_epoch - 1
            parent        INTEGER REFERENCES stages(id) ON DELETE SET NULL,
            experiment_id INTEGER REFERENCES experiments(id) ON DELETE SET NULL,  -- trained by
            label         TEXT NOT NULL,        -- its node in the tree: "<tree>.<n>"
            first_epoch   INTEGER NOT NULL,     -- epochs [first_epoch, last_epoch)
            last_epoch    INTEGER NOT NULL,
            first_step    INTEGER NOT NULL,     -- optimizer steps [first_step, last_step)
            last_step     INTEGER NOT NULL,
            hyperparameters TEXT NOT NULL,      -- JSON: the stage records, summarized
            history       TEXT NOT NULL,        -- JSON list: metrics of epochs 0 .. last_epoch - 1
            status        TEXT NOT NULL,        -- 'done' or 'failed'
            checkpoint    TEXT,                 -- relative to <db name>.files/; NULL once cleaned up
            bytes         INTEGER NOT NULL DEFAULT 0,
            error         TEXT,
            created_at    REAL NOT NULL,
            used_at       REAL NOT NULL,
            UNIQUE (root, path)
        )""",
        """CREATE TABLE stage_trials (
            stage_id INTEGER NOT NULL REFERENCES stages(id) ON DELETE CASCADE,
            trial_id INTEGER NOT NULL REFERENCES trials(id) ON DELETE CASCADE,
            PRIMARY KEY (stage_id, trial_id)
        ) WITHOUT ROWID""",
        "CREATE INDEX stage_trials_by_trial ON stage_trials(trial_id)",
    ]
    for sql in statements:
        conn.execute(sql)


MIGRATIONS: list[Migration] = [_v0_to_v1, _v1_to_v2]
CURRENT_VERSION = len(MIGRATIONS)


def _tables(conn: sqlite3.Connection) -> set[str]:
    rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return {r[0] for r in rows if not r[0].startswith("sqlite_")}


def read_version(conn: sqlite3.Connection, path: str) -> int:
    """The schema version of an open database: 0 for an empty file.

    Raises :class:`StoreError` for a SQLite database that holds other tables but no
    ``schema_version`` (it is not a tridens store, and is left alone).
    """
    tables = _tables(conn)
    if "schema_version" not in tables:
        if tables:
            raise StoreError(
                f"{path} is a SQLite database but not a tridens store (no schema_version table; it has "
                f"tables {sorted(tables)}); pass another path")
        return 0
    row = conn.execute("SELECT version FROM schema_version").fetchone()
    if row is None or not isinstance(row[0], int):
        raise StoreError(f"{path} is a damaged tridens store: its schema_version table holds {row!r}")
    return row[0]


def upgrade(conn: sqlite3.Connection, path: str, migrations: Sequence[Migration] = MIGRATIONS) -> int:
    """Bring the database to ``len(migrations)``, all steps in one transaction; return the version.

    ``conn`` must be in autocommit mode (``isolation_level=None``). The version is read first without
    a write lock, so opening an up-to-date store never waits for a writer. A database of a newer
    version raises :class:`StoreError` naming the file and both versions; a failing migration rolls
    back every step, leaving the file as it was.
    """
    target = len(migrations)
    version = read_version(conn, path)
    if version == target:
        return version
    check_not_newer(path, version, target)
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = read_version(conn, path)  # another process may have upgraded meanwhile
        check_not_newer(path, version, target)
        if version == 0 and "schema_version" not in _tables(conn):
            conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
            conn.execute("INSERT INTO schema_version (version) VALUES (0)")
        for v in range(version, target):
            migrations[v](conn)
        conn.execute("UPDATE schema_version SET version = ?", (target,))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return target


def check_not_newer(path: str, version: int, target: int) -> None:
    """Refuse a file written by a newer schema, naming the file and both versions."""
    if version > target:
        raise StoreError(
            f"{path} was written by a newer tridens (store schema version {version}); this tridens "
            f"reads schema versions up to {target}. Upgrade tridens to open it.")
