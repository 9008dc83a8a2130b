"""Stage storage for stage trees trained outside the driver (pool workers, Ray unit tasks).

The store is SQLite with one writer: the driver. A worker's stage tree reads and writes stages
through an :class:`ArchiveRelay`, whose calls (find, load, save, fail, link) travel to the driver
-- through a pool worker's pipe, or through the Ray hub -- where :func:`answer_archive_call`
carries them out on the run's :class:`tridens.store.StageArchive`. Trainer checkpoints travel as
``torch.save`` bytes through a pipe, or as files under the Ray executor's ``storage=``; either way
the driver writes them into the store's ``.stages/`` files. The driver plans which trials form a
tree through a :class:`PlanningView`: stored rows only, nothing loaded or written while planning.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

__all__ = ["ArchiveRelay", "PlanningView", "answer_archive_call"]

log = logging.getLogger("tridens")

ARCHIVE_CALLS = {"has_root": False, "deepest": 0, "load": None, "save": None, "fail": None, "link": None}
"""The stage-store calls a worker may make, and what each returns when the store cannot answer."""


class PlanningView:
    """The driver's stage store as its planner sees it: which stages are stored (rows only);
    nothing is loaded or written while the driver decides which trials train as one tree.

    >>> view = PlanningView(archive)          # doctest: +SKIP
    >>> view.load(root, path, 2) is None      # doctest: +SKIP
    True
    """

    def __init__(self, archive: Any):
        self.archive, self.experiment = archive, archive.experiment

    def has_root(self, root: str) -> bool:
        return bool(self.archive.has_root(root))

    def deepest(self, root: str, paths: Sequence[str]) -> int:
        return int(self.archive.deepest(root, paths))

    def load(self, root: str, path: str, epochs: int) -> None:
        return None

    def save(self, **kwargs: Any) -> None:
        return None

    def fail(self, **kwargs: Any) -> None:
        return None

    def link(self, stage: int, trials: Sequence[int]) -> None:
        return None


class ArchiveRelay:
    """A worker's stand-in for the driver's :class:`tridens.store.StageArchive`: ``call(name,
    args, kwargs)`` sends one call to the driver and returns its answer; ``pack`` turns a trainer
    state into what travels (bytes, a file under ``storage=``), ``unpack`` turns it back.

    >>> relay = ArchiveRelay(call, "search", pack=state_bytes, unpack=load_bytes)   # doctest: +SKIP
    >>> relay.deepest(root, paths)                                                   # doctest: +SKIP
    2
    """

    def __init__(self, call: Callable[[str, tuple[Any, ...], dict[str, Any]], Any], experiment: str,
                 pack: Callable[[Any], Any], unpack: Callable[[Any], Any]):
        self.call, self.experiment, self.pack, self.unpack = call, experiment, pack, unpack

    def has_root(self, root: str) -> bool:
        return bool(self.call("has_root", (root,), {}))

    def deepest(self, root: str, paths: Sequence[str]) -> int:
        return int(self.call("deepest", (root, list(paths)), {}))

    def load(self, root: str, path: str, epochs: int) -> Any:
        from ..store import StageHit

        found = self.call("load", (root, path, epochs), {})
        return None if found is None else StageHit(found[0], self.unpack(found[1]), *found[2:])

    def save(self, **kwargs: Any) -> int | None:
        return self.call("save", (), {**kwargs, "state": self.pack(kwargs["state"])})

    def fail(self, **kwargs: Any) -> int | None:
        return self.call("fail", (), kwargs)

    def link(self, stage: int, trials: Sequence[int]) -> None:
        self.call("link", (stage, list(trials)), {})


def answer_archive_call(archive: Any, name: str, args: Sequence[Any], kwargs: dict[str, Any],
                        pack: Callable[[Any], Any], unpack: Callable[[Any], Any], where: str = "a worker") -> Any:
    """Carry out a worker's stage-store call on the driver's ``archive`` (None: the default
    answer); ``unpack``/``pack`` turn the travelling state into a trainer state and back. A stored
    stage sent to ``where`` is logged: it is not trained again."""
    if name not in ARCHIVE_CALLS:
        return None
    if archive is None:
        return ARCHIVE_CALLS[name]
    try:
        if "state" in kwargs:
            kwargs = {**kwargs, "state": unpack(kwargs["state"])}
        result = getattr(archive, name)(*args, **kwargs)
        if name == "load" and result is not None:
            log.info("stored stage %d (node %s, %d epoch(s), trained by %s) sent to %s: not trained again",
                     result.stage, result.label, result.epochs,
                     "this experiment before" if result.experiment == archive.experiment
                     else f"experiment {result.experiment!r}", where)
            return (result.epochs, pack(result.state), result.history, result.stage, result.label, result.experiment)
        return result
    except Exception as err:  # stage storage is an optimization: the stage is trained (again) instead
        log.warning("stage store: %s from %s failed (%s: %s)", name, where, type(err).__name__, err)
        return ARCHIVE_CALLS[name]
