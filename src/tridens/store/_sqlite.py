"""The experiment store: one SQLite file (WAL mode) plus checkpoint files beside it.

Layout on disk, for ``Store("runs/tridens.db")``::

    runs/tridens.db                               experiments, trials, metrics, checkpoints (SQLite)
    runs/tridens.db-wal, runs/tridens.db-shm      SQLite's write-ahead log, while the store is open
    runs/tridens.db.files/<experiment>/trial-<n>.pt    checkpoints, by trial number (torch.save, atomic os.replace)

Every write method commits before it returns (unless inside :meth:`Store.transaction`), so a trial
is on disk before the engine reports it done, and a process killed at any point leaves every
committed row intact. Readers in other processes never wait for the writer (WAL); writers wait up to
``timeout`` seconds for each other.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import math
import os
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..errors import StorageFault, StoreError, TridensError
from ..files import check_archive
from ..trial import Trial, TrialStatus
from ._records import ExperimentRecord
from ._schema import CURRENT_VERSION, check_not_newer, read_version, upgrade

__all__ = ["Store", "info_problem", "storage_fault"]

_NAME_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_. \-]{0,126}[A-Za-z0-9_.\-])?")

_TRIAL_COLUMNS = (
    "t.id, e.name, t.sample, t.fingerprint, t.seed, t.status, t.metric, t.metric_nan, t.group_id, "
    "t.max_steps, t.info, t.parent, t.started_at, t.finished_at, t.error")
_INSERT_TRIAL = (
    "INSERT INTO trials (experiment_id, sample, fingerprint, seed, status, metric, metric_nan, group_id, "
    "max_steps, info, parent, created_at, started_at, finished_at, error) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_UPDATE_TRIAL = (
    "UPDATE trials SET sample = ?, fingerprint = ?, seed = ?, status = ?, metric = ?, metric_nan = ?, "
    "group_id = ?, max_steps = ?, info = ?, parent = ?, started_at = ?, finished_at = ?, error = ? "
    "WHERE id = ?")
_INSERT_METRIC = "INSERT OR REPLACE INTO metrics (trial_id, name, step, value) VALUES (?, ?, ?, ?)"
_INSERT_CHECKPOINT = "INSERT OR REPLACE INTO checkpoints (trial_id, kind, path, saved_at) VALUES (?, ?, ?, ?)"


_FULL = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file size limit reached"}
"""The storage faults named in a message (any other OSError under a write is a disk fault too)."""


def storage_cause(err: BaseException) -> OSError | None:
    """The OSError in ``err``'s chain (itself, its cause or context): torch's zip writer raises a
    RuntimeError ("unexpected pos ...") with the ENOSPC it met attached, or the other way round."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def storage_fault(err: BaseException, target: str | os.PathLike[str], what: str) -> StorageFault | None:
    """The one-line :class:`StorageFault` for a storage fault (full disk, quota, file size limit,
    failing disk) behind ``err``, raised while writing ``target`` (``what``: doing what); None when
    ``err`` is something else.

    >>> import errno
    >>> str(storage_fault(OSError(errno.ENOSPC, "No space left on device"), "/runs/t.pt", "saving"))[:36]
    'disk full: cannot write /runs/t.pt ('
    """
    target = Path(target)
    cause = storage_cause(err)
    if cause is not None and cause.errno in _FULL:
        name = _FULL[cause.errno]
    elif cause is not None and cause.errno in (errno.EIO, errno.EROFS):
        name = "disk error"
    elif isinstance(err, RuntimeError) and _disk_full(target.parent):
        name = "disk full"
    else:
        return None
    return StorageFault(f"{name}: cannot write {target} (while {what}); nothing committed was lost: "
                        f"free space and run again (the trials running now run again)")


def _disk_full(folder: Path) -> bool:
    """Whether the file system of ``folder`` has (almost) no space left for us."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if hasattr(obj, "tolist") and callable(obj.tolist):  # numpy scalars and arrays, torch tensors
        return obj.tolist()
    raise TypeError(
        f"{type(obj).__qualname__} value {obj!r} is not JSON; the store keeps JSON values (numbers, "
        f"strings, lists, dicts) and dotted import paths, never Python objects")


def _float_or_nan(value: Any) -> tuple[float | None, int]:
    """A metric as (column value, is-NaN flag): SQLite stores a NaN REAL as NULL."""
    if value is None:
        return None, 0
    v = float(value)
    return (None, 1) if math.isnan(v) else (v, 0)


class Store:
    """The SQLite experiment database of tridens (experiments, trials, metrics, checkpoints).

    Parameters: ``path`` of the database file (its directory must exist); ``timeout`` seconds a write
    waits for another writer before raising :class:`~tridens.errors.StoreError`; ``readonly`` opens
    for reading only (works in a read-only directory); ``synchronous`` is ``"NORMAL"`` (committed data
    survive a crash of the process, the default) or ``"FULL"`` (they also survive a power loss;
    checkpoint files are fsynced too; slower).

    Trial ids are unique in the whole store (not per experiment). A ``Store`` may be shared by threads
    (calls are serialized) and pickled to another process (it reopens the file there).

    >>> import tempfile, os
    >>> from tridens.trial import Trial, TrialStatus
    >>> store = Store(os.path.join(tempfile.mkdtemp(), "tridens.db"))
    >>> _ = store.create_experiment("demo", {"space": "models:Net", "max_trials": 4})
    >>> t = store.add_trial("demo", Trial(id=-1, sample={"width": 32}, seed=0))
    >>> store.add_metrics(t.id, 0, {"val_acc": 0.5})
    >>> t.status, t.metric = TrialStatus.COMPLETED, 0.5
    >>> store.update_trial(t)
    >>> [(x.id, x.metrics) for x in store.trials("demo")]
    [(1, {'val_acc': [0.5]})]
    >>> store.close()
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 5.0, readonly: bool = False,
                 synchronous: str = "NORMAL") -> None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout >= 0:
            raise ValueError(f"The 'timeout' parameter of Store must be a number >= 0. Got {timeout!r} instead.")
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(
                f"The 'synchronous' parameter of Store must be 'NORMAL' or 'FULL'. Got {synchronous!r} instead.")
        self.path = Path(path).absolute()  # checkpoint paths stay valid after a chdir
        self.files_dir = self.path.with_name(self.path.name + ".files")
        self.timeout = float(timeout)
        self.readonly = bool(readonly)
        self.synchronous = synchronous
        self._lock = threading.RLock()
        self._depth = 0
        self._experiment_ids: dict[str, int] = {}
        self._numbered: dict[int, tuple[int, int]] = {}  # experiment id -> (a trial's id, its number): the latest numbered
        self._made_dirs: set[Path] = set()  # checkpoint folders known to exist (one mkdir each)
        self._orphans: list[sqlite3.Connection] = []
        self._run_locks: dict[str, int] = {}  # experiment -> the descriptor of its held run lock
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file this connection writes
        self._conn: sqlite3.Connection | None = self._open()
        self._pid = os.getpid()

    # -- opening ----------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        path, directory = self.path, self.path.parent
        if not directory.is_dir():
            raise StoreError(f"cannot open the store {path}: its directory {directory} does not exist; "
                             f"create it first or pass another path")
        if path.is_dir():
            raise StoreError(f"cannot open the store {path}: it is a directory, not a database file")
        if self.readonly and not path.exists():
            raise StoreError(f"cannot open the store {path} read-only: the file does not exist")
        if not self.readonly and not os.access(directory, os.W_OK):
            raise StoreError(f"cannot write the store {path}: its directory {directory} is read-only; pass "
                             f"a path in a writable directory, or open it with Store(..., readonly=True)")
        if not self.readonly and path.exists() and not os.access(path, os.W_OK):
            raise StoreError(f"cannot write the store {path}: the file is read-only; open it with "
                             f"Store(..., readonly=True) to read it")
        conn = None
        try:
            if self.readonly:
                conn = self._connect_readonly()
                version = read_version(conn, str(path))
                check_not_newer(str(path), version, CURRENT_VERSION)
                if version == 0 and not conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                    raise StoreError(
                        f"the store {path} holds no experiments yet (an empty file, or one a run is creating "
                        f"right now); retry once an experiment has started")
                if version != CURRENT_VERSION:
                    raise StoreError(
                        f"cannot read the store {path} read-only: it has schema version {version} and this "
                        f"tridens reads {CURRENT_VERSION}; open it once writable to upgrade it")
            else:
                conn = sqlite3.connect(str(path), timeout=self.timeout, isolation_level=None,
                                       check_same_thread=False)
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(f"cannot put the store {path} in WAL mode (SQLite answered {mode!r})")
                conn.execute(f"PRAGMA synchronous={self.synchronous}")
                upgrade(conn, str(path))
                self._identity = self._file_identity()
            conn.execute("PRAGMA foreign_keys=ON")
            return conn
        except sqlite3.Error as e:
            if conn is not None:
                conn.close()
            raise self._translate(e, "opening it") from e
        except BaseException:
            if conn is not None:
                conn.close()
            raise

    def _connect_readonly(self) -> sqlite3.Connection:
        uri = self.path.resolve().as_uri()
        conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=self.timeout, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:
            conn.close()
            if os.access(self.path.parent, os.W_OK):
                raise
        # A WAL database in a directory where the -shm file can't be created: nobody can be writing
        # it either, so read it as an immutable file.
        return sqlite3.connect(f"{uri}?immutable=1", uri=True, timeout=self.timeout, isolation_level=None,
                               check_same_thread=False)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(f"the store {self.path} is closed")
        if os.getpid() != self._pid:  # forked: a SQLite connection must not cross fork()
            self._orphans.append(self._conn)  # never closed here: closing could disturb the parent
            self._conn = self._open()
            self._pid = os.getpid()
            self._depth = 0
        return self._conn

    def close(self) -> None:
        """Close the database (SQLite then folds the write-ahead log back into the file) and
        release the runs it holds (:meth:`lock_run`)."""
        with self._lock:
            for name in list(self._run_locks):
                self._release_run(name)
            if self._conn is not None and os.getpid() == self._pid:
                self._conn.close()
            self._conn = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r}{', readonly=True' if self.readonly else ''})"

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "timeout": self.timeout, "readonly": self.readonly,
                "synchronous": self.synchronous}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], timeout=state["timeout"], readonly=state["readonly"],  # type: ignore[misc]
                      synchronous=state["synchronous"])

    # -- error translation, reads and writes ----------------------------------------------------

    def _file_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _check_file(self, what: str) -> None:
        """The file this connection writes is still the store's file: a store deleted or replaced
        while open would take every later write into a file nobody reads."""
        if self._identity is None:
            return
        now = self._file_identity()
        if now != self._identity:
            how = "deleted" if now is None else "replaced by another file"
            raise StorageFault(f"the store {self.path} was {how} while this process wrote it (while {what}); "
                               f"nothing more is written: restore the file to keep this run's results")

    def _fault(self, err: BaseException, target: Path, what: str) -> StorageFault | None:
        return storage_fault(err, target, what)

    def _translate(self, e: sqlite3.Error, what: str) -> StoreError:
        msg = str(e)
        low = msg.lower()
        p = self.path
        if "locked" in low or "busy" in low:
            return StoreError(f"the store {p} is locked by another process or connection (waited "
                              f"{self.timeout:g} s while {what}); retry later, raise timeout=, or stop the "
                              f"other writer")
        if "disk is full" in low or getattr(e, "sqlite_errorname", "") == "SQLITE_FULL":
            name = "disk full" if _disk_full(p.parent) else "database or disk is full"
            return StorageFault(f"{name}: cannot write the store {p} (while {what}); nothing committed was lost: "
                                f"free space and run again (the trials running now run again)")
        if "disk i/o error" in low:
            return StorageFault(f"disk error: cannot write the store {p} (SQLite: {msg}, while {what}); nothing "
                                f"committed was lost: check the disk and run again")
        if "not a database" in low or "malformed" in low or "corrupt" in low:
            return StoreError(f"{p} is not a tridens store or is corrupt (SQLite: {msg}, while {what}); move "
                              f"it aside or pass another path")
        if "readonly" in low or "read-only" in low or "unable to open" in low:
            if not os.access(p.parent, os.W_OK):
                return StoreError(f"cannot write the store {p}: its directory {p.parent} is read-only (while "
                                  f"{what}); pass a path in a writable directory, or use readonly=True")
            if self.readonly:
                return StoreError(f"the store {p} is open read-only (while {what})")
            return StoreError(f"cannot open or write the store {p} (SQLite: {msg}, while {what})")
        return StoreError(f"the store {p}: {msg} (while {what})")

    @contextlib.contextmanager
    def _guard(self, what: str, integrity: str | None = None) -> Iterator[None]:
        try:
            yield
        except sqlite3.IntegrityError as e:
            if integrity is not None:
                raise StoreError(integrity) from e
            raise self._translate(e, what) from e
        except sqlite3.Error as e:
            raise self._translate(e, what) from e

    @contextlib.contextmanager
    def _writing(self, what: str, *, single: bool = False,
                 integrity: str | None = None) -> Iterator[sqlite3.Connection]:
        """One write: commits on exit unless inside :meth:`transaction`. ``single`` marks one
        statement, which SQLite commits by itself (no BEGIN/COMMIT round trips)."""
        if self.readonly:
            raise StoreError(f"the store {self.path} is open read-only; cannot write while {what}")
        with self._lock, self._guard(what, integrity):
            conn = self._connection()
            if self._depth:
                yield conn
                return
            if single:
                self._check_file(what)
                yield conn
                return
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                self._check_file(what)
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                self._experiment_ids.clear()
                self._numbered.clear()  # numbers counted inside the rolled-back writes
                raise
            conn.execute("COMMIT")

    @contextlib.contextmanager
    def _reading(self, what: str) -> Iterator[sqlite3.Connection]:
        """Several reads from one snapshot."""
        with self._lock, self._guard(what):
            conn = self._connection()
            if self._depth:
                yield conn
                return
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                if conn.in_transaction:
                    conn.execute("COMMIT")

    @contextlib.contextmanager
    def transaction(self) -> Iterator["Store"]:
        """Group writes: all of them commit at the end of the block, or none if it raises.

        Holds the write lock for the whole block (other processes' writes wait), so keep it short.
        Nested blocks join the outer one.

        >>> import tempfile, os
        >>> store = Store(os.path.join(tempfile.mkdtemp(), "t.db"))
        >>> with store.transaction():
        ...     _ = store.create_experiment("a")
        ...     _ = store.create_experiment("b")
        >>> [e.name for e in store.experiments()]
        ['a', 'b']
        """
        if self.readonly:
            raise StoreError(f"the store {self.path} is open read-only; cannot start a transaction")
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self
                finally:
                    self._depth -= 1
                return
            conn = self._connection()
            with self._guard("starting a transaction"):
                conn.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield self
                self._check_file("committing a transaction")
            except BaseException:
                self._depth = 0
                self._experiment_ids.clear()
                self._numbered.clear()  # numbers counted inside the rolled-back writes
                with self._guard("rolling back a transaction"):
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                raise
            self._depth = 0
            with self._guard("committing a transaction"):
                conn.execute("COMMIT")

    def _json(self, obj: Any, what: str) -> str:
        try:
            return json.dumps(obj, default=_json_default, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise StoreError(f"cannot write {what} to the store {self.path}: {e}") from e

    # -- experiments ----------------------------------------------------------------------------

    _runs_held: set[tuple[str, str]] = set()  # (store, experiment) locked by this process

    def lock_run(self, experiment: str) -> None:
        """Claim the right to run ``experiment`` until this store is closed. A second process (or a
        second store object here) asking while it is held gets a one-line :class:`StoreError`
        naming the holder (pid and host). The claim is a POSIX lock on
        ``<db name>.files/<experiment>/.run.lock``: the system drops it when the holder's process
        ends, however it ends, so a killed run never blocks the next one.

        >>> import tempfile, os
        >>> a = Store(os.path.join(tempfile.mkdtemp(), "t.db"))
        >>> a.lock_run("search")
        >>> b = Store(a.path)
        >>> b.lock_run("search")
        Traceback (most recent call last):
        ...
        tridens.errors.StoreError: experiment 'search' is already running ...
        >>> a.close(); b.lock_run("search"); b.close()
        """
        import fcntl
        import socket

        if experiment in self._run_locks:
            return
        if not isinstance(experiment, str) or not _NAME_RE.fullmatch(experiment):
            raise ValueError(f"An experiment name must be letters, digits, '_', '.', '-'. Got {experiment!r} instead.")
        key = (str(self.path.resolve()), experiment)
        if key in Store._runs_held:  # checked first: opening and closing the file here would drop the lock
            raise StoreError(f"experiment {experiment!r} is already running in the store {self.path} (pid "
                             f"{os.getpid()} on {socket.gethostname()}, this process); wait for it or use another name")
        path = self.files_dir / experiment / ".run.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StoreError(f"cannot claim experiment {experiment!r} of the store {self.path}: {e}") from e
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            raise StoreError(f"experiment {experiment!r} is already running in the store {self.path} "
                             f"({holder or 'by another process'}); wait for it, stop it, or use another name") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._run_locks[experiment] = fd
        Store._runs_held.add(key)

    def _release_run(self, experiment: str) -> None:
        fd = self._run_locks.pop(experiment)
        Store._runs_held.discard((str(self.path.resolve()), experiment))
        if os.getpid() == self._pid:  # a forked copy holds no POSIX lock, and must not touch the file
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        os.close(fd)

    def create_experiment(self, name: str, config: Mapping[str, Any] | None = None, *,
                          status: str = "created", exist_ok: bool = False) -> ExperimentRecord:
        """Add an experiment; ``name`` is unique in the store and names its checkpoint folder.

        With ``exist_ok=True`` an existing experiment of that name is returned unchanged.

        >>> import tempfile, os
        >>> store = Store(os.path.join(tempfile.mkdtemp(), "t.db"))
        >>> store.create_experiment("lr-sweep", {"max_trials": 16, "seed": 0}).config
        {'max_trials': 16, 'seed': 0}
        """
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(
                f"An experiment name must be 1-128 characters of letters, digits, '_', '.', '-' and inner spaces, "
                f"not starting with '.' or '-' (it names a folder). Got {name!r} instead.")
        config_json = self._json(dict(config or {}), f"the config of experiment {name!r}")
        now = time.time()
        with self._writing(f"creating experiment {name!r}", single=True) as conn:
            if exist_ok:
                conn.execute(
                    "INSERT OR IGNORE INTO experiments (name, status, config, created_at, updated_at) "
                    "VALUES (?, ?, ?, ?, ?)", (name, status, config_json, now, now))
            else:
                try:
                    conn.execute(
                        "INSERT INTO experiments (name, status, config, created_at, updated_at) "
                        "VALUES (?, ?, ?, ?, ?)", (name, status, config_json, now, now))
                except sqlite3.IntegrityError as e:
                    raise StoreError(f"experiment {name!r} already exists in the store {self.path}; use "
                                     f"get_experiment({name!r}), exist_ok=True, or another name") from e
        return self.get_experiment(name)

    def get_experiment(self, name: str) -> ExperimentRecord:
        """The experiment called ``name``; :class:`StoreError` listing the known names if none."""
        with self._reading(f"reading experiment {name!r}") as conn:
            row = conn.execute("SELECT id, name, status, config, created_at, updated_at FROM experiments "
                               "WHERE name = ?", (name,)).fetchone()
            if row is None:
                names = [r[0] for r in conn.execute("SELECT name FROM experiments ORDER BY id LIMIT 21")]
        if row is None:
            shown = ", ".join(repr(n) for n in names[:20]) + (", ..." if len(names) > 20 else "")
            raise StoreError(f"no experiment {name!r} in the store {self.path} (it holds: {shown or 'none'})")
        return self._experiment_record(row)

    def delete_experiment(self, name: str) -> None:
        """Remove the experiment ``name`` with its trials, metrics and checkpoint rows (the engine
        removes an experiment whose run failed before its first trial). Raises when it has none."""
        eid = self._experiment_id(name)
        with self._writing(f"deleting experiment {name!r}", single=True) as conn:
            conn.execute("DELETE FROM experiments WHERE id = ?", (eid,))
        self._experiment_ids.pop(name, None)
        self._numbered.pop(eid, None)

    def experiments(self, *, damaged: list[str] | None = None) -> list[ExperimentRecord]:
        """Every experiment, oldest first. A damaged row (its config not a JSON object) raises
        :class:`StoreError` naming it; with a list as ``damaged``, it is left out and that one line
        appended instead (what readers that list a store do)."""
        with self._reading("listing experiments") as conn:
            rows = conn.execute("SELECT id, name, status, config, created_at, updated_at FROM experiments "
                                "ORDER BY id").fetchall()
        records = []
        for row in rows:
            try:
                records.append(self._experiment_record(row))
            except StoreError as err:
                if damaged is None:
                    raise
                damaged.append(str(err))
        return records

    def update_experiment(self, name: str, *, status: str | None = None,
                          config: Mapping[str, Any] | None = None) -> ExperimentRecord:
        """Set the status and/or replace the config of an experiment; returns the updated record."""
        sets: list[str] = ["updated_at = ?"]
        args: list[float | str] = [time.time()]
        if status is not None:
            sets.append("status = ?")
            args.append(status)
        if config is not None:
            sets.append("config = ?")
            args.append(self._json(dict(config), f"the config of experiment {name!r}"))
        with self._writing(f"updating experiment {name!r}", single=True) as conn:
            cur = conn.execute(f"UPDATE experiments SET {', '.join(sets)} WHERE name = ?", (*args, name))
        if cur.rowcount == 0:
            self.get_experiment(name)  # raises, naming the experiments there are
        return self.get_experiment(name)

    def _experiment_record(self, row: tuple[Any, ...]) -> ExperimentRecord:
        config = self._json_object(row[3], f"the config of experiment {row[1]!r}")
        return ExperimentRecord(id=row[0], name=row[1], status=row[2], config=config,
                                created_at=row[4], updated_at=row[5])

    def _json_object(self, text: Any, what: str) -> dict[str, Any]:
        """A stored JSON object, or :class:`StoreError` naming ``what`` (a damaged or edited row)."""
        try:
            value = json.loads(text)
        except (TypeError, ValueError) as e:
            raise StoreError(f"{what} in the store {self.path} is not valid JSON ({e})") from e
        if not isinstance(value, dict):
            raise StoreError(f"{what} in the store {self.path} is a JSON {type(value).__name__}, not an object")
        return value

    def _experiment_id(self, name: str) -> int:
        eid = self._experiment_ids.get(name)
        if eid is None:
            eid = self.get_experiment(name).id
            self._experiment_ids[name] = eid
        return eid

    # -- trials -----------------------------------------------------------------------------------

    def add_trial(self, experiment: str, trial: Trial) -> Trial:
        """Write a new trial and give it its id; returns ``trial`` itself, with ``.id``, ``.number``
        and ``.experiment`` set. The incoming ``.id`` is ignored. Per-step values already in
        ``trial.metrics`` are written as steps 0, 1, ...; ``trial.checkpoint`` is not (see
        :meth:`save_checkpoint`)."""
        with self._lock:
            eid = self._experiment_id(experiment)
            metric, metric_nan = _float_or_nan(trial.metric)
            values = (eid, self._json(trial.sample, f"the sample {trial.sample!r}"), trial.fingerprint,
                      int(trial.seed), TrialStatus(trial.status).value, metric, metric_nan, trial.group,
                      trial.max_steps, self._json(trial.info, f"the info of a trial of {experiment!r}"),
                      trial.parent, time.time(), trial.started_at, trial.finished_at, trial.error)
            rows = [(name, step, v) for name, vs in trial.metrics.items() for step, v in enumerate(vs)]
            parent_msg = (f"cannot add a trial to experiment {experiment!r}: its parent trial {trial.parent} "
                          f"is not in the store {self.path}")
            with self._writing(f"adding a trial to experiment {experiment!r}", single=not rows,
                               integrity=parent_msg) as conn:
                trial_id = conn.execute(_INSERT_TRIAL, values).lastrowid
                assert trial_id is not None  # an INSERT's row id
                if rows:
                    conn.executemany(_INSERT_METRIC, [(trial_id, n, s, _float_or_nan(v)[0]) for n, s, v in rows])
                number = self._number(conn, eid, trial_id)
            trial.id = trial_id
            trial.number = number
            trial.experiment = experiment
            return trial

    def update_trial(self, trial: Trial) -> None:
        """Write every field of ``trial`` (found by ``.id``) except ``.metrics`` and ``.checkpoint``,
        which :meth:`add_metrics` and :meth:`save_checkpoint` write."""
        values = self._trial_values(trial)
        with self._writing(f"updating trial {trial.id}", single=True,
                           integrity=f"cannot update trial {trial.id}: its parent trial {trial.parent} is not "
                                     f"in the store {self.path}") as conn:
            cur = conn.execute(_UPDATE_TRIAL, values)
        if cur.rowcount == 0:
            raise StoreError(f"no trial with id {trial.id} in the store {self.path} (add it with add_trial first)")

    def _trial_values(self, trial: Trial) -> tuple[Any, ...]:
        """The parameters of ``_UPDATE_TRIAL`` for ``trial``."""
        metric, metric_nan = _float_or_nan(trial.metric)
        return (self._json(trial.sample, f"the sample of trial {trial.id}"), trial.fingerprint, int(trial.seed),
                TrialStatus(trial.status).value, metric, metric_nan, trial.group, trial.max_steps,
                self._json(trial.info, f"the info of trial {trial.id}"), trial.parent, trial.started_at,
                trial.finished_at, trial.error, trial.id)

    def add_metrics(self, trial_id: int, step: int, values: Mapping[str, float]) -> None:
        """Record the values of one step (epoch) of a trial: ``{name: value}``. Writing a step again
        replaces it. NaN is stored (as SQL NULL) and read back as NaN.

        >>> import tempfile, os, math
        >>> from tridens.trial import Trial
        >>> store = Store(os.path.join(tempfile.mkdtemp(), "t.db"))
        >>> _ = store.create_experiment("e")
        >>> t = store.add_trial("e", Trial(id=-1, sample={}, seed=0))
        >>> store.add_metrics(t.id, 0, {"loss": float("nan"), "val_acc": 0.1})
        >>> math.isnan(store.trial(t.id).metrics["loss"][0])
        True
        """
        rows = []
        for name, value in values.items():
            try:
                v = _float_or_nan(value)[0]
            except (TypeError, ValueError) as e:
                raise StoreError(f"metric {name!r} of trial {trial_id} at step {step} must be a number, got "
                                 f"{value!r}") from e
            rows.append((trial_id, str(name), int(step), v))
        with self._writing(f"adding metrics of trial {trial_id}", single=len(rows) == 1,
                           integrity=f"no trial with id {trial_id} in the store {self.path}") as conn:
            conn.executemany(_INSERT_METRIC, rows)

    def delete_metrics(self, trial_id: int) -> None:
        """Forget every recorded step of a trial (before an interrupted trial is trained again)."""
        with self._writing(f"deleting the metrics of trial {trial_id}") as conn:
            conn.execute("DELETE FROM metrics WHERE trial_id = ?", (trial_id,))

    def trial(self, trial_id: int) -> Trial:
        """One trial by id, with its metrics and checkpoint filled."""
        with self._reading(f"reading trial {trial_id}") as conn:
            row = conn.execute(f"SELECT {_TRIAL_COLUMNS} FROM trials t JOIN experiments e ON e.id = t.experiment_id "
                               f"WHERE t.id = ?", (trial_id,)).fetchone()
            if row is None:
                raise StoreError(f"no trial with id {trial_id} in the store {self.path}")
            number = conn.execute("SELECT COUNT(*) FROM trials WHERE experiment_id = (SELECT experiment_id FROM "
                                  "trials WHERE id = ?) AND id < ?", (trial_id, trial_id)).fetchone()[0]
            metrics = conn.execute("SELECT trial_id, name, value FROM metrics WHERE trial_id = ? "
                                   "ORDER BY name, step", (trial_id,)).fetchall()
            checkpoints = conn.execute("SELECT trial_id, path FROM checkpoints WHERE trial_id = ? ORDER BY id",
                                       (trial_id,)).fetchall()
        trial = self._assemble([row], metrics, checkpoints)[0]
        trial.number = number
        return trial

    def trials(self, experiment: str, *, status: TrialStatus | str | None = None,
               damaged: list[str] | None = None) -> list[Trial]:
        """Every trial of ``experiment`` in id order (optionally only one status), each with
        ``.metrics`` (name -> values ordered by step) and ``.checkpoint`` (the absolute path of its
        latest checkpoint, or None). A damaged row (a sample or info that is not a JSON object, an
        unknown status, an info value of the wrong type) raises :class:`StoreError` naming the
        trial; with a list as ``damaged``, the trial is left out and that one line appended
        instead (the others keep their numbers)."""
        eid = self._experiment_id(experiment)
        where = "t.experiment_id = ?"
        args: list[int | str] = [eid]
        if status is not None:
            where += " AND t.status = ?"
            args.append(TrialStatus(status).value)
        with self._reading(f"reading the trials of experiment {experiment!r}") as conn:
            rows = conn.execute(f"SELECT {_TRIAL_COLUMNS} FROM trials t JOIN experiments e ON e.id = t.experiment_id "
                                f"WHERE {where} ORDER BY t.id", args).fetchall()
            metrics = conn.execute(f"SELECT m.trial_id, m.name, m.value FROM metrics m JOIN trials t ON t.id = "
                                   f"m.trial_id WHERE {where} ORDER BY m.trial_id, m.name, m.step", args).fetchall()
            checkpoints = conn.execute(f"SELECT c.trial_id, c.path FROM checkpoints c JOIN trials t ON t.id = "
                                       f"c.trial_id WHERE {where} ORDER BY c.id", args).fetchall()
            ids = [r[0] for r in rows] if status is None else [r[0] for r in conn.execute(
                "SELECT id FROM trials WHERE experiment_id = ? ORDER BY id", (eid,))]
        numbers = {tid: n for n, tid in enumerate(ids)}  # per experiment, from 0, in id order
        trials = self._assemble(rows, metrics, checkpoints, damaged, numbers)
        for trial in trials:
            trial.number = numbers.get(trial.id)
        return trials

    def _assemble(self, rows: list[tuple[Any, ...]], metrics: list[tuple[Any, ...]],
                  checkpoints: list[tuple[Any, ...]], damaged: list[str] | None = None,
                  numbers: Mapping[int, int] | None = None) -> list[Trial]:
        trials: dict[int, Trial] = {}
        nan = math.nan
        for (tid, exp, sample, fingerprint, seed, status, metric, metric_nan, group, max_steps, info, parent,
             started, finished, error) in rows:
            name = f"trial {tid}" if numbers is None or tid not in numbers else \
                f"trial {tid} (number {numbers[tid]} of {exp!r})"
            try:
                try:
                    status = TrialStatus(status)
                except ValueError as e:
                    known = ", ".join(s.value for s in TrialStatus)
                    raise StoreError(f"{name} in the store {self.path} has the unknown status {status!r} "
                                     f"(known: {known})") from e
                info_value = self._json_object(info, f"the info of {name}")
                _check_info(info_value, f"the info of {name} in the store {self.path}")
                trials[tid] = Trial(
                    id=tid, sample=self._json_object(sample, f"the sample of {name}"), seed=seed, status=status,
                    fingerprint=fingerprint, metric=nan if metric_nan else metric, error=error, group=group,
                    max_steps=max_steps, info=info_value, started_at=started,
                    finished_at=finished, experiment=exp, parent=parent)
            except StoreError as err:
                if damaged is None:
                    raise
                damaged.append(f"{err}; {name} is left out")
        for tid, name, value in metrics:
            if tid in trials:
                trials[tid].metrics.setdefault(name, []).append(nan if value is None else value)
        for tid, rel in checkpoints:
            if tid in trials:
                trials[tid].checkpoint = str(self.files_dir / rel)
        return list(trials.values())

    # -- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, trial_id: int, state: Any, *, kind: str = "final") -> Path:
        """Save ``state`` (tensors, numbers, strings and dicts/lists of them: a ``state_dict()``)
        for a trial, atomically; returns the file's absolute path. The file is
        ``<db name>.files/<experiment>/trial-<number>.pt``, the trial's number in its experiment
        (``trial-<number>-<kind>.pt`` for another ``kind``, e.g. a stage-tree branch point); saving
        the same kind again replaces it.

        >>> import tempfile, os, torch
        >>> from tridens.trial import Trial
        >>> store = Store(os.path.join(tempfile.mkdtemp(), "t.db"))
        >>> _ = store.create_experiment("e")
        >>> t = store.add_trial("e", Trial(id=-1, sample={}, seed=0))
        >>> p = store.save_checkpoint(t.id, {"w": torch.ones(2)})
        >>> p.name, store.load_checkpoint(p)["w"].tolist()
        ('trial-0.pt', [1.0, 1.0])
        """
        rel = self._checkpoint_rel(trial_id, kind, state, None)
        final = self._write_checkpoint_file(trial_id, rel, state)
        with self._writing(f"recording the checkpoint of trial {trial_id}", single=True,
                           integrity=f"no trial with id {trial_id} in the store {self.path}") as conn:
            conn.execute(_INSERT_CHECKPOINT, (trial_id, kind, rel, time.time()))
        return final

    def finish_trial(self, trial: Trial, state: Any = None, *, kind: str = "final") -> Path | None:
        """Write a finished trial: first its checkpoint file (when ``state`` is given, as
        :meth:`save_checkpoint`), then, in one transaction, the checkpoint's row and every field
        of ``trial`` (as :meth:`update_trial`). So a trial whose row says it is done always has its
        checkpoint on disk, and both rows commit together. Returns the checkpoint's path (also set
        as ``trial.checkpoint``), or ``None`` without ``state``.

        >>> import tempfile, os, torch
        >>> from tridens.trial import Trial, TrialStatus
        >>> store = Store(os.path.join(tempfile.mkdtemp(), "t.db"))
        >>> _ = store.create_experiment("e")
        >>> t = store.add_trial("e", Trial(id=-1, sample={}, seed=0))
        >>> t.status, t.metric = TrialStatus.COMPLETED, 0.5
        >>> store.finish_trial(t, {"w": torch.ones(2)}).name
        'trial-0.pt'
        >>> store.trial(t.id).status, store.trial(t.id).checkpoint == t.checkpoint
        (<TrialStatus.COMPLETED: 'completed'>, True)
        """
        if state is None:
            self.update_trial(trial)
            return None
        rel = self._checkpoint_rel(trial.id, kind, state, trial.experiment)
        final = self._write_checkpoint_file(trial.id, rel, state)
        values = self._trial_values(trial)
        eid = None if trial.experiment is None else self._experiment_id(trial.experiment)
        with self._writing(f"finishing trial {trial.id}",
                           integrity=f"cannot finish trial {trial.id}: its parent trial {trial.parent} is not "
                                     f"in the store {self.path}") as conn:
            if eid is None:
                cur = conn.execute(_UPDATE_TRIAL, values)
            else:  # the folder was named after trial.experiment: the row must belong to it
                cur = conn.execute(_UPDATE_TRIAL + " AND experiment_id = ?", (*values, eid))
            if cur.rowcount == 0:
                raise StoreError(f"no trial with id {trial.id} in experiment {trial.experiment!r} of the store "
                                 f"{self.path}")
            conn.execute(_INSERT_CHECKPOINT, (trial.id, kind, rel, time.time()))
        trial.checkpoint = str(final)
        return final

    def _checkpoint_rel(self, trial_id: int, kind: str, state: Any, experiment: str | None) -> str:
        """Checks a checkpoint and names its file, relative to ``files_dir``."""
        import torch

        if not isinstance(kind, str) or not _NAME_RE.fullmatch(kind):
            raise ValueError(f"A checkpoint kind must be letters, digits, '_', '.', '-'. Got {kind!r} instead.")
        if self.readonly:
            raise StoreError(f"the store {self.path} is open read-only; cannot save a checkpoint of trial {trial_id}")
        _check_state(state, "the checkpoint state", torch)
        with self._reading(f"finding trial {trial_id}") as conn:
            row = conn.execute("SELECT e.name, t.experiment_id FROM trials t JOIN experiments e ON e.id = t.experiment_id "
                               "WHERE t.id = ?", (trial_id,)).fetchone()
            known = experiment is not None and _NAME_RE.fullmatch(experiment)
            if row is None and not known:
                raise StoreError(f"no trial with id {trial_id} in the store {self.path}; cannot save its checkpoint")
            if row is None:  # finish_trial says which row it misses
                return f"{experiment}/trial-id{trial_id}.pt"
            if not known:
                experiment = row[0]
            # named by the trial's number in its experiment, as tables show it; a store written when
            # files were named by store id (trial-<id>[-<kind>].pt) may hold that name for the trial
            # whose id is this number, with this kind: then the id is added. No other row can hold it
            # (a numbered name carries its own trial's number; a name's folder is its experiment).
            number = self._number(conn, row[1], trial_id)
            name = f"trial-{number}" if kind == "final" else f"trial-{number}-{kind}"
            taken = conn.execute("SELECT 1 FROM checkpoints WHERE trial_id = ? AND kind = ? AND path = ? "
                                 "AND trial_id != ?", (number, kind, f"{experiment}/{name}.pt", trial_id)).fetchone()
        return f"{experiment}/{name}-id{trial_id}.pt" if taken else f"{experiment}/{name}.pt"

    def _number(self, conn: sqlite3.Connection, eid: int, trial_id: int) -> int:
        """The number of trial ``trial_id`` in experiment ``eid``: how many of its trials have a
        smaller id. Counted from the latest trial numbered here (ids only grow, and trials leave only
        with their experiment), so a count spans the trials added since, not the whole experiment."""
        known = self._numbered.get(eid)
        if known is None:
            number = conn.execute("SELECT COUNT(*) FROM trials WHERE experiment_id = ? AND id < ?",
                                  (eid, trial_id)).fetchone()[0]
        else:
            low, high = sorted((known[0], trial_id))
            between = conn.execute("SELECT COUNT(*) FROM trials WHERE experiment_id = ? AND id >= ? AND id < ?",
                                   (eid, low, high)).fetchone()[0]
            number = known[1] + between if trial_id >= known[0] else known[1] - between
        if known is None or trial_id > known[0]:
            self._numbered[eid] = (trial_id, int(number))
        return int(number)

    def _write_checkpoint_file(self, trial_id: int, rel: str, state: Any) -> Path:
        """Write the file atomically (a temporary file, then ``os.replace``). With
        ``synchronous="NORMAL"`` it is not fsynced, like the database's own commits in WAL mode:
        both survive a crash of the process (the data sit in the OS page cache), neither
        necessarily a power loss; ``"FULL"`` fsyncs the file and its folder, as SQLite then does."""
        import torch

        final = self.files_dir / rel
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            if final.parent not in self._made_dirs:
                final.parent.mkdir(parents=True, exist_ok=True)
                self._made_dirs.add(final.parent)
            with open(tmp, "wb") as f:
                torch.save(state, f)
                if self.synchronous == "FULL":
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if self.synchronous == "FULL":
                fd = os.open(final.parent, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:
            self._made_dirs.discard(final.parent)  # removed behind our back? make it again next time
            with contextlib.suppress(OSError):
                tmp.unlink()
            fault = self._fault(e, final, f"saving the checkpoint of trial {trial_id}")
            if fault is not None:
                raise fault from e
            raise StoreError(f"cannot write the checkpoint {final} of trial {trial_id}: {e}") from e
        except BaseException as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            # Ctrl-C inside torch.save can surface as its zip writer's RuntimeError, the interrupt
            # its context: the run then stops as on any Ctrl-C, not with that error
            if isinstance(e, RuntimeError) and isinstance(e.__context__, KeyboardInterrupt):
                raise e.__context__ from None
            fault = self._fault(e, final, f"saving the checkpoint of trial {trial_id}") if isinstance(e, RuntimeError) else None
            if fault is not None:  # torch's zip writer met a full disk
                raise fault from e
            raise
        return final

    def load_checkpoint(self, path: str | os.PathLike[str], *, map_location: Any = "cpu") -> Any:
        """Load a checkpoint saved by :meth:`save_checkpoint` (``weights_only=True``: tensors and plain
        containers, nothing executable). ``path`` is absolute or relative to ``<db name>.files/``, and
        must lie inside that folder (a row naming another file, a ``..`` or a link out, is refused)."""
        import pickle

        import torch

        p = Path(path)
        if not p.is_absolute():
            p = self.files_dir / p
        if not p.resolve().is_relative_to(self.files_dir.resolve()):
            raise StoreError(f"refusing the checkpoint {str(p)!r}: it lies outside the store's folder {self.files_dir}")
        if not p.is_file():
            raise StoreError(f"no checkpoint file {p} (store {self.path})")
        try:
            check_archive(p)
        except TridensError as err:
            raise StoreError(str(err)) from err
        try:
            return torch.load(p, map_location=map_location, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StoreError(f"cannot load the checkpoint {p}: {first}") from e


# The types the engine writes for the info values readers format (a value of another type is a
# damaged or edited row); None means absent.
_INFO_TYPES: dict[str, tuple[type, ...]] = {
    "params": (int,), "flops": (int, float), "train_seconds": (int, float), "stages": (list,), "unit": (dict,),
    "warm_start": (dict,), "exploits": (list,), "duplicate_of": (int,),
}


def info_problem(info: Mapping[str, Any]) -> str | None:
    """What is wrong with a trial's stored ``info`` (a value readers format, of another type than
    the engine writes), or None.

    >>> info_problem({"params": "x"})
    "holds params='x', not an int"
    """
    for key, types in _INFO_TYPES.items():
        value = info.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            kinds = " or ".join(("an " if t is int else "a ") + t.__name__ for t in types)
            return f"holds {key}={_short(value)}, not {kinds}"
    return None


def _check_info(info: Mapping[str, Any], what: str) -> None:
    problem = info_problem(info)
    if problem is not None:
        raise StoreError(f"{what} {problem}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_LEAVES = (str, bytes, int, float, bool, type(None))


def _check_state(obj: Any, where: str, torch: Any) -> None:
    """Refuse what ``torch.load(weights_only=True)`` would refuse, naming where it sits."""
    if isinstance(obj, _LEAVES) or isinstance(obj, (torch.Tensor, torch.dtype, torch.device, torch.Size)):
        return
    if isinstance(obj, torch.nn.Module):
        raise StoreError(f"{where} is a {type(obj).__name__} module; save its state_dict() instead (checkpoints "
                         f"are loaded with weights_only=True)")
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise StoreError(f"{where} has a key of type {type(key).__qualname__} ({key!r}); use str or int keys")
            _check_state(value, f"{where}[{key!r}]", torch)
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_state(value, f"{where}[{i}]", torch)
        return
    raise StoreError(f"{where} is a {type(obj).__qualname__}; checkpoints hold tensors, numbers, strings and "
                     f"dicts/lists of them (they are loaded with weights_only=True)")
