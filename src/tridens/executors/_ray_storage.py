"""Where the Ray executor keeps checkpoints: files under one root that every worker sees, a local
directory or (with fsspec) a remote location such as ``s3://bucket/runs``.

Layout (``<root>`` is the executor's ``storage``)::

    <root>/<experiment>/trial-<id>/epoch-<n>.pt   the latest per-epoch trainer checkpoint (step-wise evaluators)
    <root>/<experiment>/trial-<id>/final.pt       the final (or stopped) weights
    <root>/<experiment>/handoff/<uuid>.pt         a state on its way between a task and the driver

A trial's folder is removed once the driver has its outcome (its weights are then in the store),
the hand-offs once its group ends, and the experiment's whole folder when a run of it starts:
a resumed trial trains again from its start, so nothing an earlier (crashed) run left is read.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from typing import Any, Mapping

import torch

__all__ = ["CheckpointStorage", "is_uri"]


def is_uri(location: str) -> bool:
    """``s3://...``, ``gs://...``, ``memory://...``: a location for fsspec, not a local path."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", location) is not None and not location.startswith("file://")


class CheckpointStorage:
    """Checkpoint files under one root, local or (with fsspec) remote. Writes are atomic: a file
    is written under a temporary name and renamed, so a worker killed mid-write leaves no torn file.

    >>> import tempfile
    >>> storage = CheckpointStorage(tempfile.mkdtemp())
    >>> storage.save(storage.join("exp", "trial-1", "epoch-1.pt"), {"step": 0})
    >>> storage.latest_epoch(storage.join("exp", "trial-1"))
    1
    """

    def __init__(self, root: str):
        self.root = root[len("file://"):] if root.startswith("file://") else root
        self.remote = is_uri(self.root)

    def _fs(self) -> Any:
        import fsspec

        return fsspec.core.url_to_fs(self.root)[0]

    def join(self, *parts: str) -> str:
        """A location under ``root``."""
        return "/".join([self.root.rstrip("/"), *parts]) if self.remote else os.path.join(self.root, *parts)

    def trial_directory(self, experiment: str, trial_id: int) -> str:
        """Where one trial's checkpoints go: ``<root>/<experiment>/trial-<id>``."""
        return self.join(experiment, f"trial-{trial_id}")

    def child(self, directory: str, name: str) -> str:
        return f"{directory.rstrip('/')}/{name}" if self.remote else os.path.join(directory, name)

    def save(self, path: str, obj: Any) -> None:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        tmp = f"{path}.tmp-{os.getpid()}"
        if self.remote:
            fs = self._fs()
            fs.pipe(tmp, buffer.getvalue())
            fs.mv(tmp, path)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(buffer.getvalue())
        os.replace(tmp, path)

    def load(self, path: str) -> Any:
        if self.remote:
            data = self._fs().cat_file(path)
        else:
            with open(path, "rb") as f:
                data = f.read()
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    def listdir(self, directory: str) -> list[str]:
        if self.remote:
            fs = self._fs()
            return [p.rsplit("/", 1)[-1] for p in fs.ls(directory, detail=False)] if fs.exists(directory) else []
        return os.listdir(directory) if os.path.isdir(directory) else []

    def remove(self, path: str) -> None:
        try:
            if self.remote:
                self._fs().rm(path)
            else:
                os.remove(path)
        except FileNotFoundError:
            pass

    def prune(self, path: str) -> None:
        """Remove the folders above ``path`` that are empty, up to and including ``root`` (a
        remote store has no empty folders to remove)."""
        if self.remote:
            return
        root = os.path.abspath(self.root)
        folder = os.path.dirname(os.path.abspath(path))
        while folder.startswith(root):
            try:
                os.rmdir(folder)
            except OSError:  # not empty (or already gone)
                if os.path.isdir(folder):
                    return
            if folder == root:
                return
            folder = os.path.dirname(folder)

    def latest_epoch(self, directory: str) -> int | None:
        epochs = [int(m.group(1)) for name in self.listdir(directory) if (m := re.fullmatch(r"epoch-(\d+)\.pt", name))]
        return max(epochs) if epochs else None

    def save_round(self, directory: str, step: int, metrics: Mapping[str, float], state: Any,
                   sample: Mapping[str, Any] | None = None) -> None:
        """A member's trainer ``state`` after ``step`` (epoch ``step + 1``) with that step's
        ``metrics`` and the ``sample`` it trains with (a fork's, PBT), in ``directory``; the
        member's previous round is removed."""
        self.save(self.child(directory, f"epoch-{step + 1}.pt"),
                  {"trainer": state, "step": step, "metrics": dict(metrics), "sample": None if sample is None else dict(sample)})
        if step > 0:
            self.remove(self.child(directory, f"epoch-{step}.pt"))

    def last_round(self, directory: str) -> dict[str, Any] | None:
        """What :meth:`save_round` wrote last in ``directory`` (None: nothing yet)."""
        epoch = self.latest_epoch(directory)
        return None if epoch is None else self.load(self.child(directory, f"epoch-{epoch}.pt"))

    def round_of(self, directory: str, step: int) -> Any:
        """The trainer state :meth:`save_round` wrote for ``step`` (raises OSError when it is not there)."""
        return self.load(self.child(directory, f"epoch-{step + 1}.pt"))["trainer"]

    def hand(self, experiment: str, state: Any) -> str:
        """Write ``state`` for another process to :meth:`take` (a stage checkpoint on its way
        between a Ray task and the driver); returns its location."""
        import uuid

        path = self.join(experiment, "handoff", f"{uuid.uuid4().hex}.pt")
        self.save(path, state)
        return path

    def take(self, path: str) -> Any:
        """What :meth:`hand` wrote at ``path``, which is then removed."""
        try:
            return self.load(path)
        finally:
            self.remove(path)

    def clear(self, directory: str) -> None:
        for name in self.listdir(directory):
            self.remove(self.child(directory, name))

    def discard(self, directory: str) -> None:
        """Remove ``directory`` and everything under it (nothing if it does not exist)."""
        if self.remote:
            fs = self._fs()
            if fs.exists(directory):
                fs.rm(directory, recursive=True)
            return
        shutil.rmtree(directory, ignore_errors=True)
