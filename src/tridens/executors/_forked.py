"""A group's units side by side in forked processes: the in-process executor's lockstep loop on
several cores.

When the thread policy runs several units at once (small steps, one thread each, idle cores:
:class:`~._threads.ThreadPolicy`), the in-process executor deals its planned units into shares of
about equal work (:func:`~._threads.shares`; too few units are split first,
:func:`~._planner.spread_units`) and forks one child process per share. Each child trains its
share with :func:`~._execution.run_lockstep` and the pool's pipe (:class:`~._pool_units.PipeLink`):
after every round it sends its members' epochs and waits. The driver answers a round only when
every share has reported it, and then as the in-process loop does: every report recorded first,
then every verdict, in the order the units were planned. A synchronous rule sees the whole rung,
and units that are not split train and end exactly as they would one after another.

Forking, not spawning: a child starts in milliseconds with the models, the evaluator, the data and
the user's classes as they are in the driver, so nothing is pickled but metrics, the final weights
(``torch.save`` bytes, loaded with ``weights_only``) and log records. The driver stays the only
writer of the store. A child's log records go to the driver's handlers through the pipe (a
``logging.handlers.QueueHandler`` on the pipe), never to a handler's lock or console copied in a
locked state by the fork; what its units measured comes back at its end as data
(:meth:`~tridens.units.ExecutionUnit.measurements`), added to the run's plan context so later
groups plan from it.

:func:`forkable` says when this applies: a platform with ``fork`` (not macOS), no CUDA context
in the driver (a CUDA context does not survive a fork), and units that use no stage store (stage
trees read and write the driver's SQLite store). A strategy that forks members (PBT) keeps the
sequential loop.

Messages (:mod:`._messages`), child -> driver: ``Round``, ``Left`` (the pool's unit protocol,
:mod:`._pool_units`), ``LogRecord``, ``Measured``, ``End``; driver -> child: ``Verdicts``.
"""

from __future__ import annotations

import logging
import logging.handlers
import multiprocessing as mp
import sys
from multiprocessing.connection import Connection
from typing import Mapping, Sequence

import torch

from ..units import Decisions, ExecutionUnit
from ._lockstep import LockstepJudge, run_lockstep
from ._pool_units import PipeLink
from ._channel import PipeChannel
from ._messages import End, LogRecord, Measured
from ._driver import LockstepDriver, Placement, Site
from ._protocol import GroupHooks, TrialProtocol, error_text

__all__ = ["forkable", "run_forked"]

log = logging.getLogger("tridens")

_NO_FORK_KINDS = frozenset({"stage tree"})
"""Unit kinds that train only in the driver: they read and write the stage store (SQLite, one writer)."""


def forkable(units: Sequence[ExecutionUnit]) -> str:
    """Why ``units`` cannot train in forked processes ("" when they can)."""
    if "fork" not in mp.get_all_start_methods():
        return "this platform cannot fork"
    if sys.platform == "darwin":
        return "macOS system libraries are not safe to fork"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "a CUDA context does not survive a fork"
    kinds = sorted({u.kind for u in units} & _NO_FORK_KINDS)
    if kinds:
        return f"{kinds[0]} units read and write the store"
    return ""


class _PipeQueue:
    """What a ``QueueHandler`` puts records into: the child's pipe to the driver."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def put_nowait(self, record: logging.LogRecord) -> None:
        self.conn.send(LogRecord(record))


def _child(conn: Connection, units: Sequence[ExecutionUnit], threads: int) -> None:
    """A child's whole life: log through the pipe, train the share in lockstep, hand back the
    units' measurements, say "end"."""
    # records go to the driver's handlers; the loggers' levels, copied by the fork, still filter them
    logging.getLogger().handlers = [logging.handlers.QueueHandler(_PipeQueue(conn))]  # type: ignore[arg-type]
    logging.getLogger("tridens").handlers = []
    torch.set_num_threads(threads)
    trials = {tid: job.trial for unit in units for tid, job in unit.jobs.items()}
    judge = LockstepJudge(PipeLink(conn, trials), units[0].evaluator)
    try:
        run_lockstep(units, judge)
    except Exception as err:  # the pipe broke, or the loop itself failed: every member still here fails
        text = error_text(err)
        for tid in trials:
            try:
                judge.failed(None, tid, text)
            except OSError:
                break
    try:
        conn.send(Measured([m for unit in units for m in unit.measurements()]))
        conn.send(End())
    except OSError:
        pass


class _Children(Placement):
    """The :class:`~._driver.Placement` of a group's shares: each site a forked child training its
    share (``site.data``: its units) with ``threads`` torch threads, all at once."""

    name, process, where = "a forked process", "forked process", "in its forked process"
    retries = 0

    def __init__(self, count: int, units: int, threads: int):
        self.slots, self.units, self.threads = count, units, threads
        self.ctx = mp.get_context("fork")
        self.pids: list[int] = []

    def launch(self, site: Site) -> PipeChannel:
        ours, theirs = self.ctx.Pipe()
        process = self.ctx.Process(target=_child, args=(theirs, list(site.data), self.threads), daemon=True,
                                   name="tridens-unit")
        process.start()
        theirs.close()
        self.pids.append(process.pid or 0)
        if len(self.pids) == self.slots:
            log.info("%d units in %d forked processes (pids %s), %d thread(s) each", self.units, self.slots,
                     ", ".join(str(pid) for pid in self.pids), self.threads)
        return PipeChannel(ours, process)

    def kill(self, site: Site) -> None:
        if site.channel is not None:
            site.channel.kill()

    def release(self, site: Site) -> None:
        """The child said it ended: it exits (killed when it does not within seconds)."""
        if isinstance(site.channel, PipeChannel):
            if site.channel.exit_code(wait=5) is None:
                site.channel.kill()
            site.channel.close()


def run_forked(shares: Sequence[Sequence[ExecutionUnit]], lives: Mapping[int, TrialProtocol], hooks: GroupHooks,
               threads: int, order: Sequence[int] = (), decisions: Decisions | None = None) -> None:
    """Train each share of units in a forked child with ``threads`` torch threads, in lockstep
    across the shares (see the module docstring); every trial's outcome goes through its protocol
    in ``lives``. ``order``: the trials in the order the units were planned (the verdicts' order).
    ``decisions``: the run's (:class:`~tridens.units.PlanContext`), given what the children measured.

    >>> run_forked(shares(units, 2), lives, hooks, threads=1)       # doctest: +SKIP
    """
    children = _Children(len(shares), sum(len(share) for share in shares), threads)
    sites = [Site({tid: lives[tid] for unit in share for tid in unit.jobs if tid in lives}, list(share))
             for share in shares]
    LockstepDriver(children, lockstep=True, order=order, decisions=decisions).run(sites)
