"""The driver's side of lockstep training, one for every backend: what a round of members' epochs
means for their trials (:func:`decide_round`), wherever the members trained -- in this process
(:func:`~._lockstep.run_lockstep` with the in-process judge), in forked children, in pool
workers, in Ray tasks.

A round is every member's report of one epoch, in the order the units were planned. It is decided
in three passes over the members' :class:`~._protocol.TrialProtocol`:

1. every report is recorded (with the seconds its epoch took), so a synchronous rule (a
   Hyperband rung, PBT's ranking) sees the whole round before it decides anything;
2. every member's verdict (its timeout, its budget, the strategy's decision);
3. the strategy's forks (PBT) of the members that continue: a fork is kept only when its source
   continues too and does not move itself in the same round.

The backends carry a round to the driver and its :class:`RoundDecision` back; how a fork's
source state reaches the forking member (the same unit, a pipe, Ray's storage) is theirs.

:class:`LockstepDriver` is the driver of members that train in other processes (forked
children, pool workers, Ray tasks): it owns their protocols while they train there, the barrier
across those processes (or each process's round alone), the forks between them (a source in
another process hands its state back first), the hang check, the one death message and the
retries of a process that died. A backend is a :class:`Placement`: where a :class:`Site` (one
process's share of the members) runs, when it may start, how it is started and killed, the
:class:`~._channel.Channel` to it (a pipe, a Ray task's channel on the hub) and how trainer states
travel on it (:class:`Carrier`). A trial that runs alone in a process
(a user's loop) is a site of one member that reports step by step (:class:`Report`, answered at
once) and times out by the wall clock, whether it reports or not.

>>> from tridens.trial import Decision, Trial
>>> from tridens.units import Job
>>> from tridens.executors._messages import Report
>>> class Hooks:
...     trial_timeout = None
...     def started(self, trial): pass
...     def record(self, trial, step, metrics): pass
...     def decide(self, trial, step): return Decision.CONTINUE
...     def finish(self, trial, status, **kw): pass
>>> lives = {i: TrialProtocol(Job(Trial(id=i, sample={}, seed=0), None), Hooks(), clock="train") for i in (1, 2)}
>>> decision = decide_round([(lives[1], Report(1, 0, {"acc": 0.5})), (lives[2], Report(2, 0, {"acc": 0.6}, last=True))])
>>> decision.verdicts
{1: <Verdict.CONTINUE: 'continue'>, 2: <Verdict.DONE: 'done'>}
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import StorageFault
from ..trial import Fork
from ._channel import Channel, ChannelClosed, ready
from ._lockstep import RoundAnswers, load_bytes, state_bytes
from ._messages import (Answer, ArchiveAnswer, ArchiveCall, End, Forked, Left, LogRecord, Measured, Report, Round,
                        Started, Verdicts)
from ._protocol import RunHalted, TrialProtocol, Verdict
from ._stage_relay import answer_archive_call
from ._watchdog import check_overtime, check_silence, death_error, ended_error, for_trial, settle

__all__ = ["RoundDecision", "decide_round", "Site", "Carrier", "Placement", "LockstepDriver"]

log = logging.getLogger("tridens")


@dataclass
class RoundDecision:
    """What one round means: each member's verdict, and the forks of members that continue
    (trial id -> :class:`~tridens.trial.Fork`, each with a source that continues and stays)."""

    verdicts: dict[int, Verdict] = field(default_factory=dict)
    forks: dict[int, Fork] = field(default_factory=dict)


def decide_round(round: Sequence[tuple[TrialProtocol, Report]]) -> RoundDecision:
    """Decide one lockstep round: ``round`` holds each member's protocol and its report, in the
    planned order. A report's ``seconds`` are added to the member's training time (0 where the
    member trained in this process and counted them itself)."""
    for life, report in round:
        if report.seconds:
            life.add_seconds(report.seconds)
        life.record(report.step, report.metrics)
    decision = RoundDecision()
    for life, report in round:
        decision.verdicts[life.trial.id] = life.verdict(report.step, last=report.last)
    wanted: dict[int, Fork] = {}
    for life, report in round:
        tid = life.trial.id
        if decision.verdicts[tid] is Verdict.CONTINUE:
            fork = life.fork(report.step)
            if fork is not None:
                wanted[tid] = fork
    for tid, fork in wanted.items():
        if decision.verdicts.get(fork.source) is not Verdict.CONTINUE or fork.source in wanted:
            log.info("trial %d not forked from trial %d: the source is not training now", tid, fork.source)
            continue
        decision.forks[tid] = fork
    return decision


@dataclass
class Site:
    """One process's share of the members, as the driver sees it: their protocols while they train
    there (``lives``), the channel to it while it runs, the round it reported and waits on, when
    it last said something (``math.inf``: nothing yet, and a placement that queues its processes
    counts their silence from their first message), how often a process died under it, and its
    members that left it to move elsewhere (``moving``: Fluid). ``data``: the placement's own
    (what to start the process with)."""

    lives: dict[int, TrialProtocol]
    data: Any = None
    channel: Channel | None = None
    round: list[Report] | None = None
    last_message: float = field(default_factory=time.monotonic)
    deaths: int = 0
    resume: bool = False   # its members go on from their last kept rounds (retried, or moved)
    moving: set[int] = field(default_factory=set)

    def labels(self) -> str:
        return ", ".join(str(life.trial.label) for life in self.lives.values())


@dataclass(frozen=True)
class Carrier:
    """How trainer states travel between the driver and a placement's processes: ``wire`` turns
    a state into what a message carries (a fork's handed source, a stored stage sent to a stage
    tree), ``unwire`` turns what a process sent back into a state (a stage to store), ``load``
    reads a member's final weights from its outcome (None: as ``unwire``). Through a pipe:
    ``torch.save`` bytes (:data:`BY_PIPE`); on Ray: files under the run's storage (a hand-off
    is taken, the final weights stay in the trial's folder until its group ends)."""

    wire: Callable[[Any], Any]
    unwire: Callable[[Any], Any]
    load: Callable[[Any], Any] | None = None

    def weights(self, payload: Any) -> Any:
        """The final weights an outcome carries, as a state dict."""
        return (self.load or self.unwire)(payload)


BY_PIPE = Carrier(state_bytes, load_bytes)
"""States as ``torch.save`` bytes in the messages (pool workers, forked children)."""


class Placement:
    """Where a backend's :class:`Site` runs: at most ``slots`` at once (:meth:`admit`); ``name``
    says what runs it in the log (``"a pool worker"``), ``process`` in the death message
    (``"worker process"``), ``where`` in the message of a member its unit ended without (``"in its
    worker"``). A site whose process died is started again up to ``retries`` times (its members
    lost only their in-memory state): from their last kept rounds when ``resumes`` says so (the
    log's words, ``"from the members' last rounds"``; "": from their start), and the last death
    message names ``limit`` (``"max_retries=2"``; "": nothing) as what allows no more. States travel
    by ``carrier``.

    >>> class Threads(Placement):                   # doctest: +SKIP
    ...     def launch(self, site): ...             # start the site's process; its Channel
    ...     def kill(self, site): ...
    """

    slots: int = 1
    name, process, where = "a worker process", "worker process", "in its worker"
    retries: int = 0
    resumes: str = ""
    limit: str = ""
    carrier: Carrier = BY_PIPE

    def admit(self, queue: Sequence[Site], running: int) -> list[Site]:
        """Of the sites waiting to start (``queue``, in order), those that start now, with
        ``running`` sites running: as many as there are free slots."""
        return list(queue[:max(self.slots - running, 0)])

    def launch(self, site: Site) -> Channel:
        """Start ``site``'s members in a process; the channel to it."""
        raise NotImplementedError

    def kill(self, site: Site) -> None:
        """End ``site``'s process now (it hangs, died, or the run stops)."""
        raise NotImplementedError

    def release(self, site: Site) -> None:
        """``site`` is over (its process said so): its process is free, or ends; members still in
        ``site.lives`` moved (they start again)."""

    def moves(self, life: TrialProtocol, step: int) -> bool:
        """Whether member ``life``, continuing after ``step``, leaves its process at this round to
        start again elsewhere (Fluid's new share): its verdict is then :attr:`Verdict.YIELD`."""
        return False

    def model(self, trial_id: int) -> bytes:
        """Member ``trial_id``'s initial model as its process received it (for a fork's handed source)."""
        raise NotImplementedError("the members of this placement do not fork across processes")

    def state_of(self, site: Site, trial_id: int, step: int) -> Any:
        """Member ``trial_id``'s trainer state of ``step`` (None: not to be had), for a fork whose
        source trains in ``site``, another process."""
        return None


class LockstepDriver:
    """Drive ``sites`` through ``placement`` (see the module docstring). With ``lockstep``, a round
    is decided once every site with members has reported it (a population that forks: PBT), in
    the trials' ``order``; otherwise each site's round as it comes. ``archive``: the run's stage
    store that sites' stage trees call (None: none); ``decisions``: the run's, given what the
    sites measured. A population's site retried after its process died resumes from its members'
    last rounds and asks the last one again: it gets the answers it had (:class:`~._lockstep.RoundAnswers`).

    >>> LockstepDriver(placement, lockstep=True).run(sites)     # doctest: +SKIP
    """

    def __init__(self, placement: Placement, *, lockstep: bool, order: Sequence[int] = (), archive: Any = None,
                 decisions: Any = None):
        self.placement, self.lockstep, self.archive, self.decisions = placement, lockstep, archive, decisions
        self.rank = {tid: i for i, tid in enumerate(order)}
        self.again: list[Site] = []       # sites to start again first: their process died, or members moved
        self.sites: list[Site] = []
        self.answers = RoundAnswers()     # a population's last answers, given again to a retried site

    def run(self, sites: Sequence[Site]) -> None:
        """Train every site's members until each has its outcome."""
        self.sites = list(sites)
        queue, running = list(sites), []  # type: list[Site], list[Site]
        try:
            while queue or running or self.again:
                queue[:0], self.again = self.again, []
                for site in self.placement.admit(queue, len(running)):
                    queue.remove(site)
                    self._launch(site)
                    running.append(site)
                readable = ready([site.channel for site in running if site.channel is not None], timeout=0.2)
                for site in list(running):
                    if site.channel in readable and not self._receive(site):
                        running.remove(site)
                if self.lockstep:
                    self._barrier()
                for site in list(running):
                    if site.round is None and self._hangs(site):   # (not while it waits for the others)
                        running.remove(site)
        except BaseException:  # the run stops (Ctrl-C, SIGTERM, a store fault): the busy processes end now
            for site in running:
                self.placement.kill(site)
            raise

    def _launch(self, site: Site) -> None:
        site.round, site.last_message = None, time.monotonic()
        site.channel = self.placement.launch(site)

    def _receive(self, site: Site) -> bool:
        """Every message ``site``'s process has sent so far; False when the site is over."""
        assert site.channel is not None
        while site.channel.poll():
            try:
                message = site.channel.receive()
            except ChannelClosed:
                self._died(site, site.channel.exit_description())
                return False
            if not self._handle(site, message):
                self.placement.release(site)
                return False
        return True

    def _handle(self, site: Site, message: Any) -> bool:
        """One message of ``site``'s process; False when the site is over."""
        assert site.channel is not None
        site.last_message = time.monotonic()
        if isinstance(message, Started):
            for tid, life in site.lives.items():
                if message.trial_id in (None, tid):
                    life.trial.info.update(message.info or {})
                    life.start()
        elif isinstance(message, Round):
            again = [self.answers.again(r.trial_id, r.step) for r in message.reports] if self.lockstep else []
            if again and all(a is not None for a in again):   # a retried site's last round: as answered
                answers = {r.trial_id: a[0] for r, a in zip(message.reports, again) if a is not None}
                forks = [self._wired(a[1]) for a in again if a is not None and a[1] is not None]
                with contextlib.suppress(ChannelClosed):   # died again: read as its death in the loop
                    site.channel.send(Verdicts(answers, forks))
            else:
                site.round = message.reports
                if not self.lockstep:   # a site alone: its round is answered now
                    self._answer([site])
        elif isinstance(message, Report):   # a trial alone in its process: its step answered now
            return self._report(site, message)
        elif isinstance(message, Left):
            if message.outcome.kind == "fault":   # the process's disk is full or failing: the run stops
                raise RunHalted(StorageFault(message.outcome.error or f"a storage fault in {self.placement.name}"))
            if message.outcome.kind == "yielded":   # it moves: its process ends, it starts again elsewhere
                site.moving.add(message.trial_id)
            else:
                settle(site.lives.pop(message.trial_id, None), message.outcome, self.placement.carrier.weights)
        elif isinstance(message, Forked):
            member, origin = site.lives.get(message.trial_id), self._life(message.source)
            if member is not None and origin is not None:
                member.forked(origin.trial, message.step, Fork(message.source, message.sample))
        elif isinstance(message, ArchiveCall):
            carrier = self.placement.carrier
            site.channel.send(ArchiveAnswer(answer_archive_call(self.archive, message.method, message.args,
                                                                message.kwargs, carrier.wire, carrier.unwire,
                                                                self.placement.name)))
        elif isinstance(message, LogRecord):
            logging.getLogger(message.record.name).handle(message.record)
        elif isinstance(message, Measured):
            if self.decisions is not None:
                self.decisions.add(message.measurements)
        elif isinstance(message, End):
            for tid in [tid for tid in site.lives if tid not in site.moving]:
                life = site.lives.pop(tid)
                life.fail(for_trial(ended_error(self.placement.where), life.trial))
            site.moving.clear()
            if site.lives:   # its members that moved start again (the placement releases them first)
                site.resume = True
                self.again.append(site)
            return False
        return True

    def _life(self, trial_id: int) -> TrialProtocol | None:
        for site in self.sites:
            if trial_id in site.lives:
                return site.lives[trial_id]
        return None

    def _report(self, site: Site, report: Report) -> bool:
        """One step of a trial alone in ``site``'s process, answered with its verdict
        (:attr:`Verdict.YIELD` where it moves: :meth:`Placement.moves`). Past its timeout (failed
        by its protocol) a trial's process drops it, but a user's loop (a ``"wall"`` clock) cannot
        be told: its process is killed. False when the site is over."""
        assert site.channel is not None
        life = site.lives.get(report.trial_id)
        if life is None:
            return True
        verdict = life.report(report.step, report.metrics, last=report.last, seconds=report.seconds)
        if verdict is Verdict.DROP and life.clock == "wall":
            self._lost(site, None)
            return False
        if verdict is Verdict.DROP:
            site.lives.pop(report.trial_id)
        elif verdict is Verdict.CONTINUE and self.placement.moves(life, report.step):
            verdict = Verdict.YIELD
        with contextlib.suppress(ChannelClosed):   # died meanwhile: read as its death in the loop
            site.channel.send(Answer(report.trial_id, verdict.value))
        return True

    # -- death and hangs ---------------------------------------------------------------------------
    def _hangs(self, site: Site) -> bool:
        """The hang check of ``site``: a user's loop (a ``"wall"`` clock) past its timeout, reporting
        or not, else a process silent inside an epoch for longer than the timeout; True when it was killed."""
        lives = list(site.lives.values())
        if len(lives) == 1 and lives[0].clock == "wall":
            return check_overtime(lives[0], functools.partial(self._lost, site, None))
        return check_silence(lives, site.last_message, functools.partial(self._lost, site))

    def _lost(self, site: Site, error: str | None) -> None:
        """``site``'s process died or hangs: killed; every member still there fails with ``error``
        (None: their protocols tell their outcomes themselves)."""
        self.placement.kill(site)
        for life in site.lives.values():
            if error is not None:
                life.fail(for_trial(error, life.trial))
        site.lives.clear()
        site.round = None

    def _died(self, site: Site, how: str) -> None:
        """The death of ``site``'s process (``how``: its exit code, what the cluster said): its
        members that had not left lost only their in-memory state, so the site starts again on a
        fresh process up to ``retries`` times (a stage tree resumes from the stages it stored, a
        population's members, or a Ray task's, from their last rounds; steps recorded before are
        not recorded again); then they fail."""
        site.deaths += 1
        placement = self.placement
        if site.deaths > placement.retries or not site.lives:
            self._lost(site, death_error(placement.process, how, times=site.deaths, limit=placement.limit))
            return
        placement.kill(site)
        site.round, site.channel, site.resume = None, None, bool(placement.resumes)
        retry = "once" if placement.retries == 1 else f"({site.deaths} of {placement.retries})"
        log.warning("%s; retried %s on a fresh worker%s", for_trial(death_error(placement.process, how), site.labels()),
                    retry, f" {placement.resumes}" if placement.resumes else "")
        self.again.append(site)

    # -- rounds ------------------------------------------------------------------------------------
    def _barrier(self) -> None:
        """Once every site with members has reported its round (a retried one too): the round decided as one."""
        waiting = [site for site in self.sites if site.lives]
        if waiting and all(site.round is not None for site in waiting):
            self._answer(waiting)

    def _answer(self, waiting: Sequence[Site]) -> None:
        """The round the ``waiting`` sites reported, decided as one (:func:`decide_round`, in the
        trials' order), then each site's answer: its members' verdicts and its forks, with the
        states of the sources that train in another process (:meth:`Placement.state_of`), kept
        for a site whose process dies before it trains the next round."""
        entries = sorted(((site, report) for site in waiting for report in site.round or ()),
                         key=lambda entry: (self.rank.get(entry[1].trial_id, len(self.rank)), entry[1].trial_id))
        decision = decide_round([(site.lives[report.trial_id], report) for site, report in entries])
        for site, report in entries:   # members that move to another process at this round (Fluid)
            tid = report.trial_id
            if (decision.verdicts[tid] is Verdict.CONTINUE and tid not in decision.forks
                    and self.placement.moves(site.lives[tid], report.step)):
                decision.verdicts[tid] = Verdict.YIELD
        where = {report.trial_id: site for site, report in entries}
        steps = {report.trial_id: report.step for _, report in entries}
        given: dict[int, tuple[Any, ...]] = {}
        states: dict[int, Any] = {}
        for tid, fork in decision.forks.items():
            site, source = where[tid], where[fork.source]
            if source is site:
                given[tid] = (tid, fork.source, fork.sample, None)
                continue
            if fork.source not in states:
                states[fork.source] = self.placement.state_of(source, fork.source, steps[fork.source])
            if states[fork.source] is None:
                continue
            origin = source.lives[fork.source].trial
            handed = (origin.seed, origin.sample, self.placement.model(fork.source), states[fork.source])
            given[tid] = (tid, fork.source, fork.sample, handed)
        for site in waiting:
            answers = {}
            for report in site.round or ():
                verdict = decision.verdicts[report.trial_id]
                if verdict is Verdict.DROP:   # past its timeout: failed by the protocol; the process drops it
                    site.lives.pop(report.trial_id, None)
                answers[report.trial_id] = verdict.value
                if self.lockstep:
                    self.answers.keep(report.trial_id, report.step, verdict.value, given.get(report.trial_id))
            site.round = None
            site.last_message = time.monotonic()
            assert site.channel is not None
            with contextlib.suppress(ChannelClosed):   # died meanwhile: read as its death in the loop
                site.channel.send(Verdicts(answers, [self._wired(given[tid]) for tid in answers if tid in given]))

    def _wired(self, fork: tuple[Any, ...]) -> tuple[Any, ...]:
        """A fork ``(trial, source, sample, handed)`` as sent: a handed source's state by the
        placement's carrier (a fresh copy each time: a process takes what it is handed)."""
        handed = fork[3]
        if handed is None:
            return fork
        seed, sample, model, state = handed
        return (*fork[:3], (seed, sample, model, self.placement.carrier.wire(state)))
