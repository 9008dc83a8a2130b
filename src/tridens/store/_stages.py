"""Stages of stage trees in the store: what was trained once for several trials, and its checkpoint.

A stage is a step range of one stage tree (trials of one model, seed and initial weights whose
hyperparameters agree over it). The store keeps, per stage: its parent, its epoch and step range,
its hyperparameters (the stage records of :func:`tridens.evaluators.stage_record`, summarized), the
metrics of every epoch up to its end, the trials that went through it, and a trainer checkpoint at
its end (``<db name>.files/.stages/<root>/<path>.pt``; loaded with ``weights_only=True``).
``root`` and ``path`` are digests: the initial state, and the stage records of every epoch up to the
end. A later run -- a resumed one, or another experiment in the same store on the same model,
seed and data -- finds the longest stored prefix of a trial's records and starts from its
checkpoint instead of training it again (:class:`StageArchive`).

**Cleanup** (:class:`StagePolicy`): a checkpoint that a live trial (pending, running or
interrupted: it may resume) went through is kept. Others are kept while the stage checkpoints
of the store total at most ``max_bytes``; beyond, the least recently used go first (their rows
stay, with ``checkpoint`` NULL: the tree is still shown, that stage is trained again if needed).
A stage that no trial uses any more (its experiment deleted) goes at once, row and checkpoint,
when a run starts and when it ends. Only files under ``<db name>.files/.stages/`` that no trial
checkpoint row names are ever deleted.

>>> import tempfile, os, torch
>>> from tridens.store import Store
>>> store = Store(os.path.join(tempfile.mkdtemp(), "t.db"))
>>> _ = store.create_experiment("a")
>>> archive = StageArchive(store, "a")
>>> sid = archive.save(root="r", path="p1", parent=None, label="1.0", epochs=(0, 1), steps=(0, 12),
...                    hyperparameters={"lr": [0.1, 0.1]}, history=[{"val_acc": 0.5}], state={"w": torch.ones(1)})
>>> hit = archive.longest("r", ["p1", "p2"])
>>> hit.epochs, hit.history, hit.state["w"].tolist()
(1, [{'val_acc': 0.5}], [1.0])
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..errors import StoreError
from ..trial import TrialStatus
from ._sqlite import Store

__all__ = ["StagePolicy", "StageArchive", "StageHit", "StageRecord", "StageCleanup", "stage_tree", "clean_stages"]

log = logging.getLogger("tridens")

_LIVE = (TrialStatus.PENDING.value, TrialStatus.RUNNING.value, TrialStatus.INTERRUPTED.value)


@dataclass(frozen=True)
class StagePolicy:
    """How an experiment shares stage checkpoints through its store.

    ``reuse``: ``"store"`` (the default) starts a trial from a stage trained by any experiment in
    the store (same model fingerprint, seed, initial weights, data and hyperparameters up to a step:
    the same computation, so the same metrics); ``"experiment"`` only from the experiment's own
    stages (a resumed run still skips what it trained before it was stopped). ``max_bytes``: the
    stage checkpoints of the store kept beyond those live trials need (see the module docstring);
    ``0`` keeps only those.

    >>> StagePolicy(reuse="experiment", max_bytes=2**28).reuse
    'experiment'
    """

    reuse: str = "store"
    max_bytes: int = 2**30

    def check(self) -> None:
        if self.reuse not in ("store", "experiment"):
            raise ValueError(f"The 'reuse' parameter of StagePolicy must be 'store' or 'experiment'. Got {self.reuse!r} instead.")
        if not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes < 0:
            raise ValueError(f"The 'max_bytes' parameter of StagePolicy must be an int in the range [0, inf). "
                             f"Got {self.max_bytes!r} instead.")


@dataclass
class StageHit:
    """A stored prefix found for a trial: ``epochs`` trained, the trainer ``state`` at its end, the
    metrics of each of those epochs, the stage's id and label, and the experiment that trained it."""

    epochs: int
    state: Any
    history: list[dict[str, float]]
    stage: int
    label: str
    experiment: str | None


@dataclass
class StageRecord:
    """One stored stage, as :func:`stage_tree` reads it back."""

    id: int
    parent: int | None
    label: str
    epochs: tuple[int, int]
    steps: tuple[int, int]
    hyperparameters: dict[str, Any]
    status: str
    checkpoint: str | None
    experiment: str | None
    trials: list[int] = field(default_factory=list)
    error: str | None = None


def _best_effort(default: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Stage storage is an optimization: a store error (a full disk, a locked file) is logged and
    the method returns ``default`` -- the stage is trained again if needed -- instead of failing
    the trials being trained."""
    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: "StageArchive", *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except StoreError as err:
                log.warning("stage store: %s failed (%s); training goes on without it", method.__name__, err)
                return default
        return run
    return wrap


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)   # JSON has no NaN/inf: kept as "nan", "inf"
    return value


def _history_json(history: Sequence[Mapping[str, float]]) -> str:
    return json.dumps([{k: _json_number(float(v)) for k, v in h.items()} for h in history], separators=(",", ":"))


def _history_from(text: str) -> list[dict[str, float]]:
    """The per-epoch metrics a stage row holds; :class:`StoreError` for a damaged row."""
    try:
        history = json.loads(text)
        return [{str(k): float(v) for k, v in h.items()} for h in history]
    except (TypeError, ValueError, AttributeError) as err:
        raise StoreError(f"its stored history is damaged ({type(err).__name__}: {err})") from err


def _hyperparameters_from(text: str) -> dict[str, Any]:
    """A stage row's hyperparameters, or {} for a damaged row (the tree is shown without them)."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class StageArchive:
    """The stages of one store, as an experiment (``experiment``) trains and reuses them under
    ``policy`` (a :class:`StagePolicy`). Stage trees call :meth:`longest` before training a trial,
    :meth:`save` at each stage's end, :meth:`fail` for a branch that raised, :meth:`link` for trials
    that start from a stored stage; the engine calls :meth:`collect` (cleanup) at the end of a run.
    """

    def __init__(self, store: Store, experiment: str, policy: StagePolicy | None = None):
        self.store = store
        self.experiment = experiment
        self.policy = StagePolicy() if policy is None else policy
        self.policy.check()
        self.reused: list[StageHit] = []   # what this run started from (the log says so)

    def __getstate__(self) -> dict[str, Any]:
        return {"store": self.store, "experiment": self.experiment, "policy": self.policy, "reused": []}

    def _experiment_id(self) -> int:
        return self.store._experiment_id(self.experiment)

    # -- finding ------------------------------------------------------------------------------------
    @_best_effort(False)
    def has_root(self, root: str) -> bool:
        """Whether any stage with a checkpoint starts from ``root`` (reusable under the policy)."""
        mine = "" if self.policy.reuse == "store" else " AND experiment_id = ?"
        args: list[Any] = [root] + ([] if self.policy.reuse == "store" else [self._experiment_id()])
        with self.store._reading("finding stored stages") as conn:
            return conn.execute(f"SELECT 1 FROM stages WHERE root = ? AND status = 'done' AND checkpoint IS NOT NULL"
                                f"{mine} LIMIT 1", args).fetchone() is not None

    @_best_effort(0)
    def deepest(self, root: str, paths: Sequence[str]) -> int:
        """How many epochs of ``paths`` (``paths[e]``: the digest of epochs ``0..e``) a stored
        stage with a checkpoint covers (0: none); reads rows only."""
        if not paths:
            return 0
        index = {p: e for e, p in enumerate(paths)}
        marks = ",".join("?" * len(paths))
        mine = "" if self.policy.reuse == "store" else " AND experiment_id = ?"
        args: list[Any] = [root, *paths] + ([] if self.policy.reuse == "store" else [self._experiment_id()])
        with self.store._reading("finding stored stages") as conn:
            rows = conn.execute(f"SELECT path FROM stages WHERE root = ? AND path IN ({marks}) AND status = 'done' "
                                f"AND checkpoint IS NOT NULL{mine}", args).fetchall()
        return max((index[r[0]] + 1 for r in rows), default=0)

    @_best_effort(None)
    def load(self, root: str, path: str, epochs: int) -> StageHit | None:
        """The stored stage ending at ``path`` (``epochs`` long) with its checkpoint loaded; ``None``
        when its file is gone or damaged (then it is trained again)."""
        with self.store._reading("reading a stored stage") as conn:
            row = conn.execute("SELECT s.id, s.label, s.history, s.checkpoint, e.name FROM stages s LEFT JOIN "
                               "experiments e ON e.id = s.experiment_id WHERE s.root = ? AND s.path = ? AND "
                               "s.checkpoint IS NOT NULL", (root, path)).fetchone()
        if row is None:
            return None
        sid, label, history, checkpoint, experiment = row
        try:  # a damaged row or file counts as absent: the stage is trained again
            metrics = _history_from(history)
            if len(metrics) != epochs:
                raise StoreError(f"its stored history holds {len(metrics)} epochs, not {epochs}")
            state = self.store.load_checkpoint(checkpoint)
        except StoreError as err:
            log.warning("stage %s: %s; it is trained again", label, err)
            return None
        with self.store._writing("marking a stage used", single=True) as conn:
            conn.execute("UPDATE stages SET used_at = ? WHERE id = ?", (time.time(), sid))
        hit = StageHit(epochs, state, metrics, sid, label, experiment)
        self.reused.append(hit)
        return hit

    def longest(self, root: str, paths: Sequence[str]) -> StageHit | None:
        """The stored stage with a checkpoint whose path is the longest of ``paths``, loaded."""
        epochs = self.deepest(root, paths)
        while epochs > 0:
            hit = self.load(root, paths[epochs - 1], epochs)
            if hit is not None:
                return hit
            epochs = self.deepest(root, paths[:epochs - 1])
        return None

    # -- writing ------------------------------------------------------------------------------------
    @_best_effort(None)
    def save(self, *, root: str, path: str, parent: int | None, label: str, epochs: tuple[int, int],
             steps: tuple[int, int], hyperparameters: Mapping[str, Any], history: Sequence[Mapping[str, float]],
             state: Any, trials: Sequence[int] = ()) -> int | None:
        """Record a finished stage with its end-of-stage trainer ``state`` (the file first, then the
        row); returns its id (None when the store could not take it). A stage stored already (a
        resumed run, another unit or process) keeps its row and file, and gains ``trials``."""
        existing = self._find(root, path)
        if existing is not None and existing[1] is not None:
            self.link(existing[0], trials)
            return existing[0]
        rel = f".stages/{root[:16]}/{path[:32]}.pt"
        final = self.store._write_checkpoint_file(-1, rel, state)
        size = final.stat().st_size
        now, eid = time.time(), self._experiment_id()
        with self.store._writing(f"recording stage {label}") as conn:
            if existing is None:
                conn.execute(   # OR IGNORE: another process may have stored it meanwhile
                    "INSERT OR IGNORE INTO stages (root, path, parent, experiment_id, label, first_epoch, last_epoch, first_step, "
                    "last_step, hyperparameters, history, status, checkpoint, bytes, created_at, used_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'done', ?, ?, ?, ?)",
                    (root, path, parent, eid, label, epochs[0], epochs[1], steps[0], steps[1],
                     self.store._json(dict(hyperparameters), f"the hyperparameters of stage {label}"),
                     _history_json(history), rel, size, now, now))
                sid = int(conn.execute("SELECT id FROM stages WHERE root = ? AND path = ?", (root, path)).fetchone()[0])
            else:   # its checkpoint was cleaned up: stored again
                sid = existing[0]
                conn.execute("UPDATE stages SET checkpoint = ?, bytes = ?, status = 'done', used_at = ? WHERE id = ?",
                             (rel, size, now, sid))
            conn.executemany("INSERT OR IGNORE INTO stage_trials (stage_id, trial_id) VALUES (?, ?)",
                             [(sid, t) for t in trials])
        return sid

    @_best_effort(None)
    def fail(self, *, root: str, path: str, parent: int | None, label: str, epochs: tuple[int, int],
             steps: tuple[int, int], hyperparameters: Mapping[str, Any], error: str, trials: Sequence[int] = ()) -> int | None:
        """Record a stage whose training raised (a NaN loss, an error): no checkpoint, never reused."""
        now, eid = time.time(), self._experiment_id()
        with self.store._writing(f"recording failed stage {label}") as conn:
            conn.execute(
                "INSERT OR IGNORE INTO stages (root, path, parent, experiment_id, label, first_epoch, last_epoch, first_step, "
                "last_step, hyperparameters, history, status, checkpoint, error, created_at, used_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '[]', 'failed', NULL, ?, ?, ?)",
                (root, path, parent, eid, label, epochs[0], epochs[1], steps[0], steps[1],
                 self.store._json(dict(hyperparameters), f"the hyperparameters of stage {label}"), error, now, now))
            sid = conn.execute("SELECT id FROM stages WHERE root = ? AND path = ?", (root, path)).fetchone()[0]
            conn.executemany("INSERT OR IGNORE INTO stage_trials (stage_id, trial_id) VALUES (?, ?)",
                             [(sid, t) for t in trials])
        return int(sid)

    @_best_effort(None)
    def link(self, stage: int, trials: Sequence[int]) -> None:
        """Record that ``trials`` went through ``stage`` and every stage above it."""
        if not trials:
            return
        with self.store._writing("recording the trials of a stage") as conn:
            chain: list[int] = []
            current: int | None = stage
            while current is not None and current not in chain:
                chain.append(current)
                row = conn.execute("SELECT parent FROM stages WHERE id = ?", (current,)).fetchone()
                current = None if row is None else row[0]
            conn.executemany("INSERT OR IGNORE INTO stage_trials (stage_id, trial_id) VALUES (?, ?)",
                             [(s, t) for s in chain for t in trials])

    def _find(self, root: str, path: str) -> tuple[int, str | None] | None:
        with self.store._reading("finding a stage") as conn:
            row = conn.execute("SELECT id, checkpoint FROM stages WHERE root = ? AND path = ?", (root, path)).fetchone()
        return None if row is None else (int(row[0]), row[1])

    # -- cleanup ------------------------------------------------------------------------------------
    @_best_effort(0)
    def remove_orphans(self) -> int:
        """Remove the stages no trial went through any more (their trials are gone: a deleted
        experiment's), rows and checkpoints; returns how many. A stage any trial links to, live
        or finished, is kept: the trials of a stage and its rows are written in one transaction,
        so a stage being stored by a running experiment is never an orphan. The engine calls it
        when a run starts (a resume included) and after its cleanup at the end."""
        with self.store._reading("finding orphan stages") as conn:
            rows = conn.execute(f"SELECT id, checkpoint {_orphans_sql()} AND checkpoint IS NOT NULL").fetchall()
        if rows:   # their checkpoints first, through the one rule that deletes stage files
            self._delete_files(rows)
        with self.store._writing("removing orphan stages", single=True) as conn:
            removed = conn.execute(f"DELETE {_orphans_sql()} AND checkpoint IS NULL").rowcount
        if removed:
            log.info("stage store: %d stage(s) no trial uses any more removed", removed)
        return int(removed)

    def _delete_files(self, rows: Sequence[tuple[int, str]]) -> int:
        """Set the stages' checkpoints to NULL and delete their files, only files under
        ``<db>.files/.stages/`` that no trial checkpoint row names (a damaged or crafted stage row
        may name any file); returns the bytes freed."""
        is_stage_file = _stage_files(self.store)
        freed = 0
        for sid, rel in rows:
            with self.store._writing("cleaning up a stage checkpoint", single=True) as conn:
                conn.execute("UPDATE stages SET checkpoint = NULL, bytes = 0 WHERE id = ?", (sid,))
            path = (self.store.files_dir / str(rel)).resolve()
            if not is_stage_file(path):
                log.warning("stage row %s names %s, which is not a stage checkpoint; the file is kept", sid, rel)
                continue
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                pass
        return freed

    @_best_effort(0)
    def collect(self) -> int:
        """Remove the stage checkpoints the policy does not keep (see the module docstring);
        returns the bytes freed."""
        return clean_stages(self.store, self.policy.max_bytes).freed


@dataclass
class StageCleanup:
    """What :func:`clean_stages` removes (or, in a dry run, would remove): per checkpoint
    ``(stage id, label, experiment that trained it, path under <db>.files/, bytes, why)``, the
    stage rows no trial uses any more (``orphans``, their checkpoints among ``removed``), the bytes
    freed and the bytes kept."""

    removed: list[tuple[int, str, str | None, str, int, str]] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """``(stage id, path)`` of rows whose checkpoint is not a file under ``<db>.files/.stages/``
    (a damaged or crafted row, or one naming a trial's checkpoint): neither listed nor removed."""
    orphans: int = 0
    freed: int = 0
    kept: int = 0
    dry_run: bool = False


def clean_stages(store: Store, max_bytes: int = 0, *, dry_run: bool = False) -> StageCleanup:
    """Remove the store's stage checkpoints beyond what live trials need: a checkpoint a pending,
    running or interrupted trial went through is kept (it may resume from it); the others are
    kept, most recently used first, while they total at most ``max_bytes``; stages no trial uses
    any more (a deleted experiment's) go, rows and checkpoints. With ``dry_run``, nothing is
    removed: the result lists what would go. ``tridens clean-stages`` calls it; runs call it
    (:meth:`StageArchive.collect`) with their :class:`StagePolicy`'s ``max_bytes``.

    >>> clean_stages(Store("tridens.db"), dry_run=True).removed      # doctest: +SKIP
    [(3, '1.0', 'search', '.stages/ab/cd.pt', 52311, 'no live trial needs it')]
    """
    with store._reading("listing stage checkpoints") as conn:
        rows = conn.execute(
            "SELECT s.id, s.checkpoint, s.bytes, s.used_at, "
            f"EXISTS (SELECT 1 FROM stage_trials st JOIN trials t ON t.id = st.trial_id WHERE st.stage_id = s.id "
            f"AND t.status IN ({','.join('?' * len(_LIVE))})), "
            "EXISTS (SELECT 1 FROM stage_trials st WHERE st.stage_id = s.id), s.label, e.name "
            "FROM stages s LEFT JOIN experiments e ON e.id = s.experiment_id WHERE s.checkpoint IS NOT NULL "
            "ORDER BY s.id", _LIVE).fetchall()
        orphans = conn.execute(f"SELECT COUNT(*) {_orphans_sql()}").fetchone()[0]
    is_stage_file = _stage_files(store)
    skipped = [r for r in rows if not is_stage_file((store.files_dir / str(r[1])).resolve())]
    skipped_ids = {r[0] for r in skipped}
    rows = [r for r in rows if r[0] not in skipped_ids]
    drop = [(r, "no trial uses it any more") for r in rows if not r[5]]
    kept = sorted((r for r in rows if r[5] and not r[4]), key=lambda r: -r[3])   # newest use first
    total = sum(r[2] for r in rows if r[4])                  # pinned by live trials: always kept
    for r in kept:
        if total + r[2] <= max_bytes:
            total += r[2]
        else:
            drop.append((r, "no live trial needs it" + (f", beyond the {max_bytes / 2**20:.0f} MiB kept" if max_bytes else "")))
    drop.sort(key=lambda item: item[0][0])
    result = StageCleanup(removed=[(r[0], r[6], r[7], str(r[1]), int(r[2]), why) for r, why in drop],
                          skipped=[(r[0], str(r[1])) for r in skipped], orphans=int(orphans), kept=total,
                          dry_run=dry_run)
    if dry_run:
        result.freed = sum(r[2] for r, _ in drop)
        return result
    archive = StageArchive(store, "")
    result.freed = archive._delete_files([(r[0], r[1]) for r, _ in drop])
    archive.remove_orphans()
    if drop:
        log.info("stage checkpoints: %d removed (%.1f MiB); %.1f MiB kept (live trials' stages, then the "
                 "most recently used up to %.0f MiB)", len(drop), result.freed / 2**20, total / 2**20,
                 max_bytes / 2**20)
    return result


def _stage_files(store: Store) -> Callable[[Path], bool]:
    """Whether a resolved path is a stage checkpoint: a file under ``<db>.files/.stages/`` that no
    trial checkpoint row names. The only files stage cleanup lists or deletes."""
    stages_dir = (store.files_dir / ".stages").resolve()
    with store._reading("listing trial checkpoints") as conn:
        trial_files = {(store.files_dir / rel).resolve() for (rel,) in conn.execute("SELECT path FROM checkpoints")}
    return lambda path: path.is_relative_to(stages_dir) and path != stages_dir and path not in trial_files


def _orphans_sql() -> str:
    return "FROM stages WHERE NOT EXISTS (SELECT 1 FROM stage_trials st WHERE st.stage_id = stages.id)"


def stage_tree(store: Store, experiment: str) -> list[StageRecord]:
    """The stages the trials of ``experiment`` went through (trained by it or reused from
    another experiment), parents before children.

    >>> [s.label for s in stage_tree(store, "search")]          # doctest: +SKIP
    ['3.0', '3.1', '3.2']
    """
    eid = store._experiment_id(experiment)
    with store._reading(f"reading the stages of experiment {experiment!r}") as conn:
        rows = conn.execute(
            "SELECT DISTINCT s.id, s.parent, s.label, s.first_epoch, s.last_epoch, s.first_step, s.last_step, "
            "s.hyperparameters, s.status, s.checkpoint, e.name, s.error FROM stages s "
            "JOIN stage_trials st ON st.stage_id = s.id JOIN trials t ON t.id = st.trial_id "
            "LEFT JOIN experiments e ON e.id = s.experiment_id WHERE t.experiment_id = ? ORDER BY s.id", (eid,)).fetchall()
        links = conn.execute(
            "SELECT st.stage_id, st.trial_id FROM stage_trials st JOIN trials t ON t.id = st.trial_id "
            "WHERE t.experiment_id = ? ORDER BY st.trial_id", (eid,)).fetchall()
    records = {r[0]: StageRecord(id=r[0], parent=r[1], label=r[2], epochs=(r[3], r[4]), steps=(r[5], r[6]),
                                 hyperparameters=_hyperparameters_from(r[7]), status=r[8], checkpoint=r[9], experiment=r[10],
                                 error=r[11]) for r in rows}
    for sid, tid in links:
        if sid in records:
            records[sid].trials.append(tid)
    return list(records.values())

