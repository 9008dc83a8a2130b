"""Measured fused-or-not speed-ups kept across processes, like cuDNN's benchmark cache: a group of
a model structure measured on this machine once is planned from that measurement in later runs,
with no timing steps (whose fixed cost is most of a short run's planning).

A decision is stored under a digest of what its speed depends on -- the model structure (graph
fingerprint and tensor shapes), the optimizer, loss, task, input batch shape and dtype, K, device
type, torch threads and the knobs the steps ran with -- and of the machine and software that measured it (CPU model, cores,
Python, torch and tridens versions), so a changed machine or upgrade measures again. SQLite from
the standard library: several processes (a process pool, Ray workers) may read and write at once.
Each key keeps its :data:`KEPT` latest measurements: the planner decides from their median and
measures again while they are few and near the bar (:func:`tridens.xopt._batching.settled_speedup`).
Beside each speed-up, one model's separate step time (key + :data:`SEPARATE_STEP`): what a fused
stack planned from the file compares its steps with once trials leave it.
Plain numbers only: nothing read from the file is ever run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sqlite3
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tridens")

__all__ = ["DecisionCache", "default_path", "stored_key", "KEPT", "SEPARATE_STEP"]

KEPT = 5
"""Measurements kept per key (the latest)."""
SEPARATE_STEP = "|separate step"
"""Suffix of the key under which one model's separate step (CPU s) is kept beside a speed-up."""


def default_path() -> Path:
    """``$XDG_CACHE_HOME/tridens/batching.sqlite`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tridens" / "batching.sqlite"


@lru_cache(maxsize=1)
def _machine() -> tuple[str, ...]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        version = metadata.version("tridens")
    except metadata.PackageNotFoundError:  # run from a source tree: the code itself identifies it
        version = hashlib.blake2b(Path(__file__).parent.joinpath("_batching.py").read_bytes(), digest_size=8).hexdigest()
    return (model, str(os.cpu_count()), platform.python_version(), torch.__version__, version)


def _name(value: Any) -> str:
    """A callable's (or its class's) qualified name: the same loss in every process."""
    target = value if callable(value) and hasattr(value, "__qualname__") else type(value)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def stored_key(skey: str, optimizer: str, batch: tuple[Any, ...], loss: Any, task: Any, x: torch.Tensor, k: int,
               device: torch.device, threads: int, options: tuple[Any, ...] = ()) -> str:
    """The digest a decision is stored under (see the module docstring); ``options``: the knobs
    the measured steps ran with (engine, memory format, how separate trainers step)."""
    parts = [skey, optimizer, repr(batch), _name(loss), repr(task), list(x.shape), str(x.dtype), k, device.type,
             threads, repr(options), list(_machine())]
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=20).hexdigest()


class DecisionCache:
    """The speed-ups measured on this machine, in the SQLite file at ``path``.

    >>> import tempfile, os
    >>> cache = DecisionCache(os.path.join(tempfile.mkdtemp(), "batching.sqlite"))
    >>> cache.put("abc", 2.5); cache.put("abc", 2.1); cache.get("abc")
    [2.5, 2.1]
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=10)
        db.execute("CREATE TABLE IF NOT EXISTS measurements (key TEXT NOT NULL, speedup REAL NOT NULL, "
                   "measured REAL NOT NULL)")
        db.execute("CREATE INDEX IF NOT EXISTS measurements_key ON measurements (key, measured)")
        return db

    def get(self, key: str) -> list[float]:
        """The stored speed-ups of ``key``, oldest first; [] when none (also when the file cannot
        be read: it is only a cache)."""
        try:
            db = self._connect()
            try:
                rows = db.execute("SELECT speedup FROM measurements WHERE key = ? ORDER BY measured, rowid",
                                  (key,)).fetchall()
            finally:
                db.close()
        except (OSError, sqlite3.Error) as err:
            log.debug("batching: decision cache %s not read: %s", self.path, err)
            return []
        return [float(v) for (v,) in rows if isinstance(v, (int, float))][-KEPT:]

    def put(self, key: str, speedup: float, *, replace: bool = False) -> None:
        """Add a measured speed-up (``replace``: instead of the stored ones), keeping the latest
        :data:`KEPT`; a file that cannot be written is skipped, logged at debug."""
        try:
            db = self._connect()
            try:
                with db:
                    if replace:
                        db.execute("DELETE FROM measurements WHERE key = ?", (key,))
                    db.execute("INSERT INTO measurements VALUES (?, ?, ?)", (key, float(speedup), time.time()))
                    db.execute("DELETE FROM measurements WHERE key = ? AND rowid NOT IN (SELECT rowid FROM "
                               "measurements WHERE key = ? ORDER BY measured DESC, rowid DESC LIMIT ?)",
                               (key, key, KEPT))
            finally:
                db.close()
        except (OSError, sqlite3.Error) as err:
            log.debug("batching: decision cache %s not written: %s", self.path, err)
