"""A group's units side by side in forked processes: the in-process executor's lockstep loop on
several cores.

When the thread policy runs several units at once (small steps, one thread each, idle cores:
:class:`~._threads.ThreadPolicy`), the in-process executor deals its planned units into shares of
about equal work (:func:`~._threads.shares`; too few units are split first,
:func:`~._planner.spread_units`) and forks one child process per share. Each child trains its
share with :func:`~._execution.run_lockstep` and the pool's :class:`~._pool_units.PipeJudge`:
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
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Mapping, Sequence

import torch

from ..units import Decisions, ExecutionUnit
from ._lockstep import load_bytes, run_lockstep
from ._pool_units import PipeJudge
from ._channel import ChannelClosed, PipeChannel, ready
from ._messages import End, Left, LogRecord, Measured, Report, Round, Verdicts
from ._driver import decide_round
from ._protocol import GroupHooks, TrialProtocol, Verdict, error_text
from ._watchdog import check_silence, death_error, ended_error, for_trial, settle

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


@dataclass
class _Share:
    """One child process, the members it trains and the round it has reported."""

    channel: PipeChannel
    lives: dict[int, TrialProtocol]
    round: list[Report] | None = None
    open: bool = True
    last_message: float = field(default_factory=time.monotonic)


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
    judge = PipeJudge(conn, units[0].evaluator, trials)
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


def run_forked(shares: Sequence[Sequence[ExecutionUnit]], lives: Mapping[int, TrialProtocol], hooks: GroupHooks,
               threads: int, order: Sequence[int] = (), decisions: Decisions | None = None) -> None:
    """Train each share of units in a forked child with ``threads`` torch threads, in lockstep
    across the shares (see the module docstring); every trial's outcome goes through its protocol
    in ``lives``. ``order``: the trials in the order the units were planned (the verdicts' order).
    ``decisions``: the run's (:class:`~tridens.units.PlanContext`), given what the children measured.

    >>> run_forked(shares(units, 2), lives, hooks, threads=1)       # doctest: +SKIP
    """
    ctx = mp.get_context("fork")
    rank = {tid: i for i, tid in enumerate(order)}
    children: list[_Share] = []
    try:
        for share in shares:
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=_child, args=(theirs, list(share), threads), daemon=True,
                                  name="tridens-unit")
            process.start()
            theirs.close()
            members = {tid: lives[tid] for unit in share for tid in unit.jobs if tid in lives}
            children.append(_Share(PipeChannel(ours, process), members))
        log.info("%d units in %d forked processes (pids %s), %d thread(s) each", sum(len(s) for s in shares),
                 len(children), ", ".join(str(c.channel.process.pid) for c in children), threads)
        while any(c.open for c in children):
            readable = ready([c.channel for c in children if c.open], timeout=0.2)
            for child in children:
                if child.open and child.channel in readable:
                    _receive(child, decisions)
            _barrier(children, rank)
            for child in children:
                if child.open and child.round is None:
                    check_silence(child.lives.values(), child.last_message, lambda error: _lost(child, error))
    finally:
        for child in children:
            if child.channel.exit_code(wait=5) is None:
                child.channel.kill()
            child.channel.close()


def _receive(child: _Share, decisions: Decisions | None = None) -> None:
    """Every message ``child`` has sent so far."""
    while child.open:
        try:
            if not child.channel.poll():
                return
            message = child.channel.receive()
        except ChannelClosed:
            _lost(child, death_error("forked process", child.channel.exit_description()))
            return
        child.last_message = time.monotonic()
        if isinstance(message, Round):
            child.round = message.reports
        elif isinstance(message, Left):
            settle(child.lives.pop(message.trial_id, None), message.outcome, load_bytes)
        elif isinstance(message, LogRecord):
            logging.getLogger(message.record.name).handle(message.record)
        elif isinstance(message, Measured):
            if decisions is not None:
                decisions.add(message.measurements)
        elif isinstance(message, End):
            for life in list(child.lives.values()):
                life.fail(for_trial(ended_error("in its forked process"), life.trial))
            child.lives.clear()
            child.open = False


def _lost(child: _Share, error: str) -> None:
    """The child died or hangs: killed; every member still there fails."""
    if child.channel.alive():
        child.channel.process.kill()
    child.open = False
    for life in child.lives.values():
        life.fail(for_trial(error, life.trial))
    child.lives.clear()
    child.round = None


def _barrier(children: Sequence[_Share], rank: Mapping[int, int]) -> None:
    """Once every child with members has reported its round: the round decided in the planned
    order (:func:`~._driver.decide_round`: every report recorded, then every verdict), then each
    child's answer."""
    waiting = [c for c in children if c.open and c.lives]
    if not waiting or any(c.round is None for c in waiting):
        return
    reports = sorted(((rank.get(r.trial_id, len(rank)), r.trial_id, c, r) for c in waiting for r in c.round or ()),
                     key=lambda item: (item[0], item[1]))
    decision = decide_round([(child.lives[tid], report) for _, tid, child, report in reports])
    answers: dict[int, dict[int, str]] = {id(c): {} for c in waiting}
    for _, tid, child, _report in reports:
        verdict = decision.verdicts[tid]
        if verdict is Verdict.DROP:   # past its timeout: failed by the protocol; the child drops it
            child.lives.pop(tid, None)
        answers[id(child)][tid] = verdict.value
    for child in waiting:
        child.round = None
        child.last_message = time.monotonic()
        try:
            child.channel.send(Verdicts(answers[id(child)]))
        except ChannelClosed:   # died meanwhile: read as its death next
            pass
