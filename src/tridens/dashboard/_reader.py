"""Read-only queries over a tridens store for the dashboard: pages, filters and aggregates in SQL.

The dashboard opens the database with SQLite's ``mode=ro`` URI, so it cannot write even by
mistake, and reads a store while a run writes it (WAL: readers never wait for the writer). Every
list the browser asks for is paginated or aggregated here, so a page stays small with 10,000 trials.

>>> import tempfile, os
>>> from tridens.store import Store
>>> from tridens.trial import Trial
>>> path = os.path.join(tempfile.mkdtemp(), "t.db")
>>> with Store(path) as store:
...     _ = store.create_experiment("demo", {"objective": {"metric": "val_acc", "mode": "max"}})
...     _ = store.add_trial("demo", Trial(id=-1, sample={"width": 32}, seed=0))
>>> reader = StoreReader(path)
>>> page = reader.trials_page("demo", limit=10)
>>> page["total"], page["rows"][0]["sample"]
(1, {'width': 32})
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..store import CURRENT_VERSION, StoreError, info_problem
from ..trial import Trial, TrialStatus

__all__ = ["StoreReader", "SORT_KEYS", "MAX_PAGE", "MAX_CURVES", "MAX_POINTS", "log_scale_labels"]

MAX_PAGE = 500  # rows in one page of the trial table
MAX_CURVES = 50  # trials in one learning-curve request
MAX_POINTS = 5_000  # finished trials in one hyperparameter view (a sample beyond it)
# A trial's place in the store's sample: its id scrambled (Knuth's multiplicative hash), so that the
# first N trials by this key are a uniform sample that stays put as trials are added.
_SCRAMBLED = "((t.id * 2654435761) % 4294967296)"
_COUNTED = ("completed", "stopped")
_SETTLED = ("completed", "stopped", "failed")  # a trial in these states no longer changes its sample or metrics


@dataclass
class _Scanned:
    """What the reader has read of one experiment's trials, so that a poll reads only what changed:
    every trial up to ``last_id`` and, again each time, ``unsettled`` (those of them still running
    or pending, which may report a new metric, be rewritten or finish). A settled trial
    (``_SETTLED``) never changes again and is read once."""

    experiment: tuple[Any, ...]  # (id, created_at, objective mode): a replaced store or experiment starts over
    last_id: int = 0
    unsettled: list[int] = field(default_factory=list)
    first: list[str] = field(default_factory=list)  # the first trial's labels, in its order
    labels: set[str] = field(default_factory=set)
    metrics: set[str] = field(default_factory=set)
    records: list[tuple[float, float, int]] = field(default_factory=list)  # (finished_at, best so far, id)
    last_finished: float | None = None
    stop_steps: set[int] = field(default_factory=set)


# Sort keys of the trial table -> SQL expression over the numbered trials ``n``.
SORT_KEYS = {
    "number": "n.number", "id": "n.id", "status": "n.status", "metric": "n.metric", "seed": "n.seed",
    "duration": "(n.finished_at - n.started_at)", "params": "json_extract((CASE WHEN json_valid(n.info) THEN n.info END), '$.params')",
    "flops": "json_extract((CASE WHEN json_valid(n.info) THEN n.info END), '$.flops')", "epochs": "epochs", "group": "n.group_id",
    "started": "n.started_at", "finished": "n.finished_at",
}


def _json_path(label: str) -> str:
    """A JSON path selecting the key ``label`` of an object (quotes and backslashes escaped)."""
    return '$."' + label.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _covers(path: Sequence[Sequence[Any]], epochs: int | None, label: str, first: int, last: int) -> bool:
    """Whether a trial's stage path (``[node, parent, first epoch]`` per stage, as
    ``info["stages"]`` records it) of ``epochs`` epochs went through node ``label`` over epochs
    ``[first, last)``."""
    for i, (node, _, start) in enumerate(path):
        end = path[i + 1][2] if i + 1 < len(path) else (epochs if epochs else math.inf)
        if str(node) == label and int(start) <= first and last <= end:
            return True
    return False


def _tree_epochs(paths: Sequence[tuple[Sequence[Sequence[Any]], int]]) -> tuple[int, int]:
    """Epochs a stage tree trained, and the trial-epochs its trials would have trained alone, from
    each trial's stage path (``[node, parent, first epoch]`` per stage) and its epoch count: a
    node spans from its first epoch to the furthest any trial went on in it."""
    spans: dict[str, tuple[int, int]] = {}
    alone = 0
    for path, epochs in paths:
        alone += epochs
        for i, (node, _, first) in enumerate(path):
            end = path[i + 1][2] if i + 1 < len(path) else epochs
            low, high = spans.get(str(node), (int(first), int(first)))
            spans[str(node)] = (min(low, int(first)), max(high, int(end)))
    return sum(high - low for low, high in spans.values()), alone


def _speedups(units: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The measured fusion decisions the trials of one unit record (``unit["speedups"]``), each
    group once: ``{"trials": [store ids], "speedup", "fused"}``."""
    seen: dict[tuple[int, ...], dict[str, Any]] = {}
    for unit in units:
        for entry in unit.get("speedups") or []:
            if isinstance(entry, Mapping) and isinstance(entry.get("speedup"), (int, float)):
                key = tuple(int(t) for t in entry.get("trials") or [])
                seen[key] = {"trials": list(key), "speedup": float(entry["speedup"]), "fused": bool(entry.get("fused"))}
    return list(seen.values())


def log_scale_labels(described: Any) -> list[str]:
    """The labels of a described search space (``SearchSpace.describe()``, as the store keeps it)
    that are drawn on a log scale: ``td.loguniform`` ones.

    >>> log_scale_labels({"lr": {"type": "loguniform", "low": 1e-4, "high": 0.1}, "width": {"type": "categorical"}})
    ['lr']
    """
    if not isinstance(described, Mapping):
        return []
    return [label for label, d in described.items() if isinstance(d, Mapping) and d.get("type") == "loguniform"]


def _object(text: Any, what: str) -> tuple[dict[str, Any], str | None]:
    """A stored JSON object and None, or ``({}, why)`` for a damaged row (what the page shows)."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError) as err:
        return {}, f"{what} is not valid JSON ({err})"
    if not isinstance(value, dict):
        return {}, f"{what} is a JSON {type(value).__name__}, not an object"
    return value, None


def _loads(text: Any) -> Any:
    """JSON that SQLite's ``json_extract`` returned, or None (a value of another kind)."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


def _field(config: Mapping[str, Any], key: str, inner: str) -> Any:
    """``config[key][inner]`` when ``config[key]`` is an object, else None (a damaged value)."""
    value = config.get(key)
    return value.get(inner) if isinstance(value, Mapping) else None


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such a float becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _opens(uri: str) -> bool:
    """Whether SQLite can read the database at ``uri``."""
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=5.0, isolation_level=None)
    except sqlite3.Error:
        return False
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return True
    except sqlite3.Error:
        return False
    finally:
        conn.close()


class StoreReader:
    """Queries over the store at ``path``, opened read-only (``mode=ro``); one connection per thread.

    A store that does not exist yet is waited for (:meth:`exists`; the experiment list is empty
    until an experiment creates it). Raises :class:`~tridens.errors.StoreError` naming the file when
    it is not a tridens store, or written by a newer tridens.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).absolute()
        self._uri: str | None = None
        self._local = threading.local()
        self._opening = threading.Lock()
        self._scans: dict[str, _Scanned] = {}
        self._scanning = threading.Lock()
        if self.path.exists():
            self._open()

    def exists(self) -> bool:
        """Whether the store file exists (an experiment created it)."""
        return self.path.is_file()

    def _open(self) -> str:
        """The store's read-only URI, once its file exists and is checked to be a tridens store."""
        with self._opening:
            if self._uri is None:
                if not self.path.is_file():
                    raise StoreError(f"no store at {self.path} yet (run an experiment that writes it, or pass --db PATH)")
                uri = self.path.resolve().as_uri() + "?mode=ro"
                if not _opens(uri) and not os.access(self.path.parent, os.W_OK):
                    # A WAL store on a read-only filesystem: its -shm file cannot be created, and
                    # nobody can be writing it either, so it is read as an immutable file (as the CLI does).
                    uri = self.path.resolve().as_uri() + "?immutable=1"
                version = self._version(sqlite3.connect(uri, uri=True, timeout=5.0, isolation_level=None))
                if version > CURRENT_VERSION:
                    raise StoreError(f"{self.path} was written by a newer tridens (store schema version {version}); "
                                     f"this tridens reads schema versions up to {CURRENT_VERSION}. Upgrade tridens "
                                     "to read it.")
                self._uri = uri
            return self._uri

    # -- connections -------------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self._open(), uri=True, timeout=5.0, isolation_level=None, check_same_thread=False)
            self._local.conn = conn
        return conn

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._conn().execute(sql, args).fetchall()
        except sqlite3.Error as err:
            raise StoreError(f"cannot read the store {self.path}: {err}") from err

    def _version(self, conn: sqlite3.Connection) -> int:
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "schema_version" not in tables:
                raise StoreError(f"{self.path} is not a tridens store (no schema_version table)")
            return int(conn.execute("SELECT version FROM schema_version").fetchone()[0])
        except sqlite3.Error as err:
            raise StoreError(f"cannot read the store {self.path}: {err}") from err
        finally:
            conn.close()

    # -- experiments --------------------------------------------------------------------------------

    def _experiment_row(self, name: str) -> tuple[Any, ...]:
        rows = self._rows("SELECT id, name, status, config, created_at, updated_at FROM experiments WHERE name = ?",
                          (name,))
        if not rows:
            known = [r[0] for r in self._rows("SELECT name FROM experiments ORDER BY id LIMIT 20")]
            raise StoreError(f"no experiment {name!r} in the store {self.path} (it holds: "
                             f"{', '.join(map(repr, known)) or 'none'})")
        return rows[0]

    @staticmethod
    def objective(config: Mapping[str, Any]) -> dict[str, str]:
        """The experiment's objective as ``{"metric": ..., "mode": ...}`` (val_acc, max by default)."""
        objective = config.get("objective") or {}
        if not isinstance(objective, Mapping):  # a damaged value: the defaults (the summary says it is damaged)
            objective = {}
        metric, mode = objective.get("metric", "val_acc"), objective.get("mode", "max")
        return {"metric": metric if isinstance(metric, str) else "val_acc", "mode": mode if mode in ("max", "min") else "max"}

    def experiments(self) -> list[dict[str, Any]]:
        """Every experiment with its trial counts by status, progress and best value (none while
        the store does not exist yet)."""
        if self._uri is None and not self.exists():
            return []
        rows = self._rows("SELECT id, name, status, config, created_at, updated_at FROM experiments ORDER BY id")
        counts: dict[int, dict[str, int]] = {}
        for eid, status, n in self._rows("SELECT experiment_id, status, COUNT(*) FROM trials "
                                         "GROUP BY experiment_id, status"):
            counts.setdefault(eid, {})[status] = n
        best = {(eid, mode): value for eid, mode, value in self._rows(
            "SELECT experiment_id, 'max', MAX(metric) FROM trials WHERE status IN ('completed', 'stopped') "
            "GROUP BY experiment_id UNION ALL "
            "SELECT experiment_id, 'min', MIN(metric) FROM trials WHERE status IN ('completed', 'stopped') "
            "GROUP BY experiment_id")}
        return [self._summary(row, counts.get(row[0], {}), best) for row in rows]

    def _summary(self, row: tuple[Any, ...], counts: dict[str, int],
                 best: Mapping[tuple[int, str], Any]) -> dict[str, Any]:
        eid, name, status, config_text, created, updated = row
        config, damaged = _object(config_text, f"the config of experiment {name!r}")
        stored = config.get("objective")
        if damaged is None and stored is not None and (not isinstance(stored, Mapping) or not isinstance(
                stored.get("metric", ""), str) or stored.get("mode", "max") not in ("max", "min")):
            damaged = f"experiment {name!r} records the objective {str(stored)[:80]!r}, which is not one"
        objective = self.objective(config)
        finished = sum(counts.get(s, 0) for s in ("completed", "stopped", "failed"))
        max_trials = config.get("max_trials")
        if not isinstance(max_trials, int) or isinstance(max_trials, bool) or max_trials < 1:
            max_trials = None
        script = config.get("script")
        return {"damaged": damaged,
            "name": name, "status": status, "created_at": created, "updated_at": updated,
            "objective": objective, "second_objective": config.get("second_objective"),
            "trials": sum(counts.values()), "by_status": counts, "finished": finished, "max_trials": max_trials,
            # a run without a trial limit (a one-shot search, a strategy that ends itself) is done when it says so
            "progress": (min(1.0, finished / max_trials) if max_trials else 1.0 if status == "done" else None),
            "best": _finite(best.get((eid, objective["mode"]))),
            "strategy": _field(config, "strategy", "repr"),
            "evaluator": _field(config, "evaluator", "repr"),
            "script": script if isinstance(script, str) else None,
        }

    def experiment(self, name: str) -> dict[str, Any]:
        """One experiment: its summary, labels, metric names, and best-so-far over time."""
        row = self._experiment_row(name)
        eid = row[0]
        counts, best = {}, {}
        for status, n, high, low in self._rows("SELECT status, COUNT(*), MAX(metric), MIN(metric) FROM trials "
                                               "WHERE experiment_id = ? GROUP BY status", (eid,)):
            counts[status] = n
            if status in _COUNTED:
                best[status] = (high, low)
        summary = self._summary(row, counts, {})
        mode = summary["objective"]["mode"]
        values = [v[0 if mode == "max" else 1] for v in best.values() if v[0 if mode == "max" else 1] is not None]
        summary["best"] = _finite((max if mode == "max" else min)(values)) if values else None
        scan = self._scan(row)
        summary["labels"] = scan.first + sorted(scan.labels - set(scan.first))
        summary["metrics"] = sorted(scan.metrics)
        summary["best_over_time"] = self._best_points(scan)
        summary["stop_steps"] = sorted(scan.stop_steps)[:100]
        summary["config"] = _object(row[3], "")[0]
        return summary

    def _scan(self, row: tuple[Any, ...]) -> _Scanned:
        """The experiment's labels, metric names, best-so-far records and stop steps, read
        incrementally (:class:`_Scanned`): the trials added since the last call and those not
        settled then. The first call reads every trial; a poll of a large store reads the few new."""
        eid, name, created = row[0], row[1], row[4]
        mode = self.objective(_object(row[3], "")[0])["mode"]
        with self._scanning:
            scan = self._scans.get(name)
            if scan is None or scan.experiment != (eid, created, mode):  # new, or the store was replaced
                scan = self._scans[name] = _Scanned((eid, created, mode))
            last = self._rows("SELECT MAX(id) FROM trials WHERE experiment_id = ?", (eid,))[0][0] or 0
            if last == scan.last_id and not scan.unsettled:
                return scan
            chosen = ("SELECT id FROM trials WHERE experiment_id = ? AND id > ? AND id <= ? UNION "
                      "SELECT value FROM json_each(?)")
            args = (eid, scan.last_id, last, json.dumps(scan.unsettled))
            if not scan.first:
                first = self._rows("SELECT sample FROM trials WHERE experiment_id = ? ORDER BY id LIMIT 1", (eid,))
                scan.first = list(_object(first[0][0], "")[0]) if first else []
            scan.labels.update(r[0] for r in self._rows(
                "SELECT DISTINCT j.key FROM trials t, json_each(CASE WHEN json_valid(t.sample) AND "
                f"json_type(t.sample) = 'object' THEN t.sample ELSE '{{}}' END) j WHERE t.id IN ({chosen})", args))
            scan.metrics.update(r[0] for r in self._rows(
                f"SELECT DISTINCT name FROM metrics WHERE trial_id IN ({chosen})", args))
            scan.stop_steps.update(r[0] for r in self._rows(
                f"SELECT MAX(m.step) FROM metrics m JOIN trials t ON t.id = m.trial_id WHERE t.id IN ({chosen}) "
                "AND t.status = 'stopped' GROUP BY m.trial_id", args) if r[0] is not None)
            finished = self._rows(
                f"SELECT finished_at, metric, id FROM trials WHERE id IN ({chosen}) AND status IN {_COUNTED} "
                "AND metric IS NOT NULL AND finished_at IS NOT NULL", args)
            if finished:
                # The records of a set are the records of (its old records + the new points): a point
                # an earlier one beat stays beaten, whatever is added.
                better = (lambda a, b: a > b) if mode == "max" else (lambda a, b: a < b)
                records: list[tuple[float, float, int]] = []
                for point in sorted(scan.records + finished, key=lambda r: (r[0], r[2])):
                    if not records or better(point[1], records[-1][1]):
                        records.append(point)
                scan.records = records
                latest = max(f for f, _, _ in finished)
                scan.last_finished = latest if scan.last_finished is None else max(scan.last_finished, latest)
            scan.unsettled = [r[0] for r in self._rows(
                f"SELECT id FROM trials WHERE id IN ({chosen}) AND status NOT IN {_SETTLED}", args)]
            scan.last_id = last
            return scan

    def best_over_time(self, name: str) -> list[dict[str, Any]]:
        """The best value so far at each improvement, by finishing time (a step function: only
        improving trials are returned, so it stays short however many trials there are), ending
        at the last finish."""
        return self._best_points(self._scan(self._experiment_row(name)))

    @staticmethod
    def _best_points(scan: _Scanned) -> list[dict[str, Any]]:
        points = [{"time": finished, "best": value, "trial": tid} for finished, value, tid in scan.records]
        if points and points[-1]["time"] != scan.last_finished:
            points.append({"time": scan.last_finished, "best": points[-1]["best"], "trial": points[-1]["trial"]})
        return points

    def stop_steps(self, name: str) -> list[int]:
        """The steps at which the strategy stopped a trial (an early-stopping rule's rungs, as the
        store shows them): a trial whose curve goes on past one of them was promoted there."""
        return sorted(self._scan(self._experiment_row(name)).stop_steps)[:100]

    def labels(self, name: str) -> list[str]:
        """Every label of the experiment's samples: the first trial's in its order, then the others
        (conditional labels) alphabetically."""
        scan = self._scan(self._experiment_row(name))
        return scan.first + sorted(scan.labels - set(scan.first))

    def log_labels(self, name: str) -> list[str]:
        """The labels the space declared on a log scale (``td.loguniform``), as the experiment
        recorded its search space: plots draw them on log axes."""
        config = _object(self._experiment_row(name)[3], "")[0]
        return log_scale_labels(config.get("search_space"))

    # -- trials -------------------------------------------------------------------------------------

    def trials_page(self, name: str, *, offset: int = 0, limit: int = 50, sort: str = "number",
                    descending: bool = False, statuses: Iterable[str] = (),
                    label_filters: Mapping[str, str] | None = None) -> dict[str, Any]:
        """One page of the trial table: ``{"total", "offset", "limit", "rows"}``.

        ``sort`` is a key of :data:`SORT_KEYS` or ``label:<label>``; ``statuses`` keeps those
        statuses; ``label_filters`` keeps trials whose label equals the value (compared as the
        value's text, ``32`` or ``conv``, or its JSON, ``"conv"``).
        """
        eid = self._experiment_row(name)[0]
        limit = max(1, min(int(limit), MAX_PAGE))
        offset = max(0, int(offset))
        where, args = ["1"], []
        statuses = [s for s in statuses if s]
        if statuses:
            where.append(f"n.status IN ({', '.join('?' * len(statuses))})")
            args += statuses
        for label, value in (label_filters or {}).items():
            path = _json_path(label)
            where.append("(CAST(json_extract((CASE WHEN json_valid(n.sample) THEN n.sample END), ?) AS TEXT) = ? OR json_quote(json_extract((CASE WHEN json_valid(n.sample) THEN n.sample END), ?)) = ?)")
            args += [path, value, path, value]
        if sort.startswith("label:"):
            order = "json_extract((CASE WHEN json_valid(n.sample) THEN n.sample END), ?)"
            order_args = [_json_path(sort[len("label:"):])]
        elif sort in SORT_KEYS:
            order, order_args = SORT_KEYS[sort], []
        else:
            raise ValueError(f"unknown sort key {sort!r}; known: {', '.join(SORT_KEYS)} or label:<label>")
        direction = "DESC" if descending else "ASC"
        numbered = ("(SELECT t.*, ROW_NUMBER() OVER (ORDER BY t.id) - 1 AS number FROM trials t "
                    "WHERE t.experiment_id = ?) n")
        condition = " AND ".join(where)
        total = self._rows(f"SELECT COUNT(*) FROM {numbered} WHERE {condition}", [eid, *args])[0][0]
        rows = self._rows(
            f"SELECT n.id, n.number, n.status, n.metric, n.metric_nan, n.seed, n.fingerprint, n.sample, n.info, "
            f"n.group_id, n.parent, n.started_at, n.finished_at, n.error, "
            f"(SELECT MAX(m.step) + 1 FROM metrics m WHERE m.trial_id = n.id) AS epochs "
            f"FROM {numbered} WHERE {condition} "
            f"ORDER BY ({order}) IS NULL, {order} {direction}, n.id {direction} LIMIT ? OFFSET ?",
            [eid, *args, *order_args, *order_args, limit, offset])
        return {"total": total, "offset": offset, "limit": limit, "rows": [self._trial_row(r) for r in rows]}

    @staticmethod
    def _trial_row(row: tuple[Any, ...]) -> dict[str, Any]:
        (tid, number, status, metric, metric_nan, seed, fingerprint, sample_text, info_text, group, parent,
         started, finished, error, epochs) = row
        # A damaged row is served as damaged (its reason in "damaged"); the rest of the page works.
        info, bad_info = _object(info_text, f"the info of trial {number}")
        sample, bad_sample = _object(sample_text, f"the sample of trial {number}")
        damaged = bad_sample or bad_info
        if damaged is None and info_problem(info) is not None:
            damaged = f"the info of trial {number} {info_problem(info)}"
        if damaged is None and status not in TrialStatus._value2member_map_:
            damaged = f"trial {number} has the unknown status {str(status)[:40]!r}"
        return {"damaged": damaged,
            "id": tid, "number": number, "status": status, "metric": None if metric_nan else _finite(metric),
            "seed": seed, "fingerprint": fingerprint, "sample": sample,
            "params": info.get("params") if isinstance(info.get("params"), (int, float)) else None,
            "flops": info.get("flops") if isinstance(info.get("flops"), (int, float)) else None, "group": group, "parent": parent,
            "started_at": started, "finished_at": finished,
            "duration": None if started is None or finished is None else finished - started,
            "epochs": epochs or 0, "error": error, "info": info,
            "role": Trial(id=tid, sample={}, seed=0, info=info).role,
        }

    def trial(self, name: str, number: int) -> dict[str, Any]:
        """One trial of experiment ``name`` by its number (0, 1, ... in id order), with every
        metric, its checkpoint files and the trials it relates to."""
        eid = self._experiment_row(name)[0]
        rows = self._rows(
            "SELECT n.id, n.number, n.status, n.metric, n.metric_nan, n.seed, n.fingerprint, n.sample, n.info, "
            "n.group_id, n.parent, n.started_at, n.finished_at, n.error, "
            "(SELECT MAX(m.step) + 1 FROM metrics m WHERE m.trial_id = n.id) "
            "FROM (SELECT t.*, ROW_NUMBER() OVER (ORDER BY t.id) - 1 AS number FROM trials t "
            "WHERE t.experiment_id = ?) n WHERE n.number = ?", (eid, int(number)))
        if not rows:
            count = self._rows("SELECT COUNT(*) FROM trials WHERE experiment_id = ?", (eid,))[0][0]
            raise StoreError(f"experiment {name!r} has no trial {number} (its trials are 0..{count - 1})")
        trial = self._trial_row(rows[0])
        trial["metrics"] = self.curves([trial["id"]])[str(trial["id"])]["metrics"]
        files = self.path.with_name(self.path.name + ".files")
        trial["checkpoints"] = {kind: str(files / rel) for kind, rel in self._rows(
            "SELECT kind, path FROM checkpoints WHERE trial_id = ? ORDER BY id", (trial["id"],))}
        trial["children"] = [self.number_of(eid, r[0]) for r in self._rows(
            "SELECT id FROM trials WHERE parent = ? AND experiment_id = ? ORDER BY id", (trial["id"], eid))]
        trial["parent_number"] = None if trial["parent"] is None else self.number_of(eid, trial["parent"])
        trial["group_members"] = [] if trial["group"] is None else [self.number_of(eid, r[0]) for r in self._rows(
            "SELECT id FROM trials WHERE experiment_id = ? AND group_id = ? ORDER BY id LIMIT 200",
            (eid, trial["group"]))]
        unit = trial["info"].get("unit")
        if isinstance(unit, dict) and "ids" in unit:  # recorded by number
            trial["unit_members"] = [t for t in (unit.get("trials") or [])[:200] if isinstance(t, int)]
        else:
            trial["unit_members"] = [self.number_of(eid, int(t)) for t in (unit.get("trials") or [])[:200]
                                     if isinstance(t, int)] if isinstance(unit, dict) else []
        trial["stages"] = self._trial_stages(trial["id"], trial["info"].get("stages"), trial["epochs"])
        return trial

    def _trial_stages(self, trial_id: int, path: Any, epochs: int) -> list[dict[str, Any]]:
        """The stored stages the trial went through, by epoch: those linked to it that its own
        stage path (``info["stages"]``, when recorded) covers; none without stage trees."""
        tables = {r[0] for r in self._rows("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "stage_trials" not in tables:
            return []
        def lr(hp: Any) -> list[Any]:
            values = _object(hp, "")[0].get("lr")
            return [_finite(v) for v in values] if isinstance(values, list) else []

        if not isinstance(path, list) or not all(isinstance(p, list) and len(p) == 3 and isinstance(p[2], int)
                                                 for p in path):
            path = None  # a damaged stage path: every linked stage is shown
        return [{"id": sid, "label": label, "epochs": [e0, e1], "lr": lr(hp),
                 "status": status, "experiment": experiment, "checkpoint": bool(checkpoint)}
                for sid, label, e0, e1, hp, status, experiment, checkpoint in self._rows(
                    "SELECT s.id, s.label, s.first_epoch, s.last_epoch, s.hyperparameters, s.status, e.name, "
                    "s.checkpoint IS NOT NULL FROM stage_trials st JOIN stages s ON s.id = st.stage_id "
                    "LEFT JOIN experiments e ON e.id = s.experiment_id WHERE st.trial_id = ? "
                    "ORDER BY s.first_epoch, s.id LIMIT 500", (trial_id,))
                if not isinstance(path, list) or _covers(path, epochs, label, e0, e1)]

    def number_of(self, eid: int, trial_id: int) -> int | None:
        """A trial's number in experiment ``eid`` (None for a trial of another experiment)."""
        if not self._rows("SELECT 1 FROM trials WHERE id = ? AND experiment_id = ?", (trial_id, eid)):
            return None
        return int(self._rows("SELECT COUNT(*) FROM trials WHERE experiment_id = ? AND id < ?", (eid, trial_id))[0][0])

    def curves(self, trial_ids: Sequence[int], metric: str | None = None) -> dict[str, Any]:
        """Per-step values of the given trials (at most :data:`MAX_CURVES`): ``{id: {"status",
        "metrics": {name: [value, ...]}}}``; NaN becomes None."""
        ids = [int(i) for i in trial_ids][:MAX_CURVES]
        if not ids:
            return {}
        marks = ", ".join("?" * len(ids))
        out: dict[str, Any] = {}
        for tid, status, parent in self._rows(f"SELECT id, status, parent FROM trials WHERE id IN ({marks})", ids):
            out[str(tid)] = {"status": status, "parent": parent, "metrics": {}}
        sql = f"SELECT trial_id, name, step, value FROM metrics WHERE trial_id IN ({marks})"
        args: list[Any] = list(ids)
        if metric:
            sql += " AND name = ?"
            args.append(metric)
        for tid, mname, step, value in self._rows(sql + " ORDER BY trial_id, name, step", args):
            series = out[str(tid)]["metrics"].setdefault(mname, {"steps": [], "values": []})
            series["steps"].append(step)
            series["values"].append(value)
        return out

    def config(self, name: str) -> dict[str, Any]:
        """The experiment's stored config (``{}`` when the row is damaged)."""
        return _object(self._experiment_row(name)[3], "")[0]

    def status_counts(self, name: str) -> dict[str, int]:
        """The experiment's trials counted by status (one aggregate query)."""
        eid = self._experiment_row(name)[0]
        return {s: n for s, n in self._rows("SELECT status, COUNT(*) FROM trials WHERE experiment_id = ? "
                                            "GROUP BY status", (eid,))}

    def values_at_common_step(self, name: str, limit: int | None = None, best: int = 0) -> dict[str, Any]:
        """The objective's value of every finished (completed or stopped) trial at one step all of
        them reached: the last step of the trial that stopped first. With early stopping (ASHA,
        Hyperband, median stopping) that compares every trial at the same budget, stopped ones
        included. ``{"ids", "samples", "values", "step", "total"}`` (``step`` None without finished
        trials; ``total``: how many trials have a value there). With ``limit``, at most that many
        trials: the ``best`` best ones at that step and a uniform sample of the others (the same
        trials on every call while none are added)."""
        eid, _, _, config_text, _, _ = self._experiment_row(name)
        objective = self.objective(_object(config_text, "")[0])
        metric = objective["metric"]
        step = self._rows(
            "SELECT MIN(last) FROM (SELECT MAX(m.step) AS last FROM metrics m JOIN trials t ON t.id = m.trial_id "
            "WHERE t.experiment_id = ? AND t.status IN ('completed', 'stopped') AND m.name = ? GROUP BY m.trial_id)",
            (eid, metric))[0][0]
        if step is None:
            return {"ids": [], "samples": [], "values": [], "step": None, "total": 0}
        at_step = ("FROM trials t JOIN metrics m ON m.trial_id = t.id AND m.name = ? AND m.step = ? WHERE "
                   "t.experiment_id = ? AND t.status IN ('completed', 'stopped') AND m.value IS NOT NULL")
        total = self._rows(f"SELECT COUNT(*) {at_step}", (metric, step, eid))[0][0]
        columns = f"SELECT t.id, t.sample, m.value {at_step}"
        if limit is None or total <= limit:
            rows = self._rows(columns, (metric, step, eid))
        else:
            best = max(0, min(int(best), int(limit)))
            direction = "DESC" if objective["mode"] == "max" else "ASC"
            chosen = {r[0]: r for r in self._rows(f"{columns} ORDER BY m.value {direction}, t.id LIMIT {best}",
                                                  (metric, step, eid))} if best else {}
            for row in self._rows(f"{columns} ORDER BY {_SCRAMBLED} LIMIT {int(limit)}", (metric, step, eid)):
                if len(chosen) >= limit:
                    break
                chosen.setdefault(row[0], row)
            rows = list(chosen.values())
        rows.sort()
        ids, samples, values = [], [], []
        for tid, sample, value in rows:
            if math.isfinite(value):
                ids.append(tid)
                samples.append(_object(sample, "")[0])
                values.append(value)
        return {"ids": ids, "samples": samples, "values": values, "step": step, "total": total}

    def finished_points(self, name: str, extra: str | None = None, limit: int | None = None,
                        best: int = 0) -> dict[str, Any]:
        """Samples and objective values of finished (completed or stopped) trials, as columns, for
        the hyperparameter views; ``extra`` also reads a second objective (``info[extra]`` or the
        last value of the metric ``extra``). With ``limit``, at most that many trials: the
        ``best`` best ones and a uniform sample of the others (the same trials on every call while
        none are added); ``total`` says how many there are, ``sampled`` whether some were left out."""
        eid, _, _, config_text, _, _ = self._experiment_row(name)
        finished = ("FROM trials t WHERE t.experiment_id = ? AND t.status IN ('completed', 'stopped') "
                    "AND t.metric IS NOT NULL")
        columns = "SELECT t.id, t.sample, t.metric, t.info, t.status"
        total = self._rows(f"SELECT COUNT(*) {finished}", (eid,))[0][0]
        if limit is None or total <= limit:
            rows = self._rows(f"{columns} {finished} ORDER BY t.id", (eid,))
        else:
            best = max(0, min(int(best), int(limit)))
            direction = "DESC" if self.objective(_object(config_text, "")[0])["mode"] == "max" else "ASC"
            chosen = {r[0]: r for r in self._rows(f"{columns} {finished} ORDER BY t.metric {direction}, t.id "
                                                  f"LIMIT {best}", (eid,))} if best else {}
            for row in self._rows(f"{columns} {finished} ORDER BY {_SCRAMBLED} LIMIT {int(limit)}", (eid,)):
                if len(chosen) >= limit:
                    break
                chosen.setdefault(row[0], row)
            rows = [chosen[tid] for tid in sorted(chosen)]
        numbers = self._numbers(eid, [r[0] for r in rows])
        second: dict[int, Any] = {}
        if extra:
            last = self._rows(
                "SELECT m.trial_id, m.value FROM metrics m JOIN trials t ON t.id = m.trial_id WHERE t.experiment_id = ? "
                "AND m.name = ? AND m.step = (SELECT MAX(step) FROM metrics m2 WHERE m2.trial_id = m.trial_id "
                "AND m2.name = m.name)", (eid, extra))
            second = {tid: v for tid, v in last}
        ids, numbers_out, samples, values, statuses, seconds = [], [], [], [], [], []
        for tid, sample, metric, info_text, status in rows:
            ids.append(tid)
            numbers_out.append(numbers.get(tid))
            samples.append(_object(sample, "")[0])
            values.append(_finite(metric))
            statuses.append(status)
            if extra:
                info = _object(info_text, "")[0]
                key = "latency_ms" if extra == "latency" else extra
                value = info.get(key, second.get(tid))
                seconds.append(_finite(float(value)) if isinstance(value, (int, float)) else None)
        return {"ids": ids, "numbers": numbers_out, "samples": samples, "values": values, "statuses": statuses,
                "second": seconds if extra else None, "total": total, "sampled": len(rows) < total}

    def objective_pairs(self, name: str, second: str) -> dict[str, Any]:
        """The two objectives of every finished (completed or stopped) trial with a value, as
        columns read in SQL (no sample, no Optuna): ``{"ids", "statuses", "values", "second"}``,
        by id. ``second`` is ``info[second]`` (``latency`` reads ``latency_ms``) or else the last
        value of the metric ``second``; None where neither is a number."""
        eid = self._experiment_row(name)[0]
        key = _json_path("latency_ms" if second == "latency" else second)
        rows = self._rows(
            "SELECT t.id, t.status, t.metric, COALESCE(json_extract(CASE WHEN json_valid(t.info) THEN t.info END, ?), "
            "(SELECT m.value FROM metrics m WHERE m.trial_id = t.id AND m.name = ? ORDER BY m.step DESC LIMIT 1)) "
            f"FROM trials t WHERE t.experiment_id = ? AND t.status IN {_COUNTED} AND t.metric IS NOT NULL ORDER BY t.id",
            (key, second, eid))
        return {"ids": [r[0] for r in rows], "statuses": [r[1] for r in rows], "values": [r[2] for r in rows],
                "second": [float(r[3]) if isinstance(r[3], (int, float)) else None for r in rows]}

    def numbers(self, name: str, ids: Sequence[int]) -> dict[int, int]:
        """Trial number (its place in the experiment, from 0) of each of ``ids``."""
        return self._numbers(self._experiment_row(name)[0], ids)

    def _numbers(self, eid: int, ids: Sequence[int]) -> dict[int, int]:
        """Trial number (its place in the experiment, from 0) of each of ``ids``."""
        if not ids:
            return {}
        every = [tid for (tid,) in self._rows("SELECT id FROM trials WHERE experiment_id = ? ORDER BY id", (eid,))]
        wanted = set(ids)
        return {tid: i for i, tid in enumerate(every) if tid in wanted}

    def plan(self, name: str, limit: int = 200) -> dict[str, Any]:
        """What the store records of how trials were trained together: per TrialGroup its members
        and their training seconds; the execution units (:meth:`units`: fused, shared pipeline,
        stage tree or separate, and the training seconds each saved where the store can tell); and
        per trial its relations: warm starts (parent, match score), inherited weights, PBT forks
        (``exploits``), duplicates and one-shot roles."""
        eid = self._experiment_row(name)[0]
        numbers = {tid: i for i, (tid,) in enumerate(self._rows(
            "SELECT id FROM trials WHERE experiment_id = ? ORDER BY id", (eid,)))}
        groups = []
        for group, count, seconds in self._rows(
                "SELECT group_id, COUNT(*), SUM(json_extract((CASE WHEN json_valid(info) THEN info END), '$.train_seconds')) FROM trials "
                "WHERE experiment_id = ? GROUP BY group_id ORDER BY group_id DESC LIMIT ?", (eid, limit)):
            groups.append({"group": group, "trials": count, "train_seconds": seconds})
        groups.reverse()
        relations = []
        for tid, parent, info_text in self._rows(
                "SELECT id, parent, info FROM trials WHERE experiment_id = ? AND (parent IS NOT NULL OR "
                "json_extract((CASE WHEN json_valid(info) THEN info END), '$.warm_start') IS NOT NULL OR json_extract((CASE WHEN json_valid(info) THEN info END), '$.duplicate_of') IS NOT NULL "
                "OR json_extract((CASE WHEN json_valid(info) THEN info END), '$.inherit') IS NOT NULL OR json_extract((CASE WHEN json_valid(info) THEN info END), '$.exploits') IS NOT NULL "
                "OR json_extract((CASE WHEN json_valid(info) THEN info END), '$.oneshot') IS NOT NULL) ORDER BY id DESC LIMIT ?", (eid, limit)):
            info = _object(info_text, "")[0]
            exploits = info.get("exploits") if isinstance(info.get("exploits"), list) else []
            duplicate = info.get("duplicate_of")
            relations.append({
                "trial": numbers.get(tid), "id": tid, "parent": numbers.get(parent) if parent is not None else None,
                "warm_start": info.get("warm_start"), "inherit": info.get("inherit"),
                "duplicate_of": numbers.get(duplicate) if isinstance(duplicate, int) else None,
                "unit": info.get("unit"), "oneshot": info.get("oneshot"),
                "exploits": [{"epoch": e.get("epoch"), "from": e.get("from_number")} for e in exploits
                             if isinstance(e, Mapping)],
            })
        relations.reverse()
        units_recorded = bool(self._rows("SELECT 1 FROM trials WHERE experiment_id = ? AND "
                                         "json_extract((CASE WHEN json_valid(info) THEN info END), '$.unit') IS NOT NULL LIMIT 1", (eid,)))
        total_seconds = self._rows("SELECT SUM(json_extract((CASE WHEN json_valid(info) THEN info END), '$.train_seconds')) FROM trials WHERE "
                                   "experiment_id = ?", (eid,))[0][0]
        units = self.units(eid, numbers, limit)
        saved = [u["saved_seconds"] for u in units if u["saved_seconds"] is not None]
        return {"groups": groups, "relations": relations, "units_recorded": units_recorded,
                "train_seconds": total_seconds, "units": units, "saved_seconds": sum(saved) if saved else None}

    def units(self, eid: int, numbers: Mapping[int, int], limit: int = 200) -> list[dict[str, Any]]:
        """The execution units the planner made (``info["unit"]``, as each trial records it), the
        latest ``limit``: kind, trials (numbers), what they shared, why, their training seconds and,
        where the store can tell, the training seconds the unit saved (``saved_seconds``).

        A stage tree's saving is estimated from the epochs it trained against the trial-epochs of
        its trials (each trial's stage path, ``info["stages"]``), at the unit's measured seconds per
        trained epoch; a fused group's as its training seconds times its measured speed-up less one
        (``unit["speedups"]``: what separate training would have cost more), when recorded; a
        separate unit's 0; otherwise None (not measured)."""
        rows = self._rows(
            "SELECT json_extract((CASE WHEN json_valid(info) THEN info END), '$.unit.trials'), MIN(id), COUNT(*), json_extract((CASE WHEN json_valid(info) THEN info END), '$.unit'), "
            "SUM(json_extract((CASE WHEN json_valid(info) THEN info END), '$.train_seconds')), json_group_object(id, json_extract((CASE WHEN json_valid(info) THEN info END), '$.train_seconds')), "
            "json_group_array(json_extract((CASE WHEN json_valid(info) THEN info END), '$.unit.speedups')) FROM trials "
            "WHERE experiment_id = ? AND json_extract((CASE WHEN json_valid(info) THEN info END), '$.unit') IS NOT NULL GROUP BY 1 ORDER BY 2 DESC LIMIT ?",
            (eid, limit))
        trees: dict[str, list[tuple[Any, int]]] = {}
        rows = [r for r in rows if isinstance(_loads(r[3]), dict)]   # a damaged unit record is left out
        if any(json.loads(r[3]).get("kind") == "stage tree" for r in rows):
            for key, stages, epochs in self._rows(
                    "SELECT json_extract((CASE WHEN json_valid(t.info) THEN t.info END), '$.unit.trials'), json_extract((CASE WHEN json_valid(t.info) THEN t.info END), '$.stages'), "
                    "(SELECT MAX(m.step) + 1 FROM metrics m WHERE m.trial_id = t.id) FROM trials t WHERE "
                    "t.experiment_id = ? AND json_extract((CASE WHEN json_valid(t.info) THEN t.info END), '$.unit.kind') = 'stage tree'", (eid,)):
                path = _loads(stages) if stages else []
                if isinstance(path, list) and all(isinstance(p, list) and len(p) == 3 and isinstance(p[2], int)
                                                  for p in path):
                    trees.setdefault(key, []).append((path, epochs or 0))
        out = []
        ids_of = {n: t for t, n in numbers.items()}
        for trials_json, _, count, unit_text, seconds, spent_json, speedups_json in reversed(rows):
            unit = json.loads(unit_text)
            members = _loads(trials_json) if trials_json is not None else []
            if not isinstance(members, list) or not isinstance(seconds, (int, float, type(None))):
                continue  # a damaged unit record
            # a unit recorded with "ids" names its trials by number; an older record by store id
            number = (lambda t: t) if "ids" in unit else numbers.get
            store_id = ids_of.get if "ids" in unit else (lambda t: t)
            trained, alone, saved = None, None, None
            if unit.get("kind") == "stage tree":
                trained, alone = _tree_epochs(trees.get(trials_json, []))
                if trained and seconds is not None:
                    saved = seconds * (alone - trained) / trained
            if unit.get("kind") == "separate":
                saved = 0.0  # trained as alone
            speedups = _speedups({"speedups": e} for e in json.loads(speedups_json) if isinstance(e, list))
            if speedups and unit.get("kind") != "stage tree":
                spent = {int(t): float(v) if isinstance(v, (int, float)) else 0.0
                         for t, v in json.loads(spent_json).items()}
                saved = sum(sum(spent.get(store_id(t), 0.0) for t in e["trials"]) * (e["speedup"] - 1.0)
                            for e in speedups if e["fused"])
            out.append({
                "kind": unit.get("kind"), "trials": [number(t) for t in members if isinstance(t, int)],
                "shared": unit.get("shared") or [], "reason": unit.get("reason"), "text": unit.get("text"),
                "batching": unit.get("batching"), "recorded": count,
                "speedups": [{**e, "trials": [number(t) for t in e["trials"]]} for e in speedups],
                "train_seconds": seconds, "epochs_trained": trained, "trial_epochs": alone,
                "saved_seconds": _finite(saved),
            })
        return out

    def stages(self, name: str, limit: int = 500) -> dict[str, Any]:
        """The stage tree the experiment's trials went through (stages it trained, and stages of
        other experiments it started from), parents before children, at most ``limit`` stages:
        ``{"stages": [{id, parent, label, epochs, steps, lr, batch_size, status, checkpoint,
        experiment, trials, error}], "total", "epochs_here", "epochs_reused"}``."""
        eid = self._experiment_row(name)[0]
        tables = {r[0] for r in self._rows("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "stages" not in tables:
            return {"stages": [], "total": 0, "epochs_here": 0, "epochs_reused": 0}
        numbers = {tid: i for i, (tid,) in enumerate(self._rows(
            "SELECT id FROM trials WHERE experiment_id = ? ORDER BY id", (eid,)))}
        chosen = ("SELECT DISTINCT st.stage_id FROM stage_trials st JOIN trials t ON t.id = st.trial_id "
                  "WHERE t.experiment_id = ?")
        total, here, reused = self._rows(
            f"SELECT COUNT(*), SUM(CASE WHEN experiment_id = ? THEN last_epoch - first_epoch ELSE 0 END), "
            f"SUM(CASE WHEN experiment_id IS NOT ? THEN last_epoch - first_epoch ELSE 0 END) FROM stages "
            f"WHERE id IN ({chosen})", (eid, eid, eid))[0]
        rows = self._rows(
            f"SELECT s.id, s.parent, s.label, s.first_epoch, s.last_epoch, s.first_step, s.last_step, s.hyperparameters, "
            f"s.status, s.checkpoint IS NOT NULL, e.name, s.error FROM stages s LEFT JOIN experiments e "
            f"ON e.id = s.experiment_id WHERE s.id IN ({chosen}) ORDER BY s.id LIMIT ?", (eid, limit))
        links: dict[int, list[int]] = {}
        for sid, tid in self._rows(f"SELECT stage_id, trial_id FROM stage_trials WHERE stage_id IN ({chosen}) "
                                   "ORDER BY trial_id", (eid,)):
            if tid in numbers:
                links.setdefault(sid, []).append(tid)
        paths = {tid: (_loads(text), epochs) for tid, text, epochs in self._rows(
            "SELECT t.id, json_extract((CASE WHEN json_valid(t.info) THEN t.info END), '$.stages'), (SELECT MAX(m.step) + 1 FROM metrics m WHERE m.trial_id = t.id) "
            "FROM trials t WHERE t.experiment_id = ? AND json_extract((CASE WHEN json_valid(t.info) THEN t.info END), '$.stages') IS NOT NULL", (eid,))}
        paths = {t: p for t, p in paths.items() if isinstance(p[0], list) and all(   # damaged paths left out
            isinstance(e, list) and len(e) == 3 and isinstance(e[2], int) for e in p[0])}
        stages = []
        for sid, parent, label, e0, e1, s0, s1, hp_text, status, has_checkpoint, experiment, error in rows:
            hp = _object(hp_text, "")[0]
            # the trials linked to the stage, less those whose own path went another way there
            went = [numbers[t] for t in links.get(sid, []) if t not in paths or _covers(*paths[t], label, e0, e1)]
            stages.append({"id": sid, "parent": parent, "label": label, "epochs": [e0, e1], "steps": [s0, s1],
                           "lr": [_finite(v) for v in hp["lr"]] if isinstance(hp.get("lr"), list) else [],
                           "batch_size": hp["batch_size"] if isinstance(hp.get("batch_size"), list) else [],
                           "status": status, "checkpoint": bool(has_checkpoint), "experiment": experiment,
                           "trials": went, "error": error})
        return {"stages": stages, "total": total, "epochs_here": here or 0, "epochs_reused": reused or 0}

    def oneshot(self, name: str) -> dict[str, Any]:
        """One-shot runs: the supernet trials' curves and the scored subnets (``info["oneshot"]``)."""
        eid = self._experiment_row(name)[0]
        rows = self._rows("SELECT id, sample, metric, info, status FROM trials WHERE experiment_id = ? AND "
                          "json_extract((CASE WHEN json_valid(info) THEN info END), '$.oneshot') IS NOT NULL ORDER BY id", (eid,))
        numbers = {tid: i for i, (tid,) in enumerate(self._rows(
            "SELECT id FROM trials WHERE experiment_id = ? ORDER BY id", (eid,)))}
        supernets: list[dict[str, Any]] = []
        subnets: list[dict[str, Any]] = []
        for tid, sample, metric, info_text, status in rows:
            one = _object(info_text, "")[0].get("oneshot")
            entry = {"id": tid, "number": numbers.get(tid), "status": status, "sample": _object(sample, "")[0],
                     "metric": _finite(metric), "oneshot": one}
            (supernets if isinstance(one, dict) and one.get("role") == "supernet" else subnets).append(entry)
        curves = self.curves([s["id"] for s in supernets])
        for s in supernets:
            s["metrics"] = curves.get(str(s["id"]), {}).get("metrics", {})
        return {"supernets": supernets, "subnets": subnets}

    def close(self) -> None:
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
