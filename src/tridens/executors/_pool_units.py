"""Units on the process pool: trials of a declarative evaluator that train together in one worker,
epoch by epoch, as the in-process executor trains them (:func:`~._execution.run_lockstep`).

Two cases send a TrialGroup's trials to the :class:`~._execution.ProcessExecutor`'s workers as
units instead of one trial per worker:

* **Stage trees** (:mod:`tridens.xopt` ``"stage tree"``, the optimizations of
  :data:`POOL_OPTIMIZATIONS`): trials that share a training prefix go to one worker, which plans
  them again and trains the tree; the others run one per worker (a unit of one). Other fusions
  stay in-process and on Ray: the pool's parallelism is one trial per worker.
* **A strategy that forks members** (PBT, ``RunContext.forks``): the population is spread over
  the workers, every member training at once, and the driver answers a round only when every
  worker has reported it (the strategy ranks the whole population). Before it reports a round, a
  worker writes each member's trainer state of that round under the run's ``storage``
  (:meth:`~._ray_storage.CheckpointStorage.save_round`, the layout Ray's tasks use). An exploit
  whose source trains in the same worker forks there through the source unit's ``fork``; for a
  source in another worker the driver reads the source's state of that round from storage and
  **hands it over**, with the source's model, to the exploiting member's worker: a unit holding
  only that state forks it there the same way.

**A dead worker** (killed, out of memory) costs only the work it held since its members' last
round: its placement is retried once on a fresh worker. A stage tree resumes from the stages it
stored; a population's members resume from their last rounds in storage
(:func:`~._lockstep.resume_units`) and ask that round again, which the driver answers as it did
(:class:`~._lockstep.RoundAnswers`: the same verdicts and forks, handed states included), while
the other workers wait for them at the next round. A second death fails the placement's members.

**Stage storage** (:mod:`._stage_relay`). The store is SQLite with one writer: the driver. A
worker's stage tree reads and writes stages through an ``ArchiveRelay``, whose calls (find, load,
save, fail, link) travel through the worker's pipe to the driver's
:class:`tridens.store.StageArchive`; checkpoints travel as ``torch.save`` bytes and land in the
store's ``.stages/`` files, written by the driver. The driver plans which trials form a tree from
the stored rows only (nothing loaded there).

Messages (:mod:`._messages`), driver -> worker: ``RunUnit``, ``ArchiveAnswer``, ``Verdicts``.
Worker -> driver: ``Started``, ``ArchiveCall``, ``Round``, ``Forked``, ``Left``, ``End``.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ..evaluators import Evaluator, StepwiseEvaluator
from ..trial import Fork, Trial
from ..units import ExecutionUnit, Job, PlanContext
from ._lockstep import (LockstepJudge, RoundAnswers, UnitReport, handed_source, load_bytes, model_bytes, plan_units,
                        resume_units, run_lockstep, state_bytes)
from ._channel import ChannelClosed, ready
from ._messages import (ArchiveAnswer, ArchiveCall, End, Forked, Left, Outcome, Report, Round, RunUnit, Started,
                        Verdicts)
from ._driver import decide_round
from ._protocol import GroupHooks, TrialProtocol, Verdict, error_text
from ._ray_storage import CheckpointStorage
from ._stage_relay import ArchiveRelay, PlanningView, answer_archive_call
from ._watchdog import check_silence, death_error, ended_error, for_trial, settle

if TYPE_CHECKING:
    from ._execution import PoolWorker, ProcessExecutor

__all__ = ["UnitRun", "serve_unit", "PipeJudge", "POOL_OPTIMIZATIONS"]

log = logging.getLogger("tridens")

POOL_OPTIMIZATIONS = ("stage tree",)
"""The optimizations (by name, of :data:`tridens.xopt.OPTIMIZATIONS`) the process pool trains as units."""

_INFO = ("stages", "stage_store", "unit")
"""What a worker's unit writes into ``trial.info`` that goes back to the driver with the outcome."""


def _optimizations() -> list[Any]:
    from .. import xopt

    return [o for o in xopt.OPTIMIZATIONS if o.name in POOL_OPTIMIZATIONS]


# -- the driver --------------------------------------------------------------------------------------
@dataclass
class _Placement:
    """Trials sent to one worker as one unit, and their protocols while they train there."""

    lives: dict[int, TrialProtocol]
    settings: dict[str, Any] | None      # the run's xopt.Settings as plain data; None: trained separately
    slot: int | None = None
    worker: PoolWorker | None = None
    round: list[Report] | None = None    # a reported round waiting for the others (forks)
    last_message: float = field(default_factory=time.monotonic)
    deaths: int = 0                      # workers that died under it (it is retried once)
    resume: bool = False                 # its members go on from their last rounds in storage (forks)


class UnitRun:
    """One TrialGroup on the pool as units (see the module docstring); :meth:`plan` says whether
    the group needs it, :meth:`run` trains it. Each trial's outcome goes through its
    :class:`~._protocol.TrialProtocol`."""

    def __init__(self, executor: ProcessExecutor, evaluator: StepwiseEvaluator, hooks: GroupHooks,
                 models: Mapping[int, bytes], placements: list[_Placement], forks: bool, archive: Any):
        self.executor, self.evaluator, self.hooks = executor, evaluator, hooks
        self.models, self.placements, self.forks, self.archive = models, placements, forks, archive
        self.retry: list[_Placement] = []   # placements whose worker died, to launch again first
        self.answers = RoundAnswers()       # a population's answers, given again to a retried worker
        # where a population's workers keep their members' rounds: the run's storage, else a
        # folder of this group's own
        context = getattr(executor, "context", None)
        self.experiment = str(getattr(context, "experiment", None) or "experiment")
        root = getattr(context, "storage", None)
        self.scratch = tempfile.mkdtemp(prefix="tridens-rounds-") if forks and root is None else None
        self.storage = CheckpointStorage(str(root or self.scratch)) if forks else None

    @classmethod
    def plan(cls, executor: ProcessExecutor, jobs: Sequence[Job], evaluator: StepwiseEvaluator, hooks: GroupHooks,
             fluid: bool = False) -> "UnitRun | None":
        """The group's units, or None when its trials run one per worker as usual: no strategy
        forks and no trials share a stage tree (or Fluid places them: ``fluid``)."""
        context = getattr(executor, "context", None)
        optimize = getattr(context, "optimize", False)
        forks = bool(getattr(context, "forks", False))
        if not jobs or (not forks and (not optimize or fluid)):
            return None
        if forks and fluid:
            log.info("the population trains in lockstep over the %d workers (forks), not placed by Fluid", executor.workers)
        settings = None
        if optimize:
            from ..xopt import resolve_settings

            settings = resolve_settings(optimize)
        planning: PlanContext = getattr(context, "plan", None) or PlanContext()   # the run's
        archive = planning.archive if settings else None
        models = {job.trial.id: model_bytes(job.model) for job in jobs}   # before planning may touch them
        lives = {job.trial.id: TrialProtocol(job, hooks, clock="train") for job in jobs}
        plain = None if settings is None else settings.as_dict()

        def alone(job: Job) -> _Placement:
            return _Placement({job.trial.id: lives[job.trial.id]}, None)

        if forks:   # every member at once: as many units as workers, members dealt in turn
            count = min(executor.workers, len(jobs))
            return cls(executor, evaluator, hooks, models,
                       [_Placement({j.trial.id: lives[j.trial.id] for j in jobs[i::count]}, plain)
                        for i in range(count)], True, archive)
        fresh = [job for job in jobs if job.start_from is None]
        placements = [alone(job) for job in jobs if job.start_from is not None]
        rest, fused = list(fresh), []
        view = planning.with_archive(None if archive is None else PlanningView(archive))
        for optimization in _optimizations():
            made, rest = optimization.plan(rest, evaluator, settings=settings, context=view)
            fused.extend(made)
        if not fused:
            return None
        for unit in fused:
            log.info("process pool: %s", unit.summary())
            placements.append(_Placement({t: lives[t] for t in unit.jobs}, plain))
        placements += [alone(job) for job in rest]
        return cls(executor, evaluator, hooks, models, placements, False, archive)

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        queue = list(self.placements)
        running: dict[int, _Placement] = {}
        self._tidy()   # what an earlier (crashed) run of these trials left: they train from their start
        try:
            self._serve(queue, running)
        except BaseException:  # the run stops (Ctrl-C, SIGTERM, a store fault): the busy workers end now
            for slot in running:
                self.executor.replace(slot)
            raise
        finally:
            self._tidy()
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)

    def _tidy(self) -> None:
        """The members' rounds under storage removed (before the group, and after it: the outcomes
        are in the store, and an interrupted trial trains again from its start)."""
        if self.storage is None:
            return
        for tid in self.models:
            self.storage.discard(self.storage.trial_directory(self.experiment, tid))

    def _serve(self, queue: list[_Placement], running: dict[int, _Placement]) -> None:
        while queue or running or self.retry:
            queue[:0], self.retry = self.retry, []
            for slot in range(self.executor.workers):
                if queue and slot not in running:
                    running[slot] = self._launch(queue.pop(0), slot)
            slots = {id(p.worker.channel): slot for slot, p in running.items() if p.worker is not None}
            for channel in ready([p.worker.channel for p in running.values() if p.worker is not None], timeout=0.2):
                slot = slots[id(channel)]
                if slot in running and not self._receive(running[slot]):
                    del running[slot]
            if self.forks:
                self._barrier()
            for slot, p in list(running.items()):
                # silent for longer than the timeout while training (not while waiting for the others)
                if p.round is None and check_silence(p.lives.values(), p.last_message, lambda error: self._lost(p, error)):
                    del running[slot]

    def _launch(self, p: _Placement, slot: int) -> _Placement:
        p.slot, p.worker = slot, self.executor.worker(slot)
        p.last_message = time.monotonic()
        token = self.executor.ship(p.worker, self.evaluator)
        members = [(life.trial, self.models[tid], life.job.max_steps, state_bytes(life.job.start_from))
                   for tid, life in p.lives.items()]
        experiment = None if self.archive is None or p.settings is None else self.archive.experiment
        storage = None if self.storage is None else (self.storage.root, self.experiment)
        try:
            p.worker.channel.send(RunUnit(token, members, p.settings, POOL_OPTIMIZATIONS, experiment, storage, p.resume))
        except ChannelClosed:  # died meanwhile: read as its death below
            pass
        return p

    def _lost(self, p: _Placement, error: str) -> None:
        """The placement's worker died or hangs: replaced; every member still there fails."""
        assert p.slot is not None
        self.executor.replace(p.slot)
        for life in list(p.lives.values()):
            life.fail(for_trial(error, life.trial))
        p.lives.clear()

    def _receive(self, p: _Placement) -> bool:
        """One message of ``p``'s worker; False when the placement is over."""
        assert p.worker is not None
        try:
            message = p.worker.channel.receive()
        except ChannelClosed:
            self._died(p, p.worker.channel.exit_description())
            return False
        return self._handle(p, message)

    def _died(self, p: _Placement, how: str) -> None:
        """What the death of ``p``'s worker means for each member: the members that had not left
        lost only their in-memory state, so the placement is retried once on a fresh worker (a
        stage tree resumes from the stages it stored, a population's members from their last
        rounds; steps recorded before are not recorded again); a second death fails them."""
        p.deaths += 1
        error = death_error("worker process", how, times=p.deaths)
        if p.deaths > 1 or not p.lives:
            self._lost(p, error)
            return
        assert p.slot is not None
        self.executor.replace(p.slot)
        p.round, p.worker, p.slot, p.resume = None, None, None, self.forks
        log.warning("%s; retried once on a fresh worker%s",
                    for_trial(error, ", ".join(str(life.trial.label) for life in p.lives.values())),
                    " from the members' last rounds" if self.forks else "")
        self.retry.append(p)

    def _handle(self, p: _Placement, message: Any) -> bool:
        assert p.worker is not None
        p.last_message = time.monotonic()
        if isinstance(message, Started):
            for life in p.lives.values():
                life.start()
        elif isinstance(message, ArchiveCall):
            p.worker.channel.send(ArchiveAnswer(self._archive_call(message.method, message.args, message.kwargs)))
        elif isinstance(message, Round):
            again = [self.answers.again(r.trial_id, r.step) for r in message.reports] if self.forks else []
            if again and all(a is not None for a in again):   # a retried worker's last round: as answered
                answers = {r.trial_id: a[0] for r, a in zip(message.reports, again) if a is not None}
                forks = [a[1] for a in again if a is not None and a[1] is not None]
                with contextlib.suppress(ChannelClosed):   # died again: read as its death in the loop
                    p.worker.channel.send(Verdicts(answers, forks))
            else:
                p.round = message.reports
                if not self.forks:   # a unit alone: its round is answered now
                    self._answer([p])
        elif isinstance(message, Forked):
            member, origin = p.lives.get(message.trial_id), self._life(message.source)
            if member is not None and origin is not None:
                member.forked(origin.trial, message.step, Fork(message.source, message.sample))
        elif isinstance(message, Left):
            settle(p.lives.pop(message.trial_id, None), message.outcome, load_bytes)
        elif isinstance(message, End):
            for life in list(p.lives.values()):
                life.fail(for_trial(ended_error("in its worker"), life.trial))
            p.lives.clear()
            return False
        return True

    def _life(self, tid: int) -> TrialProtocol | None:
        for p in self.placements:
            if tid in p.lives:
                return p.lives[tid]
        return None

    def _archive_call(self, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """A worker's stage-store call, carried out on the driver's archive (states travel as bytes)."""
        return answer_archive_call(self.archive, name, args, kwargs, state_bytes, load_bytes, "a pool worker")

    # -- forks: the population in lockstep ---------------------------------------------------------
    def _barrier(self) -> None:
        """Once every placement with members has reported its round (a retried one too): the
        round decided as one (:meth:`_answer`)."""
        waiting = [p for p in self.placements if p.lives]
        if waiting and all(p.round is not None for p in waiting):
            self._answer(waiting)

    def _answer(self, waiting: Sequence[_Placement]) -> None:
        """The round the ``waiting`` placements reported, decided as one (:func:`~._driver.decide_round`:
        every report recorded, then every verdict, then the strategy's forks), then each worker's
        answer: its members' verdicts and its forks, with the states of the sources that train in
        another worker (read from storage), kept for a worker that dies before it trains the next round."""
        entries = [(p, report) for p in waiting for report in p.round or ()]
        decision = decide_round([(p.lives[report.trial_id], report) for p, report in entries])
        where = {report.trial_id: p for p, report in entries}
        steps = {report.trial_id: report.step for _, report in entries}
        given: dict[int, tuple[Any, ...]] = {}
        states: dict[int, bytes | None] = {}
        for tid, fork in decision.forks.items():
            p, q = where[tid], where[fork.source]
            if q is p:
                given[tid] = (tid, fork.source, fork.sample, None)
                continue
            if fork.source not in states:
                states[fork.source] = self._state_of(fork.source, steps[fork.source])
            if states[fork.source] is None:
                continue
            origin = q.lives[fork.source]
            handed = (origin.trial.seed, origin.trial.sample, self.models[fork.source], states[fork.source])
            given[tid] = (tid, fork.source, fork.sample, handed)
        for p in waiting:
            answers = {}
            for report in p.round or ():
                verdict = decision.verdicts[report.trial_id]
                if verdict is Verdict.DROP:   # past its timeout: failed by the protocol; the worker drops it
                    p.lives.pop(report.trial_id, None)
                answers[report.trial_id] = verdict.value
                if self.forks:
                    self.answers.keep(report.trial_id, report.step, verdict.value, given.get(report.trial_id))
            p.round = None
            p.last_message = time.monotonic()
            assert p.worker is not None
            with contextlib.suppress(ChannelClosed):   # died meanwhile: read as its death in the loop
                p.worker.channel.send(Verdicts(answers, [given[tid] for tid in answers if tid in given]))

    def _state_of(self, tid: int, step: int) -> bytes | None:
        """Member ``tid``'s trainer state of ``step``, as its worker wrote it before reporting the round."""
        assert self.storage is not None
        try:
            return state_bytes(self.storage.round_of(self.storage.trial_directory(self.experiment, tid), step))
        except (OSError, KeyError) as err:
            log.info("the state of trial %d after step %d is not in storage (%s): it is the source of no fork", tid,
                     step, err)
            return None


# -- the worker ---------------------------------------------------------------------------------------
class PipeJudge(LockstepJudge):
    """A pool worker's (or a forked process's, :mod:`._forked`) side of the lockstep loop: each
    round's reports go to the driver, whose answer holds the verdicts and the forks; a member's
    outcome goes back with its weights. With ``storage`` (a population's worker: ``(storage,
    experiment)``) each member's state of a round is written there before the round is reported."""

    def __init__(self, conn: Connection, evaluator: StepwiseEvaluator, trials: Mapping[int, Trial],
                 storage: tuple[CheckpointStorage, str] | None = None):
        self.conn, self.evaluator, self.trials, self.storage = conn, evaluator, trials, storage
        self.given: list[tuple[Any, ...]] = []
        self.handed_states: dict[int, tuple[Any, ...]] = {}
        self.left: set[int] = set()

    def directory(self, tid: int) -> str:
        """Where member ``tid``'s rounds are kept."""
        assert self.storage is not None
        storage, experiment = self.storage
        return storage.trial_directory(experiment, tid)

    def checkpoint(self, reports: Sequence[UnitReport]) -> None:
        if self.storage is not None:
            for r in reports:
                self.storage[0].save_round(self.directory(r.trial_id), r.step, r.metrics or {},
                                           r.unit.state_dict(r.trial_id), r.unit.jobs[r.trial_id].sample)

    def judge(self, reports: Sequence[UnitReport]) -> list[Verdict]:
        asks = [Report(r.trial_id, r.step, dict(r.metrics), r.seconds, r.last) for r in reports if r.metrics is not None]
        answers: dict[int, str] = {}
        self.given = []
        if asks:
            self.conn.send(Round(asks))
            message = self.conn.recv()
            if not isinstance(message, Verdicts):
                raise RuntimeError(f"the driver answered a round with {type(message).__name__}")
            answers, self.given = message.answers, message.forks
        return [Verdict.DONE if r.metrics is None else Verdict(answers[r.trial_id]) for r in reports]

    def forks(self, reports: Sequence[UnitReport]) -> list[tuple[UnitReport, Fork]]:
        going = {r.trial_id: r for r in reports}
        out = []
        for tid, source, sample, handed in self.given:
            if tid in going:
                if handed is not None:
                    self.handed_states[tid] = handed
                out.append((going[tid], Fork(source, sample)))
        return out

    def handed(self, report: UnitReport, fork: Fork) -> ExecutionUnit | None:
        entry = self.handed_states.pop(report.trial_id, None)
        if entry is None:
            return None
        seed, sample, model, state = entry
        return handed_source(self.evaluator, fork.source, seed, sample, pickle.loads(model), load_bytes(state))

    def forked(self, report: UnitReport, fork: Fork) -> None:
        self.conn.send(Forked(report.trial_id, fork.source, report.step, fork.sample))

    def _info(self, tid: int) -> dict[str, Any]:
        info = self.trials[tid].info
        return {k: info[k] for k in _INFO if k in info}

    def failed(self, unit: ExecutionUnit | None, trial_id: int, err: BaseException | str) -> None:
        if trial_id not in self.left:
            self.left.add(trial_id)
            text = err if isinstance(err, str) else error_text(err)
            self.conn.send(Left(trial_id, Outcome("error", error=text, info=self._info(trial_id))))

    def finished(self, report: UnitReport, verdict: Verdict) -> None:
        tid = report.trial_id
        if tid in self.left:
            return
        self.left.add(tid)
        if verdict.finishes:
            weights = report.unit.weights(tid)
            self.conn.send(Left(tid, Outcome("done", weights=state_bytes(weights), info=self._info(tid))))
        else:   # dropped (already failed on the driver)
            self.conn.send(Left(tid, Outcome("dropped")))


def _call(conn: Connection, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One stage-store call to the driver through the pipe, and its answer."""
    conn.send(ArchiveCall(name, args, kwargs))
    reply = conn.recv()
    if not isinstance(reply, ArchiveAnswer):
        raise RuntimeError(f"the driver answered a stage-store call with {type(reply).__name__}")
    return reply.result


def serve_unit(conn: Connection, message: RunUnit, evaluators: Mapping[int, Evaluator]) -> None:
    """Worker side of a unit placement: plan the members again (the driver's settings, the pool's
    optimizations), train them in lockstep, answer the driver's state requests, then say :class:`~._messages.End`."""
    members, settings, optimizations, experiment = message.members, message.settings, message.optimizations, message.experiment
    evaluator = evaluators[message.token]
    torch.set_num_threads(1)
    conn.send(Started())
    jobs = [Job(trial, pickle.loads(model), max_steps, start_from=load_bytes(state))
            for trial, model, max_steps, state in members]
    storage = None if message.storage is None else (CheckpointStorage(message.storage[0]), message.storage[1])
    judge = PipeJudge(conn, evaluator, {job.trial.id: job.trial for job in jobs}, storage)  # type: ignore[arg-type]
    try:
        if not isinstance(evaluator, StepwiseEvaluator):
            raise TypeError(f"units train step-wise evaluators, not {type(evaluator).__name__}")
        if message.resume and storage is not None:
            units = resume_units(jobs, evaluator, judge, lambda tid: storage[0].last_round(judge.directory(tid)),
                                 "restarted on a fresh worker from the members' last rounds")
            run_lockstep(units, judge)
            conn.send(End())
            return
        from .. import xopt

        optimize: Any = False if settings is None else xopt.Settings.from_dict(settings)
        chosen = [o for o in xopt.OPTIMIZATIONS if o.name in optimizations]
        relay = None if experiment is None else ArchiveRelay(lambda name, args, kwargs: _call(conn, name, args, kwargs),
                                                             experiment, state_bytes, load_bytes)
        planning = PlanContext(settings=optimize or None, archive=relay)   # the worker's own, for these units
        units, failed = plan_units(jobs, evaluator, optimize, optimizations=chosen, passes=(), context=planning)
        for job, err in failed:
            judge.failed(None, job.trial.id, err)
        run_lockstep(units, judge)
    except Exception as err:  # planning failed, or the pipe broke: every member still here fails with it
        text = error_text(err)
        for job in jobs:
            with contextlib.suppress(OSError):
                judge.failed(None, job.trial.id, text)
    conn.send(End())
