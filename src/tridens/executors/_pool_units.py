"""What the process pool trains, as placements of the one driver (:class:`~._driver.LockstepDriver`;
:class:`PoolPlacement`: a site runs in a free worker slot): a trial alone in a worker
(:class:`TrialRun`: a user's loop, reporting step by step), or units: trials of a declarative
evaluator that train together in one worker, epoch by epoch, as the in-process executor trains
them (:func:`~._execution.run_lockstep`).

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

Messages (:mod:`._messages`), driver -> worker: ``RunTrial`` (each ``Report`` answered by an ``Answer``),
``RunUnit``, ``ArchiveAnswer``, ``Verdicts``. Worker -> driver: ``Started``, ``Report``,
``ArchiveCall``, ``Round``, ``Forked``, ``Left``, ``End``.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ..errors import StorageFault
from ..evaluators import Evaluator, StepwiseEvaluator
from ..store import storage_fault
from ..trial import Trial
from ..units import Job, PlanContext
from ._lockstep import (LockstepJudge, UnitReport, load_bytes, model_bytes, plan_units,
                        resume_units, run_lockstep, state_bytes)
from ._channel import ChannelClosed, PipeChannel
from ._messages import (ArchiveAnswer, ArchiveCall, End, Forked, Left, Outcome, Report, Round, RunTrial, RunUnit,
                        Started, Verdicts)
from ._driver import LockstepDriver, Placement, Site
from ._protocol import GroupHooks, TrialProtocol, error_text
from ._ray_storage import CheckpointStorage
from ._stage_relay import ArchiveRelay, PlanningView

if TYPE_CHECKING:
    from ._execution import ProcessExecutor

__all__ = ["PoolPlacement", "TrialRun", "UnitRun", "serve_unit", "PipeLink", "POOL_OPTIMIZATIONS"]

log = logging.getLogger("tridens")

POOL_OPTIMIZATIONS = ("stage tree",)
"""The optimizations (by name, of :data:`tridens.xopt.OPTIMIZATIONS`) the process pool trains as units."""

_INFO = ("stages", "stage_store", "unit")
"""What a worker's unit writes into ``trial.info`` that goes back to the driver with the outcome."""


def _optimizations() -> list[Any]:
    from .. import xopt

    return [o for o in xopt.OPTIMIZATIONS if o.name in POOL_OPTIMIZATIONS]


# -- the driver --------------------------------------------------------------------------------------
class PoolPlacement(Placement):
    """The process pool as a :class:`~._driver.Placement`: each site runs in a free worker slot
    (started, or restarted after a death), which holds the evaluator; :meth:`start` tells the
    worker what to train. A site whose worker died fails (``retries`` 0) unless a subclass retries it."""

    name, process, where = "a pool worker", "worker process", "in its worker"
    retries = 0

    def __init__(self, executor: ProcessExecutor, evaluator: Evaluator):
        self.executor, self.evaluator = executor, evaluator
        self.slots = executor.workers
        self.held: dict[int, int] = {}   # id(site) -> the worker slot it runs in

    def launch(self, site: Site) -> PipeChannel:
        slot = next(slot for slot in range(self.slots) if slot not in self.held.values())
        self.held[id(site)] = slot
        worker = self.executor.worker(slot)
        try:
            self.start(site, self.executor.ship(worker, self.evaluator), worker.channel)
        except ChannelClosed:  # died meanwhile: read as its death
            pass
        return worker.channel

    def start(self, site: Site, token: int, channel: PipeChannel) -> None:
        """Send ``site``'s work to its worker (which holds the evaluator under ``token``)."""
        raise NotImplementedError

    def kill(self, site: Site) -> None:
        slot = self.held.pop(id(site), None)
        if slot is not None:
            self.executor.replace(slot)

    def release(self, site: Site) -> None:
        self.held.pop(id(site), None)


class TrialRun(PoolPlacement):
    """One TrialGroup on the pool a trial per worker (a user's loop, or a step-wise trial alone):
    each trial a site of one member (:class:`~._messages.RunTrial`) timed by the wall clock; a
    trial whose worker died fails, and the next one gets a fresh worker.

    >>> TrialRun(executor, evaluator).run(jobs, hooks)   # doctest: +SKIP
    """

    def run(self, jobs: Sequence[Job], hooks: GroupHooks) -> None:
        sites = [Site({job.trial.id: TrialProtocol(job, hooks, clock="wall")}, job) for job in jobs]
        LockstepDriver(self, lockstep=False).run(sites)

    def start(self, site: Site, token: int, channel: PipeChannel) -> None:
        job: Job = site.data
        channel.send(RunTrial(job.trial.id, token, model_bytes(job.model), job.trial.sample, job.trial.seed,
                              job.max_steps, state_bytes(job.start_from)))


@dataclass
class _Unit:
    """What a site's worker is started with: the run's xopt settings as plain data (None: trained separately)."""

    settings: dict[str, Any] | None


class UnitRun(PoolPlacement):
    """One TrialGroup on the pool as units (see the module docstring); :meth:`plan` says whether
    the group needs it, :meth:`run` trains it: the pool is the :class:`~._driver.Placement` of a
    :class:`~._driver.LockstepDriver` (each unit a site in a worker slot), whose members' outcomes
    go through their :class:`~._protocol.TrialProtocol`."""

    retries = 1   # a unit whose worker died is retried once (a population from its last rounds)

    def __init__(self, executor: ProcessExecutor, evaluator: StepwiseEvaluator, hooks: GroupHooks,
                 models: Mapping[int, bytes], sites: list[Site], forks: bool, archive: Any, order: Sequence[int]):
        super().__init__(executor, evaluator)
        self.hooks = hooks
        self.models, self.sites, self.forks, self.archive, self.order = models, sites, forks, archive, order
        self.resumes = "from the members' last rounds" if forks else ""
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
        order = [job.trial.id for job in jobs]

        def alone(job: Job) -> Site:
            return Site({job.trial.id: lives[job.trial.id]}, _Unit(None))

        if forks:   # every member at once: as many units as workers, members dealt in turn
            count = min(executor.workers, len(jobs))
            return cls(executor, evaluator, hooks, models,
                       [Site({j.trial.id: lives[j.trial.id] for j in jobs[i::count]}, _Unit(plain))
                        for i in range(count)], True, archive, order)
        fresh = [job for job in jobs if job.start_from is None]
        sites = [alone(job) for job in jobs if job.start_from is not None]
        rest, fused = list(fresh), []
        view = planning.with_archive(None if archive is None else PlanningView(archive))
        for optimization in _optimizations():
            made, rest = optimization.plan(rest, evaluator, settings=settings, context=view)
            fused.extend(made)
        if not fused:
            return None
        for unit in fused:
            log.info("process pool: %s", unit.summary())
            sites.append(Site({t: lives[t] for t in unit.jobs}, _Unit(plain)))
        sites += [alone(job) for job in rest]
        return cls(executor, evaluator, hooks, models, sites, False, archive, order)

    def run(self) -> None:
        self._tidy()   # what an earlier (crashed) run of these trials left: they train from their start
        try:
            LockstepDriver(self, lockstep=self.forks, order=self.order, archive=self.archive).run(self.sites)
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

    # -- the placement -------------------------------------------------------------------------------
    def start(self, site: Site, token: int, channel: PipeChannel) -> None:
        unit: _Unit = site.data
        members = [(life.trial, self.models[tid], life.job.max_steps, state_bytes(life.job.start_from))
                   for tid, life in site.lives.items()]
        experiment = None if self.archive is None or unit.settings is None else self.archive.experiment
        storage = None if self.storage is None else (self.storage.root, self.experiment)
        channel.send(RunUnit(token, members, unit.settings, POOL_OPTIMIZATIONS, experiment, storage, site.resume))

    def model(self, trial_id: int) -> bytes:
        return self.models[trial_id]

    def state_of(self, site: Site, trial_id: int, step: int) -> Any:
        """Member ``trial_id``'s trainer state of ``step``, as its worker wrote it before reporting the round."""
        assert self.storage is not None
        try:
            return self.storage.round_of(self.storage.trial_directory(self.experiment, trial_id), step)
        except (OSError, KeyError) as err:
            log.info("the state of trial %d after step %d is not in storage (%s): it is the source of no fork",
                     trial_id, step, err)
            return None


# -- the worker ---------------------------------------------------------------------------------------
class PipeLink:
    """A pool worker's (or a forked process's, :mod:`._forked`) end of the pipe to the driver, as
    its :class:`~._lockstep.LockstepJudge` talks through it (a :class:`~._lockstep.DriverLink`):
    each round's reports go to the driver, whose answer holds the verdicts and the forks; a
    member's outcome goes back with its weights (``torch.save`` bytes). With ``storage`` (a
    population's worker: ``(storage, experiment)``) each member's state of a round is written
    there before the round is reported."""

    def __init__(self, conn: Connection, trials: Mapping[int, Trial], storage: tuple[CheckpointStorage, str] | None = None):
        self.conn, self.trials, self.storage = conn, trials, storage

    def directory(self, tid: int) -> str:
        """Where member ``tid``'s rounds are kept."""
        assert self.storage is not None
        storage, experiment = self.storage
        return storage.trial_directory(experiment, tid)

    def keep(self, reports: Sequence[UnitReport]) -> None:
        """Each member's state of the round under storage; a full (or failing) disk there raises
        the one-line :class:`~tridens.errors.StorageFault` that stops the run (:meth:`halt`)."""
        if self.storage is not None:
            for r in reports:
                directory = self.directory(r.trial_id)
                try:
                    self.storage[0].save_round(directory, r.step, r.metrics or {}, r.unit.state_dict(r.trial_id),
                                               r.unit.jobs[r.trial_id].sample)
                except Exception as err:
                    fault = storage_fault(err, directory, f"keeping the state of trial {r.trial_id} after step {r.step}")
                    if fault is None:
                        raise
                    raise fault from err

    def halt(self, fault: StorageFault, left: set[int]) -> None:
        """A storage fault in this worker: every member still here (not in ``left``) is left
        unfinished and the run stops with the fault's line (the members train again on the next run)."""
        for tid in self.trials:
            if tid not in left:
                left.add(tid)
                self.conn.send(Left(tid, Outcome("fault", error=str(fault))))

    def round(self, reports: Sequence[Report]) -> Verdicts:
        self.conn.send(Round(list(reports)))
        message = self.conn.recv()
        if not isinstance(message, Verdicts):
            raise RuntimeError(f"the driver answered a round with {type(message).__name__}")
        return message

    def handed(self, handed: Any) -> tuple[int, dict[str, Any], Any, Mapping[str, Any]]:
        seed, sample, model, state = handed
        return seed, sample, pickle.loads(model), load_bytes(state)

    def forked(self, message: Forked) -> None:
        self.conn.send(message)

    def leave(self, tid: int, outcome: Outcome, weights: Mapping[str, Any] | None) -> None:
        info = self.trials[tid].info
        self.conn.send(Left(tid, Outcome(outcome.kind, outcome.value, state_bytes(weights), outcome.error,
                                         {k: info[k] for k in _INFO if k in info})))


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
    link = PipeLink(conn, {job.trial.id: job.trial for job in jobs}, storage)
    judge = LockstepJudge(link, evaluator)  # type: ignore[arg-type]
    try:
        if not isinstance(evaluator, StepwiseEvaluator):
            raise TypeError(f"units train step-wise evaluators, not {type(evaluator).__name__}")
        if message.resume and storage is not None:
            units = resume_units(jobs, evaluator, judge, lambda tid: storage[0].last_round(link.directory(tid)),
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
    except StorageFault as fault:   # the disk under storage: no member's fault
        with contextlib.suppress(OSError):
            link.halt(fault, judge.left)
    except Exception as err:  # planning failed, or the pipe broke: every member still here fails with it
        text = error_text(err)
        for job in jobs:
            with contextlib.suppress(OSError):
                judge.failed(None, job.trial.id, text)
    conn.send(End())
