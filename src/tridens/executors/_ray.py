"""The Ray executor: execution units as Ray tasks on a local Ray or on an existing cluster.

Workers train, the driver decides. A worker trains one epoch (or runs the user's loop up to its
next ``td.report``), writes a checkpoint to ``storage``, and posts the step's metrics to a small
hub actor; the driver drains the hub, records the metrics (it alone writes the store and talks
to the strategy) and answers with the strategy's decision, which the worker reads before its next
step. A task whose worker dies (killed, out of memory, node lost) starts again on another worker
from its last checkpoints, at most ``max_retries`` times; the steps already reported are not
recorded twice.

**Units.** With a declarative (step-wise) evaluator the driver plans the group as the in-process
executor does (:mod:`._planner`, the same log line per unit). Each fused unit (batched,
shared-pipeline, mixed, super-graph) is ONE Ray task that reports every member's metrics each
epoch and gets every member's decision: a stopped member leaves, the others go on. Trials that
train separately (the planner's separate unit, or ``optimize=False``) are one task each, so the
workers run them in parallel. A unit whose worker died restarts its unfinished members as
separate trials from their checkpoints (fused units cannot resume mid-way; see
:mod:`._ray_units`). User loops (other evaluators) run one trial per task.

**Fluid** (``allocation=``): each trial's share of the ``workers`` devices becomes its task's
resource request: a share below 1 a fractional ``num_cpus`` (``num_gpus`` when the evaluator
trains on CUDA), so Ray packs tasks; a share above 1 one task reserving ``share`` devices that
trains the trial with torch DDP over as many local processes (one node, gloo). DynamicFluid moves
a trial at an epoch boundary: its task checkpoints and ends, a new task at the new share resumes.

Differences from the in-process executor, by design: rung decisions are made as results arrive
(asynchronously, as in ASHA) rather than after the whole group reported a step, so which trials an
early-stopping strategy stops may differ. A trial's metrics for the steps it trains are those of
the in-process run with the same seed (bit for bit for separate trials; fused units and DDP as the
in-process fused units and DDP are, to float summation order).

The parts: checkpoints under ``storage`` (:mod:`._ray_storage`), the messages between workers and
the driver (:mod:`._ray_hub`), unit tasks (:mod:`._ray_units`), user loops (:mod:`._ray_trials`),
Fluid shares (:mod:`._ray_fluid`) and the local Ray started on 127.0.0.1 (:mod:`._ray_local`);
this module holds the executor and its driver loop over unit tasks.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import ray

from ..evaluators import Evaluator, StepwiseEvaluator
from ..units import Job, PlanContext
from ._base import Executor, RunContext, run_context as _context
from ..trial import Fork
from ._channel import HubChannel
from ._lockstep import RoundAnswers
from ._driver import decide_round
from ._messages import Answer, ArchiveAnswer, ArchiveCall, Forked, Left, Outcome, Posted, Report, Started
from ._protocol import GroupHooks, TrialProtocol, Verdict
from ._ray_fluid import FluidOnRay
from ._ray_hub import POLL_S, death_cause, start_hub
from ._ray_storage import CheckpointStorage
from ._ray_trials import UserLoopGroup
from ._stage_relay import PlanningView, answer_archive_call
from ._watchdog import check_silence, death_error, ended_error, for_trial, settle

__all__ = ["RayExecutor"]

log = logging.getLogger("tridens")


@dataclass
class _Member:
    """The driver's view of one trial of a unit."""

    life: TrialProtocol
    model: bytes                              # the model as it was before planning (what workers rebuild)
    yielded: bool = False                     # left its task to move to a new Fluid share
    limit: int | None = None                  # (Fluid) epochs it trains in all

    @property
    def job(self) -> Job:
        return self.life.job

    @property
    def done(self) -> bool:
        """Finished in the store."""
        return self.life.finished


@dataclass
class _UnitTrack:
    """The driver's view of one unit task: its members, its attempts and resources."""

    members: dict[int, _Member]
    optimize: bool = True
    planned: str = "separate"                 # the kind of unit the driver's planner made
    settings: Any = None                      # the run's xopt.Settings as plain data, batching as the driver decided
    attempt: int = 0
    ref: Any = None
    resume: bool = False
    resources: dict[str, float] = field(default_factory=dict)
    world: int = 1                            # DDP ranks (a Fluid share above 1)
    started: float = math.inf
    last_message: float = math.inf
    deaths: list[str] = field(default_factory=list)

    def unfinished(self) -> list[_Member]:
        return [m for m in self.members.values() if not m.done]


class RayExecutor(Executor):
    """Trials as Ray tasks, at most ``workers`` at a time, each asking for ``cpus_per_trial``
    CPUs (and a share of a GPU where the cluster has GPUs).

    With a declarative (step-wise) evaluator the planner's units run as tasks: with ``optimize``
    every fused unit (batched, shared-pipeline, mixed, super-graph) is ONE task reporting each
    member's metrics and receiving each member's decision; trials that train separately are one
    task each (see :mod:`._ray_units` for checkpoints and restarts). With ``allocation``
    (``"static"``, ``"dynamic"`` or a :class:`~tridens.engine.StaticFluid`) each trial gets a
    Fluid share of the ``workers`` devices (CPUs, or the cluster's GPUs when the evaluator trains
    on CUDA), turned into its task's resource request: a share below 1 asks for that fraction of a
    CPU (GPU), so Ray packs several tasks on one; a share above 1 is one task reserving ``share``
    devices that trains the trial with torch DDP over that many local processes (one node).
    DynamicFluid moves a trial to a new share at an epoch boundary: its task checkpoints and ends,
    and a new task at the new share resumes from the checkpoint. Under Fluid trials are not fused.

    ``address=None`` starts a local Ray with ``workers`` CPUs (no dashboard, quiet logs, every
    process listening on 127.0.0.1 only: :mod:`._ray_local`) and stops it on :meth:`close`; an
    address (``"host:port"``, ``"auto"``, ``"ray://host:10001"``) joins a running cluster as given.
    A Ray already started in this process is used as it is. Checkpoints go to ``storage`` (a
    directory every worker sees, or an fsspec URI such as ``s3://bucket/runs``).
    The space, evaluator and model are pickled to the workers: define them at module level.

    A stage tree's stages are stored in and reused from the experiment's store through the driver
    (:mod:`._stage_relay`; checkpoints handed through ``storage``). A strategy that forks members
    (PBT) has its population dealt over ``workers`` tasks running at once; the driver answers a
    round only when every member has reported it, and an exploit of a member of another task forks
    from that member's checkpoint of the step, copied through ``storage`` (:meth:`_barrier`).

    >>> exp = td.Experiment(space, evaluator, td.strategy.ASHA(max_steps=9),
    ...                     executor=td.executors.Ray(workers=4, max_retries=2))   # doctest: +SKIP
    >>> exp = td.Experiment(space, evaluator,
    ...                     executor=td.executors.Ray(workers=4, allocation="dynamic"))  # doctest: +SKIP
    """

    forks_members = True

    def __init__(self, workers: int = 2, address: str | None = None, storage: str | os.PathLike[str] | None = None,
                 max_retries: int = 0, experiment: str | None = None, cpus_per_trial: float = 1.0,
                 optimize: Any = None, allocation: Any = None, max_unit_memory: int | str | None = None):
        self.workers = workers
        self.max_unit_memory = max_unit_memory  # a fused unit's bound (None: the environment's, else half the RAM)
        self.address = address
        self.storage = storage  # None: the experiment's folder beside its store
        self.max_retries = max_retries
        self.experiment = experiment  # None: the experiment's name
        self.cpus_per_trial = cpus_per_trial
        self.optimize = optimize  # None: the experiment's
        self.allocation = allocation  # None: the experiment's
        self._started_ray = False
        self._hub: HubChannel | None = None   # the driver's end of the hub every task posts to
        self._evaluator: tuple[Any, Any] | None = None  # (evaluator, its object ref): one copy for all groups
        self._archive: Any = None  # the run's stage store (tridens.store.StageArchive) while a group runs
        # a population's last answer per member (the handed source's seed, sample, model, state
        # with it), given again when a restarted task asks for that step again
        self._answered = RoundAnswers()
        self._order: dict[int, int] = {}   # trial id -> its place in the group (a population's round order)

    @property
    def parallelism(self) -> int:  # type: ignore[override]
        return self.workers

    def start(self, context: RunContext) -> None:
        """Take the run's name, checkpoint folder, optimizations and allocation where none was given here."""
        super().start(context)
        self._stale = True  # what an earlier run of the experiment left under storage= goes first
        if self.experiment is None:
            self.experiment = context.experiment
        if self.storage is None:
            self.storage = context.storage
        if self.optimize is None:
            self.optimize = context.optimize
        if self.allocation is None:
            self.allocation = context.allocation

    # -- Ray ---------------------------------------------------------------------------------
    def _connect(self) -> None:
        if self._hub is not None:
            return
        if self.storage is None:
            raise ValueError("The 'storage' parameter of RayExecutor must be a directory or an fsspec URI. Got None instead.")
        if self.experiment is None:
            self.experiment = "experiment"
        if self.optimize is not False:  # one frozen tridens.xopt.Settings for the run (True: the environment's)
            from ..xopt import resolve_settings

            self.optimize = resolve_settings(True if self.optimize is None else self.optimize) or False
        if self.allocation is not None:
            from ._fluid import fluid_policy

            fluid_policy(self.allocation).scheduler(max(self.workers, 1))  # checks the policy's parameters
        if not ray.is_initialized():
            say = getattr(getattr(self, "context", None), "say", lambda text: None)
            t0 = time.perf_counter()
            if self.address is None:
                from ._ray_local import start_local_ray

                say(f"starting a local Ray for {self.workers} worker(s) on 127.0.0.1 (its processes take seconds "
                    "to start)")
                start_local_ray(self.workers)  # every process listening on 127.0.0.1 only
                say(f"local Ray started in {time.perf_counter() - t0:.1f} s; starting its workers")
            else:
                say(f"connecting to the Ray cluster at {self.address}")
                ray.init(address=self.address, include_dashboard=False, logging_level=logging.ERROR,
                         configure_logging=True)
            self._started_ray = True  # ours to stop (a local Ray) or to disconnect from (a cluster)
        self._hub = HubChannel(start_hub())

    def _channel(self) -> HubChannel:
        assert self._hub is not None, "the executor connects to Ray before it runs a group"
        return self._hub

    def _resources(self) -> dict[str, float]:
        gpus = float(ray.cluster_resources().get("GPU", 0.0))
        out = {"num_cpus": self.cpus_per_trial}
        if gpus > 0:  # a share of a GPU when there are more trials at once than GPUs
            out["num_gpus"] = min(1.0, gpus / self.workers)
        return out

    def close(self) -> None:
        if self._hub is not None:
            self._hub.close()
            self._hub = None
        self._evaluator = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    # -- running a group ---------------------------------------------------------------------
    def run_group(self, jobs: Sequence[Job], evaluator: Evaluator, hooks: GroupHooks) -> None:
        self._connect()
        storage = CheckpointStorage(os.fspath(self.storage))  # type: ignore[arg-type]
        if getattr(self, "_stale", False):  # a crashed run's checkpoints and hand-offs: never read again
            storage.discard(storage.join(str(self.experiment)))
            self._stale = False
        try:
            self._run_group(jobs, evaluator, hooks, storage)
        finally:
            self._tidy(jobs, storage)

    def _tidy(self, jobs: Sequence[Job], storage: CheckpointStorage) -> None:
        """After a group: the folders of its finished trials (their weights are in the store) and
        the hand-offs no task will read any more are removed."""
        experiment = str(self.experiment)
        for job in jobs:
            if job.trial.status.finished:
                storage.discard(storage.trial_directory(experiment, job.trial.id))
        storage.discard(storage.join(experiment, "handoff"))

    def _run_group(self, jobs: Sequence[Job], evaluator: Evaluator, hooks: GroupHooks, storage: CheckpointStorage) -> None:
        if self._evaluator is None or self._evaluator[0] is not evaluator:
            self._evaluator = (evaluator, ray.put(evaluator))  # its datasets travel to the object store once
        evaluator_ref = self._evaluator[1]
        if isinstance(evaluator, StepwiseEvaluator):
            self._run_units(jobs, evaluator, evaluator_ref, storage, hooks)
        else:
            if self.allocation is not None and jobs:
                log.warning("allocation=%r places the trials of declarative evaluators only; this evaluator's "
                            "trials run one per task with %s CPU(s)", self.allocation, self.cpus_per_trial)
            UserLoopGroup(self._channel(), evaluator_ref, storage, str(self.experiment), workers=self.workers,
                          max_retries=self.max_retries, resources=self._resources()).run(jobs, hooks)

    # -- units (declarative evaluators) --------------------------------------------------------
    def _units(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, lives: Mapping[int, TrialProtocol]
               ) -> list[_UnitTrack]:
        """The group's unit tasks: the planner's fused units, one task each; separate trials (and
        trials forked from another member's state) one each."""
        # Pickled before planning may tie or move them; by value where defined in __main__ (a script).
        models = {job.trial.id: ray.cloudpickle.dumps(job.model) for job in jobs}

        def alone(job: Job) -> _UnitTrack:
            return _UnitTrack({job.trial.id: _Member(lives[job.trial.id], models[job.trial.id])}, optimize=False)

        if self._forks():   # the population at once, dealt over the workers (see _barrier)
            count = min(self.workers, len(jobs))
            return [_UnitTrack({j.trial.id: _Member(lives[j.trial.id], models[j.trial.id]) for j in jobs[i::count]},
                               optimize=False, planned="population") for i in range(count)]
        fresh = [job for job in jobs if job.start_from is None]
        tracks = [alone(job) for job in jobs if job.start_from is not None]
        if not self.optimize or self.allocation is not None:
            return tracks + [alone(job) for job in fresh]
        from ._planner import plan

        # stage trees are planned from the stored rows (PlanningView); the tasks load and store
        # stages through the hub (answered by _handle_unit)
        planning = self._planning().with_archive(None if self._archive is None else PlanningView(self._archive))
        units = plan(fresh, evaluator, self.optimize, context=planning) if fresh else []
        units = self._spread(units, evaluator, planning)
        for unit in units:
            described = unit.describe()
            if described["kind"] == "separate":  # nothing shared: each trial its own task, in parallel
                tracks.extend(alone(job) for job in unit.jobs.values())
                continue
            # The worker plans the unit's trials again: batching as decided here (a measured
            # speed-up could come out differently there), everything else as configured.
            settings = self.optimize.with_batching(mode=described["batching"]).as_dict()
            tracks.append(_UnitTrack({t: _Member(lives[t], models[t]) for t in unit.jobs},
                                     planned=described["kind"], settings=settings))
        return tracks

    def _spread(self, units: list[Any], evaluator: StepwiseEvaluator, planning: PlanContext) -> list[Any]:
        """Fewer tasks than workers: units split until every worker has a task (a separate unit's
        trials are a task each)."""
        from ._planner import spread_units

        return spread_units(units, evaluator, self.optimize, self.workers, separate_tasks=True, by_members=False,
                            context=planning)

    def _planning(self) -> PlanContext:
        """The run's plan context (:class:`~tridens.units.PlanContext`)."""
        return _context(self).plan

    def _run_units(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, evaluator_ref: Any, storage: CheckpointStorage,
                   hooks: GroupHooks) -> None:
        self._archive = self._planning().archive if self.optimize else None
        fluid = None
        lives = {job.trial.id: TrialProtocol(job, hooks, clock="train") for job in jobs}
        tracks = self._units(jobs, evaluator, lives)
        held: dict[int, tuple[_UnitTrack, int, Report]] | None = {} if self._forks() else None
        self._order = {job.trial.id: i for i, job in enumerate(jobs)}
        self._answered.clear()
        if self.allocation is not None and held is None:
            fluid, tracks = FluidOnRay.profile(self.allocation, self.workers, tracks, evaluator)
        queue = list(tracks) if fluid is None else []
        waiting = {next(iter(t.members)): t for t in tracks} if fluid is not None else {}
        running: list[_UnitTrack] = []
        owner: dict[int, _UnitTrack] = {}  # trial id -> its running task's track
        hub = self._channel()
        try:
            while queue or running or waiting:
                if fluid is not None:
                    for placement in fluid.sched.schedule():
                        track = waiting.pop(placement.key)
                        fluid.place(track, placement.share, self.cpus_per_trial)
                        queue.append(track)
                while queue and (fluid is not None or len(running) < self.workers):
                    track = queue.pop(0)
                    if fluid is None:
                        track.resources = self._resources()
                    self._launch_unit(track, evaluator_ref, storage)
                    running.append(track)
                    owner.update({m.job.trial.id: track for m in track.unfinished()})
                for message in hub.receive_all(POLL_S):
                    self._handle_unit(message, owner, storage, fluid, held)
                if held is not None:
                    self._barrier(running, held, storage)
                refs = {t.ref: t for t in running}
                done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                for ref in done:
                    track = refs[ref]
                    # messages posted before the task returned are in the hub: read them first
                    for message in hub.receive_all(0):
                        self._handle_unit(message, owner, storage, fluid, held)
                    if self._unit_done(track, ref, storage, fluid):
                        running.remove(track)
                        for member in track.members.values():
                            owner.pop(member.job.trial.id, None)
                            if fluid is not None and member.yielded and not member.done:
                                member.yielded = False
                                track.attempt += 1
                                track.resume = True
                                fluid.sched.release(member.job.trial.id, fluid.remaining(member))
                                waiting[member.job.trial.id] = track
                    else:  # its worker died: again, from the members' last checkpoints
                        self._launch_unit(track, evaluator_ref, storage)
                self._unit_timeout(running, fluid)
        finally:
            for track in running:  # interrupted (Ctrl-C, driver error): free the workers
                ray.cancel(track.ref, force=True)

    def _launch_unit(self, track: _UnitTrack, evaluator_ref: Any, storage: CheckpointStorage) -> None:
        from ..units import configured_max_unit_memory
        from ._ray_units import run_unit

        members = []
        for member in track.unfinished():
            trial = member.job.trial
            trial.info["storage"] = storage.trial_directory(str(self.experiment), trial.id)
            members.append({"trial": trial, "model": member.model, "max_steps": member.job.max_steps,
                            "directory": trial.info["storage"], "start_from": member.job.start_from})
        stages = self._archive is not None and track.optimize and not track.resume
        spec = {"attempt": track.attempt, "root": storage.root, "cpus": track.resources.get("num_cpus", 1.0),
                "stages": self._archive.experiment if stages else None, "experiment": str(self.experiment),
                "optimize": track.optimize and not track.resume, "resume": track.resume, "members": members,
                "max_unit_memory": configured_max_unit_memory(self._planning().max_unit_memory), "world": track.world, "planned": track.planned,
                "settings": track.settings,
                "limit": next(iter(track.members.values())).limit}
        track.started = track.last_message = math.inf
        track.ref = run_unit.options(**track.resources).remote(evaluator_ref, spec, self._channel().hub)

    def _handle_unit(self, posted: Posted, owner: Mapping[int, _UnitTrack], storage: CheckpointStorage,
                     fluid: FluidOnRay | None, held: dict[int, Any] | None = None) -> None:
        attempt, (pid, node), message = posted.attempt, posted.worker, posted.message
        trial_id = message.trial_id
        track = owner.get(trial_id)
        if track is None or attempt != track.attempt or trial_id not in track.members:
            return  # a message of a task already given up on
        member = track.members[trial_id]
        life = member.life
        track.last_message = time.monotonic()
        if track.started == math.inf:
            track.started = track.last_message
        if isinstance(message, Started):
            life.trial.info["ray"] = {"pid": pid, "node": node, "attempt": attempt,
                                      "resources": dict(message.resources or {})}
            life.start()
            return
        if isinstance(message, Left):
            self._member_left(member, message.outcome, storage, fluid)
            return
        if isinstance(message, ArchiveCall):   # a stage tree's stage-store call; checkpoints travel through storage
            experiment = str(self.experiment)
            self._channel().send(ArchiveAnswer(answer_archive_call(
                self._archive, message.method, message.args, message.kwargs,
                lambda state: storage.hand(experiment, state), storage.take, f"Ray task of trial {trial_id}"),
                message.key))
            return
        if isinstance(message, Forked):   # the member now continues from its source's state: its lineage
            origin = owner.get(message.source)
            if origin is not None and message.source in origin.members:
                life.forked(origin.members[message.source].life.trial, message.step,
                            Fork(message.source, message.sample))
            return
        step = message.step   # a Report
        if held is not None and not life.finished:   # answered with the whole population's round
            given = self._answered.again(trial_id, step)
            if given is not None:   # asked again by a restarted task: the same answer
                self._channel().send(Answer(trial_id, self._answer(*given, storage), step, attempt))
                return
            held[trial_id] = (track, attempt, message)
            return
        verdict = life.report(step, message.metrics, last=message.last, seconds=message.seconds)
        if fluid is not None:
            fluid.sched.progress(trial_id, fluid.remaining(member))
        if verdict is Verdict.DROP:  # past its timeout: failed by the protocol
            self._fluid_finish(fluid, trial_id)
        elif (fluid is not None and verdict is Verdict.CONTINUE and step == life.last_step
              and trial_id in fluid.sched.rescales()):
            verdict = Verdict.YIELD  # to its new share at this epoch boundary
            log.info("fluid on Ray: trial %d moves to share %g after epoch %d", trial_id,
                     fluid.sched.rescales()[trial_id], step + 1)
        self._channel().send(Answer(trial_id, verdict.value, step, attempt))

    def _forks(self) -> bool:
        """Whether the strategy forks members (PBT): the group's tasks then run at once, in lockstep."""
        return bool(getattr(getattr(self, "context", None), "forks", False))

    def _barrier(self, running: Sequence[_UnitTrack], held: dict[int, tuple[_UnitTrack, int, Report]],
                 storage: CheckpointStorage) -> None:
        """Once every training member of the population has reported its step: the round decided
        as one (:func:`~._driver.decide_round`, in the trials' order: every report recorded, then
        every verdict, then the strategy's forks), then every member's answer. A fork of a member
        of another task names the source's checkpoint of that step (written to ``storage=`` before
        it reported), copied for the forking task to take, with the source's seed, sample and
        model. Each member's answer is kept until its next round: a task restarted after its node
        died asks for that step again."""
        members = [m for t in running for m in t.unfinished() if not m.yielded]
        if not members or any(m.job.trial.id not in held for m in members):
            return
        rounds = dict(held)
        held.clear()
        order = sorted(rounds, key=lambda tid: (self._order.get(tid, len(self._order)), tid))
        decision = decide_round([(rounds[tid][0].members[tid].life, rounds[tid][2]) for tid in order])
        answers: dict[int, Any] = {tid: verdict.value for tid, verdict in decision.verdicts.items()}
        handed: dict[int, tuple[Any, ...]] = {}
        for tid, fork in decision.forks.items():
            source = rounds[fork.source]
            if source[0] is not rounds[tid][0]:   # another task: its state travels through storage
                origin = source[0].members[fork.source]
                step = source[2].step
                try:
                    state = storage.round_of(origin.job.trial.info["storage"], step)
                except (OSError, KeyError) as err:
                    state = None
                    log.info("trial %d not forked from trial %d: its checkpoint of step %d (%s)", tid, fork.source,
                             step, err)
                if state is None:
                    continue
                handed[tid] = (origin.job.trial.seed, origin.job.trial.sample, origin.model, state)
            answers[tid] = {"verdict": Verdict.CONTINUE.value, "source": fork.source, "sample": fork.sample}
        for tid in order:
            _, attempt, report = rounds[tid]
            self._answered.keep(tid, report.step, answers[tid], handed.get(tid))
            self._channel().send(Answer(tid, self._answer(answers[tid], handed.get(tid), storage), report.step, attempt))

    def _answer(self, answer: Any, handed: tuple[Any, ...] | None, storage: CheckpointStorage) -> Any:
        """A population member's answer; a source in another task handed over as a fresh file (the
        task takes it, and a restarted task takes its own)."""
        if handed is None:
            return answer
        seed, sample, model, state = handed
        return {**answer, "handed": (seed, sample, model, storage.hand(str(self.experiment), state))}

    @staticmethod
    def _fluid_finish(fluid: FluidOnRay | None, trial_id: int) -> None:
        if fluid is not None:
            fluid.sched.finish(trial_id)

    def _member_left(self, member: _Member, outcome: Outcome, storage: CheckpointStorage,
                     fluid: FluidOnRay | None) -> None:
        """A member's outcome (from its ``left`` message or the task's result; the first counts)."""
        if member.done or outcome.kind == "dropped":
            return
        if outcome.kind == "yielded":
            member.yielded = True
            return
        self._fluid_finish(fluid, member.job.trial.id)
        settle(member.life, outcome, storage.load)

    def _fail_unfinished(self, track: _UnitTrack, fluid: FluidOnRay | None, error: str) -> None:
        for member in track.unfinished():
            self._fluid_finish(fluid, member.job.trial.id)
            member.life.fail(for_trial(error, member.job.trial))

    def _unit_done(self, track: _UnitTrack, ref: Any, storage: CheckpointStorage, fluid: FluidOnRay | None) -> bool:
        """Record the outcomes of a finished unit task; False when its worker died and it runs again."""
        try:
            outcomes = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            return True  # cancelled by the timeout, already recorded
        except ray.exceptions.RayTaskError as err:  # raised outside the training (e.g. unpickling a model)
            self._fail_unfinished(track, fluid, str(err))
            return True
        except ray.exceptions.RayError as err:  # the worker process or its node died
            unfinished = track.unfinished()
            track.deaths.append(death_cause(err, unfinished[0].job.trial.info if unfinished else {}))
            ids = [m.job.trial.id for m in track.unfinished() if not m.yielded]
            for member in track.unfinished():
                member.job.trial.info["ray_restarts"] = len(track.deaths)
            if len(track.deaths) <= self.max_retries and ids:
                log.warning("trial(s) %s: their worker died (%s); restarting them from their last checkpoints, "
                            "as separate trials (retry %d of %d)", ids, type(err).__name__, len(track.deaths),
                            self.max_retries)
                track.attempt += 1
                track.resume = True
                return False
            self._fail_unfinished(track, fluid, death_error(
                "worker", f"max_retries={self.max_retries} allows no more restarts; last: {track.deaths[-1]}",
                times=len(track.deaths)))
            return True
        for trial_id, outcome in outcomes.items():
            if trial_id in track.members:
                self._member_left(track.members[trial_id], outcome, storage, fluid)
        for member in [m for m in track.unfinished() if not m.yielded]:
            self._fluid_finish(fluid, member.job.trial.id)
            member.life.fail(for_trial(ended_error("in its Ray task"), member.job.trial))
        return True

    def _unit_timeout(self, running: list[_UnitTrack], fluid: FluidOnRay | None) -> None:
        """A task silent for longer than ``trial_timeout`` hangs inside an epoch: cancel it (its
        members' epoch times are checked as they report, by their protocols)."""
        for track in list(running):
            members = track.unfinished()
            if track.last_message != math.inf and members:
                check_silence([m.life for m in members], track.last_message, functools.partial(self._kill_unit, track, fluid))

    def _kill_unit(self, track: _UnitTrack, fluid: FluidOnRay | None, error: str) -> None:
        ray.cancel(track.ref, force=True)
        self._fail_unfinished(track, fluid, error)
