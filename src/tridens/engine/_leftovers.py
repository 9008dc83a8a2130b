"""What a run leaves behind when its driver stops abnormally, settled on the next open.

A run records its driver (:func:`claim`: process id, host, process start time, and a lease: an
empty file beside the store that the driver removes when it stops, :func:`release`) in the
experiment's config. A driver that stops cleanly -- done, Ctrl-C, SIGTERM -- marks its trials
still running ``interrupted`` (:func:`mark_interrupted`). One that was killed, or could not write
(a full disk), leaves the experiment and its trials ``running``: :func:`mark_abandoned` finds such
an experiment whose driver is gone and marks it ``interrupted``, charging each trial that was
running one death -- unless the driver's lease is gone: it stopped through its own clean-up and
only the writing failed (removing a file needs no space), a storage fault and no crash. A trial
that was running when its process died :data:`MAX_DEATHS` times (it kills its process:
``os._exit``, a crash in native code, memory) is failed on the next resume
(:func:`fail_repeated_deaths`) instead of being run again, so a resume always makes progress.

>>> MAX_DEATHS
2
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from ..store import Store, StoreError
from ..trial import Trial, TrialStatus

__all__ = ["MAX_DEATHS", "FINISHED_COUNTED", "claim", "release", "mark_interrupted", "interrupted_text", "find_abandoned", "mark_abandoned",
           "fail_repeated_deaths", "failure_settled", "driver_alive"]

log = logging.getLogger("tridens")

#: The statuses that count toward ``max_trials`` (a trial that ended, whichever way).
FINISHED_COUNTED = (TrialStatus.COMPLETED, TrialStatus.STOPPED, TrialStatus.FAILED)

MAX_DEATHS = 2
"""Deaths of its process while a trial ran after which the trial fails instead of running again."""


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux ``/proc``; None elsewhere or when it is gone): with
    the pid it names a process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _driver() -> dict[str, Any]:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "start": _start_time(pid)}


def driver_alive(driver: Any) -> bool | None:
    """Whether the recorded ``driver`` still runs: None when that cannot be known here (no record,
    another host)."""
    if not isinstance(driver, dict) or driver.get("host") != socket.gethostname():
        return None
    pid = driver.get("pid")
    # A damaged record (a pid of 2**70, 0 or -1: os.kill would overflow, or ask about a group) tells nothing.
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 22:
        return None
    start = _start_time(pid)
    if start is not None:
        return driver.get("start") in (None, start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not os.path.exists("/proc/self/stat")  # /proc exists but not this pid: gone


def _lease_path(db: Store, name: str, lease: Any) -> Path | None:
    """Where the driver lease ``lease`` (a token) of experiment ``name`` lives; None for a damaged token."""
    if not isinstance(lease, str) or not re.fullmatch(r"[0-9a-f]{32}", lease):
        return None
    return db.files_dir / name / f".driver-{lease}"


def claim(db: Store, name: str) -> str | None:
    """This process runs experiment ``name`` from now on: leftovers of an earlier driver are
    settled (:func:`mark_abandoned`), then the experiment is ``running`` with this driver and its
    lease recorded. Returns the lease for :func:`release` (None: no lease file could be made; a
    stop that cannot write then counts as a crash)."""
    mark_abandoned(db, name, unknown_is_gone=True)
    driver: dict[str, Any] = _driver()
    lease: str | None = uuid.uuid4().hex
    path = _lease_path(db, name, lease)
    try:
        assert path is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        driver["lease"] = lease
    except OSError as err:
        log.info("%s: no driver lease (%s); a stop that cannot write its trials counts as a crash", name, err)
        lease = None
    record = db.get_experiment(name)
    db.update_experiment(name, status="running", config={**record.config, "driver": driver})
    return lease


def release(db: Store, name: str, lease: str | None) -> None:
    """The driver of ``name`` stops through its clean-up (done, an error, Ctrl-C, SIGTERM, a
    storage fault): its lease is removed, which needs no disk space, so trials it could not mark
    ``interrupted`` are not charged a death on the next open (see :func:`mark_abandoned`)."""
    path = _lease_path(db, name, lease)
    if path is not None:
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("%s: its driver lease %s could not be removed (%s)", name, path, err)


def mark_interrupted(db: Store, name: str, *, quiet: bool = False) -> None:
    """A clean stop (Ctrl-C, an error): the experiment and its trials still running are
    ``interrupted``, no death charged. Best effort: a store that cannot be written (full disk) is
    settled on the next open instead (said in the log unless ``quiet``: the run's own line says why)."""
    try:
        with db.transaction():
            for trial in db.trials(name, status=TrialStatus.RUNNING):
                trial.status = TrialStatus.INTERRUPTED
                db.update_trial(trial)
            db.update_experiment(name, status="interrupted")
    except StoreError as err:
        if not quiet:
            log.warning("%s could not be marked interrupted (%s); the next open of the store does it", name, err)


def interrupted_text(db: Store, name: str, store: Path) -> str:
    """The one line Ctrl-C prints (a multi-trial or a one-shot run): what was kept and the command
    that finishes the experiment ``name`` of the store at ``store``."""
    import shlex

    done = sum(t.status in FINISHED_COUNTED for t in db.trials(name))
    script = db.get_experiment(name).config.get("script")
    if not isinstance(script, str):  # no script to re-run (python -c, a notebook)
        how = "run the same experiment again (same name and store)"
    else:  # `tridens resume` re-runs the script only once it is named (a store may come from someone else)
        how = (f"tridens resume {shlex.quote(name)} --db {shlex.quote(str(store))} --script "
               f"{shlex.quote(script)} (or run the script again)")
    return f"{name!r} interrupted with {done} finished trials kept in {store}; finish it with: {how}"


def find_abandoned(db: Store) -> list[str]:
    """The experiments left ``running`` by a driver that is gone (checked on this host); reading
    only, so a read-only store can say whether it needs :func:`mark_abandoned`."""
    return [r.name for r in db.experiments(damaged=[])   # a damaged row is named by the reader that shows it
            if r.status == "running" and driver_alive(r.config.get("driver")) is False]


def mark_abandoned(db: Store, name: str | None = None, *, unknown_is_gone: bool = False) -> list[str]:
    """Experiments left ``running`` by a driver that is gone (``name`` only, or all): marked
    ``interrupted``, and each trial still running is charged one death and marked ``interrupted``.
    A driver that cannot be checked (another host, no record) counts as gone only with
    ``unknown_is_gone`` (the caller is about to run the experiment itself). Returns the names marked.

    >>> import tempfile, pathlib
    >>> from tridens.store import Store
    >>> with tempfile.TemporaryDirectory() as folder, Store(pathlib.Path(folder) / "s.db") as db:
    ...     mark_abandoned(db)
    []
    """
    marked = []
    records = db.experiments(damaged=[]) if name is None else [db.get_experiment(name)]
    for record in records:
        running = db.trials(record.name, status=TrialStatus.RUNNING, damaged=[] if name is None else None)
        if record.status != "running":
            if running:  # stopped, but its trials could not be marked: no death to charge
                _settle(db, record.name, running, death=False, experiment=False)
            continue
        driver = record.config.get("driver")
        known = driver_alive(driver)
        if unknown_is_gone and known and driver is not None and driver.get("pid") == os.getpid():
            known = False  # an earlier run of this very process that ended without settling
        if known is True or (known is None and not unknown_is_gone):
            continue
        lease = _lease_path(db, record.name, driver.get("lease")) if isinstance(driver, dict) else None
        # killed: its lease is still there; stopped through its clean-up but unable to write: removed
        crashed = lease is None or lease.exists()
        _settle(db, record.name, running, death=crashed, experiment=True)
        if lease is not None and crashed:
            try:
                lease.unlink(missing_ok=True)
            except OSError:   # a folder this process cannot write: the stale lease names no driver
                pass
        log.info("%s: its driver is gone%s; marked interrupted (%d trial(s) were running)", record.name,
                 "" if crashed else " (it stopped on a storage fault)", len(running))
        marked.append(record.name)
    return marked


def _settle(db: Store, name: str, running: Sequence[Trial], *, death: bool, experiment: bool) -> None:
    with db.transaction():
        for trial in running:
            if death:
                trial.info["deaths"] = int(trial.info.get("deaths", 0)) + 1
            trial.status = TrialStatus.INTERRUPTED
            db.update_trial(trial)
        if experiment:
            db.update_experiment(name, status="interrupted")


def failure_settled(trial: Trial) -> bool:
    """Whether a failed trial's failure is an outcome of its sample rather than an accident of its
    run: a constraint it violates, or a process it killed :data:`MAX_DEATHS` times. Such a trial
    counts toward ``max_trials`` on every run and is never retried; other failures (an error in
    the loop, NaN, a timeout) are retried by a resumed run (``td.RunOptions(retry_failed=True)``)."""
    return (trial.error or "").startswith("constraint violated") or int(trial.info.get("deaths", 0)) >= MAX_DEATHS


def fail_repeated_deaths(db: Store, trials: Sequence[Trial]) -> None:
    """Fail (in the store and in ``trials``) each unfinished trial whose process died while it ran
    :data:`MAX_DEATHS` times: it would kill the run again."""
    for trial in trials:
        deaths = int(trial.info.get("deaths", 0))
        if trial.status.finished or deaths < MAX_DEATHS:
            continue
        trial.status = TrialStatus.FAILED
        trial.error = (f"trial {trial.label} was running each time its process died ({deaths} times: killed, out of "
                       "memory, os._exit or a crash in native code); it is not run again")
        trial.finished_at = time.time()
        db.finish_trial(trial, None)
        log.warning("%s", trial.error)
