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

Differences from the in-process executor, by design: rung decisions are made as each task's
round arrives (asynchronously, as in ASHA; a unit's members are decided as one round) rather than
after the whole group reported a step, so which trials an early-stopping strategy stops may differ. A trial's metrics for the steps it trains are those of
the in-process run with the same seed (bit for bit for separate trials; fused units and DDP as the
in-process fused units and DDP are, to float summation order).

The parts: checkpoints under ``storage`` (:mod:`._ray_storage`), the messages between workers and
the driver (:mod:`._ray_hub`, each task's :class:`~._channel.TaskChannel`), unit tasks
(:mod:`._ray_units`), user loops (:mod:`._ray_trials`), Fluid shares (:mod:`._ray_fluid`) and the
local Ray started on 127.0.0.1 (:mod:`._ray_local`); this module holds the executor and the
placement of its unit tasks (:class:`UnitTasks`), driven by the one lockstep driver
(:class:`~._driver.LockstepDriver`: the rounds, the barrier, forks, the hang check, deaths and retries).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import ray

from ..evaluators import Evaluator, StepwiseEvaluator
from ..units import Job, PlanContext
from ._base import Executor, RunContext, run_context as _context
from ._channel import HubChannel
from ._driver import LockstepDriver, Site
from ._protocol import GroupHooks, TrialProtocol
from ._ray_fluid import FluidOnRay
from ._ray_hub import start_hub
from ._ray_storage import CheckpointStorage
from ._ray_trials import RayTasks, TrialTasks
from ._stage_relay import PlanningView

__all__ = ["RayExecutor"]

log = logging.getLogger("tridens")


@dataclass
class _Task:
    """What a unit task is started with: whether the worker plans the members again with the
    run's optimizations (``settings``, batching as the driver decided: plain data) and what it
    should plan (``planned``), its resource request and DDP ranks (a Fluid share above 1), and
    whether Fluid gave it a share."""

    optimize: bool = True
    planned: str = "separate"
    settings: Any = None
    resources: dict[str, float] = field(default_factory=dict)
    world: int = 1
    placed: bool = False


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
    from that member's checkpoint of the step, copied through ``storage``. The unit tasks are a
    :class:`~._driver.Placement` of the one lockstep driver (:class:`UnitTasks`).

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
            TrialTasks(self._channel(), evaluator_ref, storage, str(self.experiment), workers=self.workers,
                       max_retries=self.max_retries, resources=self._resources()).run(jobs, hooks)

    # -- units (declarative evaluators) --------------------------------------------------------
    def _units(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, lives: Mapping[int, TrialProtocol]
               ) -> list[Site]:
        """The group's unit tasks: the planner's fused units, one task each; separate trials (and
        trials forked from another member's state) one each."""

        def alone(job: Job) -> Site:
            return Site({job.trial.id: lives[job.trial.id]}, _Task(optimize=False))

        if self._forks():   # the population at once, dealt over the workers, in lockstep
            count = min(self.workers, len(jobs))
            return [Site({j.trial.id: lives[j.trial.id] for j in jobs[i::count]}, _Task(optimize=False, planned="population"))
                    for i in range(count)]
        fresh = [job for job in jobs if job.start_from is None]
        sites = [alone(job) for job in jobs if job.start_from is not None]
        if not self.optimize or self.allocation is not None:
            return sites + [alone(job) for job in fresh]
        from ._planner import plan

        # stage trees are planned from the stored rows (PlanningView); the tasks load and store
        # stages through the hub (answered by the driver)
        planning = self._planning().with_archive(None if self._archive is None else PlanningView(self._archive))
        units = plan(fresh, evaluator, self.optimize, context=planning) if fresh else []
        units = self._spread(units, evaluator, planning)
        for unit in units:
            described = unit.describe()
            if described["kind"] == "separate":  # nothing shared: each trial its own task, in parallel
                sites.extend(alone(job) for job in unit.jobs.values())
                continue
            # The worker plans the unit's trials again: batching as decided here (a measured
            # speed-up could come out differently there), everything else as configured.
            settings = self.optimize.with_batching(mode=described["batching"]).as_dict()
            sites.append(Site({t: lives[t] for t in unit.jobs}, _Task(planned=described["kind"], settings=settings)))
        return sites

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
        # Pickled before planning may tie or move them; by value where defined in __main__ (a script).
        models = {job.trial.id: ray.cloudpickle.dumps(job.model) for job in jobs}
        forks = self._forks()
        fluid = None
        if self.allocation is not None and not forks:
            fluid = FluidOnRay.start(self.allocation, self.workers, jobs, evaluator)
            hooks = fluid.watch(hooks)
        lives = {job.trial.id: TrialProtocol(job, hooks, clock="train") for job in jobs}
        sites = self._units(jobs, evaluator, lives)
        if fluid is not None:
            sites = fluid.profile(sites, evaluator)
        tasks = UnitTasks(self, evaluator_ref, storage, models, fluid)
        LockstepDriver(tasks, lockstep=forks, order=[job.trial.id for job in jobs],
                       archive=self._archive).run(sites)

    def _forks(self) -> bool:
        """Whether the strategy forks members (PBT): the group's tasks then run at once, in lockstep."""
        return bool(getattr(getattr(self, "context", None), "forks", False))


class UnitTasks(RayTasks):
    """The :class:`~._driver.Placement` of a group's unit tasks: each site one Ray task
    (:func:`~._ray_units.run_unit`) asking for its resources -- at most ``workers`` at once, or as
    Fluid places them (``fluid``: each trial's share its task's request; a trial at a new share
    moves to a new task) -- on its own channel on the hub (:class:`~._channel.TaskChannel`). A
    task whose worker or node died starts again up to ``max_retries`` times, its unfinished
    members as separate trials from their last checkpoints; states travel as files under
    ``storage`` (a fork's source of another task: its checkpoint of the round, copied)."""

    resumes = "from the members' last checkpoints, as separate trials"

    def __init__(self, executor: RayExecutor, evaluator_ref: Any, storage: CheckpointStorage, models: Mapping[int, bytes],
                 fluid: FluidOnRay | None):
        super().__init__(executor._channel(), storage, str(executor.experiment), workers=executor.workers,
                         max_retries=executor.max_retries)
        self.executor, self.evaluator_ref, self.models, self.fluid = executor, evaluator_ref, models, fluid

    def admit(self, queue: Sequence[Site], running: int) -> list[Site]:
        """Without Fluid, as many as there are free workers; under Fluid, the sites whose trial the
        scheduler places now (at its share) and the sites placed before (started again)."""
        if self.fluid is None:
            return super().admit(queue, running)
        by_trial = {tid: site for site in queue for tid in site.lives}
        for placed in self.fluid.sched.schedule():
            site = by_trial[placed.key]
            task: _Task = site.data
            task.resources, task.world = self.fluid.place(site.lives[placed.key], placed.share,
                                                          self.executor.cpus_per_trial)
            task.placed = True
        return [site for site in queue if site.data.placed]

    def submit(self, site: Site, attempt: int) -> Any:
        from ..units import configured_max_unit_memory
        from ._ray_units import run_unit

        task: _Task = site.data
        if self.fluid is None:
            task.resources = self.executor._resources()
        members = [{"trial": life.trial, "model": self.models[tid], "max_steps": life.job.max_steps,
                    "directory": life.trial.info["storage"], "start_from": life.job.start_from}
                   for tid, life in site.lives.items()]
        archive = self.executor._archive
        stages = archive is not None and task.optimize and not site.resume
        first = next(iter(site.lives))
        spec = {"attempt": attempt, "root": self.storage.root, "cpus": task.resources.get("num_cpus", 1.0),
                "stages": archive.experiment if stages else None, "experiment": self.experiment,
                "optimize": task.optimize and not site.resume, "resume": site.resume, "members": members,
                "max_unit_memory": configured_max_unit_memory(self.executor._planning().max_unit_memory),
                "world": task.world, "planned": task.planned, "settings": task.settings,
                "limit": None if self.fluid is None else self.fluid.limits.get(first)}
        return run_unit.options(**task.resources).remote(self.evaluator_ref, spec, self.hub.hub)

    def release(self, site: Site) -> None:
        """The task returned: its channel is closed; a member that moves (Fluid) waits to be placed again."""
        super().release(site)
        if self.fluid is not None and site.lives:
            for tid, life in site.lives.items():
                self.fluid.sched.release(tid, self.fluid.remaining(tid, life.last_step))
            site.data.placed = False

    def moves(self, life: TrialProtocol, step: int) -> bool:
        return self.fluid is not None and self.fluid.moves(life, step)

    def model(self, trial_id: int) -> bytes:
        return self.models[trial_id]

    def state_of(self, site: Site, trial_id: int, step: int) -> Any:
        """Member ``trial_id``'s trainer state of ``step``, as its task wrote it under storage before reporting the round."""
        try:
            return self.storage.round_of(site.lives[trial_id].trial.info["storage"], step)
        except (OSError, KeyError) as err:
            log.info("the state of trial %d after step %d is not in storage (%s): it is the source of no fork",
                     trial_id, step, err)
            return None
