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

Storage layout (``storage`` is a directory every worker sees, or an fsspec URI)::

    <storage>/<experiment>/trial-<id>/epoch-<n>.pt   the latest per-epoch trainer checkpoint (step-wise evaluators)
    <storage>/<experiment>/trial-<id>/final.pt       the final (or stopped) weights
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import ray
import torch

from ..evaluators import Evaluator, StepwiseEvaluator
from ..trial import Decision
from ..units import Job
from ._execution import Executor, RunContext
from ._protocol import GroupHooks, TrialProtocol, TrialTimeout, Verdict, error_text, timeout_error

__all__ = ["RayExecutor"]

log = logging.getLogger("tridens")

_POLL_S = 0.05  # how long one drain of the hub waits for messages (the driver's reaction time)


def is_uri(location: str) -> bool:
    """``s3://...``, ``gs://...``, ``memory://...``: a location for fsspec, not a local path."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", location) is not None and not location.startswith("file://")


class _Storage:
    """Checkpoint files under one root, local or (with fsspec) remote. Writes are atomic: a file
    is written under a temporary name and renamed, so a worker killed mid-write leaves no torn file."""

    def __init__(self, root: str):
        self.root = root[len("file://"):] if root.startswith("file://") else root
        self.remote = is_uri(self.root)

    def _fs(self) -> Any:
        import fsspec

        return fsspec.core.url_to_fs(self.root)[0]

    def join(self, *parts: str) -> str:
        """A location under ``root``."""
        return "/".join([self.root.rstrip("/"), *parts]) if self.remote else os.path.join(self.root, *parts)

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

    def latest_epoch(self, directory: str) -> int | None:
        epochs = [int(m.group(1)) for name in self.listdir(directory) if (m := re.fullmatch(r"epoch-(\d+)\.pt", name))]
        return max(epochs) if epochs else None

    def clear(self, directory: str) -> None:
        for name in self.listdir(directory):
            self.remove(self.child(directory, name))


# -- the hub: messages from workers, answers from the driver ----------------------------------------
@ray.remote(num_cpus=0)
class _Hub:
    """Workers post messages and wait for answers; the driver drains messages and answers.

    An async actor: a worker waiting for its decision holds no thread, and a drain returns as
    soon as a message arrives (or after ``timeout`` seconds)."""

    def __init__(self) -> None:
        self.messages: list[tuple[Any, ...]] = []
        self.arrived = asyncio.Event()
        self.answers: dict[tuple[int, int, int], asyncio.Future] = {}

    def _future(self, key: tuple[int, int, int]) -> asyncio.Future:
        if key not in self.answers:
            self.answers[key] = asyncio.get_running_loop().create_future()
        return self.answers[key]

    async def post(self, message: tuple[Any, ...]) -> None:
        self.messages.append(message)
        self.arrived.set()

    async def ask(self, trial_id: int, attempt: int, step: int, metrics: dict[str, float], last: bool,
                  seconds: float, worker: tuple[int, str]) -> str:
        future = self._future((trial_id, attempt, step))
        await self.post(("report", trial_id, attempt, worker, step, metrics, last, seconds))
        try:
            return await future
        finally:
            self.answers.pop((trial_id, attempt, step), None)

    async def answer(self, trial_id: int, attempt: int, step: int, decision: str) -> None:
        future = self._future((trial_id, attempt, step))
        if not future.done():
            future.set_result(decision)

    async def drain(self, timeout: float) -> list[tuple[Any, ...]]:
        if not self.messages:
            try:
                await asyncio.wait_for(self.arrived.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        out, self.messages = self.messages, []
        self.arrived.clear()
        return out


# -- the worker side ---------------------------------------------------------------------------------
class _HubReporter:
    """The Reporter of a user loop on a worker: post the metrics, wait for the decision."""

    def __init__(self, hub: Any, spec: Mapping[str, Any], storage: _Storage):
        self.hub, self.spec, self.storage = hub, spec, storage
        self.mark = time.monotonic()  # training time is counted from here to the next report

    def report(self, step: int, metrics: Mapping[str, float]) -> Decision:
        metrics = {k: float(v) for k, v in metrics.items()}
        seconds = time.monotonic() - self.mark
        answer = ray.get(self.hub.ask.remote(self.spec["trial_id"], self.spec["attempt"], step, metrics, False, seconds,
                                             self.spec["worker"]))
        self.mark = time.monotonic()
        if answer == Verdict.DROP.value:  # past its timeout: the driver failed it
            raise TrialTimeout()
        return Decision.STOP if answer == Verdict.STOP.value else Decision.CONTINUE


@ray.remote(max_retries=0)
def _run_trial(evaluator: Evaluator, model: Any, spec: dict[str, Any], hub: Any) -> dict[str, Any]:
    """Run one trial of a user loop (a non-step-wise evaluator) on a worker. Errors of the
    training itself are returned (the trial failed); only the worker's death raises on the driver
    (and restarts the trial). Step-wise evaluators run as units (:mod:`._ray_units`)."""
    torch.set_num_threads(max(1, int(spec["cpus"])))
    # Every message names its worker: an async actor may run a worker's calls out of order.
    spec["worker"] = (os.getpid(), ray.util.get_node_ip_address())
    hub.post.remote(("started", spec["trial_id"], spec["attempt"], spec["worker"],
                     ray.get_runtime_context().get_assigned_resources()))
    storage = _Storage(spec["root"])
    directory = spec["directory"]
    try:
        if spec["attempt"] == 0:
            storage.clear(directory)  # a new run of this trial (after a driver crash too) starts afresh
        value = evaluator.evaluate(model, spec["sample"], spec["seed"], _HubReporter(hub, spec, storage),
                                   max_steps=spec["max_steps"])
        final = None
        if model is not None:
            final = storage.child(directory, "final.pt")
            storage.save(final, {k: v.detach().cpu() for k, v in model.state_dict().items()})
        return {"kind": "done", "value": None if value is None else float(value), "final": final}
    except TrialTimeout:
        return {"kind": "dropped"}
    except Exception as err:  # the user's loop or model may raise anything: the trial failed
        return {"kind": "error", "error": error_text(err)}


# -- the driver side ---------------------------------------------------------------------------------
@dataclass
class _Track:
    """The driver's view of one trial of a user loop."""

    life: TrialProtocol
    attempt: int = 0
    ref: Any = None
    deaths: list[str] = field(default_factory=list)

    @property
    def job(self) -> Job:
        return self.life.job


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


@dataclass
class _Fluid:
    """Fluid's bookkeeping for one group on Ray."""

    sched: Any
    gpu: bool
    profiles: dict[int, tuple[float, int]] = field(default_factory=dict)  # trial id -> (step s, steps/epoch)

    def remaining(self, member: _Member) -> float:
        step_time, per_epoch = self.profiles[member.job.trial.id]
        return step_time * per_epoch * max((member.limit or 0) - (member.life.last_step + 1), 0)


def _record_outcome(life: TrialProtocol, outcome: Mapping[str, Any], storage: _Storage) -> None:
    """Finish the trial from a worker's outcome (an error, or its final value and weights file)."""
    if outcome["kind"] == "dropped":  # failed by its timeout already
        return
    if outcome["kind"] == "error":
        life.fail(outcome["error"])
        return
    weights = None
    if outcome["final"] is not None:
        life.trial.info["final_weights"] = outcome["final"]
        weights = storage.load(outcome["final"])
    life.finish(outcome["value"], weights)


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

    >>> exp = td.Experiment(space, evaluator, td.strategy.ASHA(max_steps=9), executor="ray",
    ...                     workers=4, max_retries=2)                       # doctest: +SKIP
    >>> exp = td.Experiment(space, evaluator, executor="ray", workers=4, allocation="dynamic")  # doctest: +SKIP
    """

    def __init__(self, workers: int = 2, address: str | None = None, storage: str | os.PathLike[str] | None = None,
                 max_retries: int = 0, experiment: str | None = None, cpus_per_trial: float = 1.0,
                 optimize: Any = None, allocation: Any = None):
        self.workers = workers
        self.address = address
        self.storage = storage  # None: the experiment's folder beside its store
        self.max_retries = max_retries
        self.experiment = experiment  # None: the experiment's name
        self.cpus_per_trial = cpus_per_trial
        self.optimize = optimize  # None: the experiment's
        self.allocation = allocation  # None: the experiment's
        self._started_ray = False
        self._hub: Any = None
        self._evaluator: tuple[Any, Any] | None = None  # (evaluator, its object ref): one copy for all groups

    @property
    def parallelism(self) -> int:  # type: ignore[override]
        return self.workers

    def start(self, context: RunContext) -> None:
        """Take the run's name, checkpoint folder, optimizations and allocation where none was given here."""
        super().start(context)
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
            if self.address is None:
                from ._ray_local import start_local_ray

                start_local_ray(self.workers)  # every process listening on 127.0.0.1 only
            else:
                ray.init(address=self.address, include_dashboard=False, logging_level=logging.ERROR,
                         configure_logging=True)
            self._started_ray = True  # ours to stop (a local Ray) or to disconnect from (a cluster)
        self._hub = _Hub.remote()

    def _resources(self) -> dict[str, float]:
        gpus = float(ray.cluster_resources().get("GPU", 0.0))
        out = {"num_cpus": self.cpus_per_trial}
        if gpus > 0:  # a share of a GPU when there are more trials at once than GPUs
            out["num_gpus"] = min(1.0, gpus / self.workers)
        return out

    def close(self) -> None:
        if self._hub is not None:
            try:
                ray.kill(self._hub)
            except Exception:  # Ray already gone (a cluster that went away): nothing to release
                pass
            self._hub = None
        self._evaluator = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False

    # -- running a group ---------------------------------------------------------------------
    def run_group(self, jobs: Sequence[Job], evaluator: Evaluator, hooks: GroupHooks) -> None:
        self._connect()
        storage = _Storage(os.fspath(self.storage))  # type: ignore[arg-type]
        if self._evaluator is None or self._evaluator[0] is not evaluator:
            self._evaluator = (evaluator, ray.put(evaluator))  # its datasets travel to the object store once
        evaluator_ref = self._evaluator[1]
        if isinstance(evaluator, StepwiseEvaluator):
            self._run_units(jobs, evaluator, evaluator_ref, storage, hooks)
        else:
            self._run_trials(jobs, evaluator_ref, storage, hooks)

    def _directory(self, storage: _Storage, trial_id: int) -> str:
        return storage.join(str(self.experiment), f"trial-{trial_id}")

    # -- units (declarative evaluators) --------------------------------------------------------
    def _units(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, lives: Mapping[int, TrialProtocol]
               ) -> list[_UnitTrack]:
        """The group's unit tasks: the planner's fused units, one task each; separate trials (and
        trials forked from another member's state) one each."""
        # Pickled before planning may tie or move them; by value where defined in __main__ (a script).
        models = {job.trial.id: ray.cloudpickle.dumps(job.model) for job in jobs}

        def alone(job: Job) -> _UnitTrack:
            return _UnitTrack({job.trial.id: _Member(lives[job.trial.id], models[job.trial.id])}, optimize=False)

        fresh = [job for job in jobs if job.start_from is None]
        tracks = [alone(job) for job in jobs if job.start_from is not None]
        if not self.optimize or self.allocation is not None:
            return tracks + [alone(job) for job in fresh]
        from ._planner import plan

        units = plan(fresh, evaluator, self.optimize) if fresh else []
        for unit in self._spread(units, evaluator):
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

    def _spread(self, units: list[Any], evaluator: StepwiseEvaluator) -> list[Any]:
        """Fewer tasks than workers: the biggest fused unit is planned again as two equal halves (at
        most one of its batched or joint groups cut), until every worker has a task or nothing is
        left to split.
        In-process one unit of the whole group costs nothing; on Ray it would leave workers idle.
        Super-graph units stay whole (their children are tied already)."""
        from ._planner import plan

        def tasks() -> int:
            return sum(len(u.jobs) if u.describe()["kind"] == "separate" else 1 for u in units)

        while tasks() < self.workers:
            splittable = [u for u in units if u.describe()["splittable"] and len(u.jobs) > 1]
            if not splittable:
                break
            unit = max(splittable, key=lambda u: len(u.jobs))
            groups = unit.describe()["groups"] or [list(unit.jobs)]
            # Equal halves; the members' groups (a batched model, a joint step) in order of size, so
            # that at most one group is cut in two.
            order = [t for group in sorted(groups, key=len, reverse=True) for t in group]
            halves = [order[:(len(order) + 1) // 2], order[(len(order) + 1) // 2:]]
            log.info("ray: the %s unit of trials %s is planned again as two units for the %d workers",
                     unit.kind, list(unit.jobs), self.workers)
            units.remove(unit)
            for half in halves:
                units.extend(plan([j for t, j in unit.jobs.items() if t in half], evaluator, self.optimize))
        return units

    def _run_units(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, evaluator_ref: Any, storage: _Storage,
                   hooks: GroupHooks) -> None:
        fluid = None
        lives = {job.trial.id: TrialProtocol(job, hooks, clock="train") for job in jobs}
        tracks = self._units(jobs, evaluator, lives)
        if self.allocation is not None:
            fluid, tracks = self._profile(tracks, evaluator)
        queue = list(tracks) if fluid is None else []
        waiting = {next(iter(t.members)): t for t in tracks} if fluid is not None else {}
        running: list[_UnitTrack] = []
        owner: dict[int, _UnitTrack] = {}  # trial id -> its running task's track
        try:
            while queue or running or waiting:
                if fluid is not None:
                    for placement in fluid.sched.schedule():
                        track = waiting.pop(placement.key)
                        self._place(track, placement.share, fluid)
                        queue.append(track)
                while queue and (fluid is not None or len(running) < self.workers):
                    track = queue.pop(0)
                    if fluid is None:
                        track.resources = self._resources()
                    self._launch_unit(track, evaluator_ref, storage)
                    running.append(track)
                    owner.update({m.job.trial.id: track for m in track.unfinished()})
                for message in ray.get(self._hub.drain.remote(_POLL_S)):
                    self._handle_unit(message, owner, storage, fluid)
                refs = {t.ref: t for t in running}
                done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                for ref in done:
                    track = refs[ref]
                    # messages posted before the task returned are in the hub: read them first
                    for message in ray.get(self._hub.drain.remote(0)):
                        self._handle_unit(message, owner, storage, fluid)
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

    def _profile(self, tracks: list[_UnitTrack], evaluator: StepwiseEvaluator) -> tuple[_Fluid, list[_UnitTrack]]:
        """Every trial's Fluid profile: the policy's ``profile`` function, else its step time
        measured on the driver (:func:`~._fluid.profile_step_time`, one thread, as a worker runs)."""
        from ._fluid import fluid_policy, profile_step_time

        gpu = False
        if tracks:
            try:
                job = next(iter(tracks[0].members.values())).job
                gpu = evaluator.config(job.trial.sample).device.type == "cuda"  # type: ignore[attr-defined]
            except Exception:  # not a supervised evaluator (Tabular): CPUs
                gpu = False
        devices = int(ray.cluster_resources().get("GPU", 0)) if gpu else self.workers
        policy = fluid_policy(self.allocation)
        fluid = _Fluid(policy.scheduler(max(devices, 1)), gpu)
        kept = []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for track in tracks:
                member = next(iter(track.members.values()))
                trial = member.job.trial
                try:
                    if policy.profile is not None:  # the user's step times: nothing to measure
                        cfg = evaluator.config(trial.sample)  # type: ignore[attr-defined]
                        step_time, per_epoch, epochs = policy.step_time(trial.sample), cfg.steps_per_epoch, cfg.epochs
                    else:
                        step_time, per_epoch, epochs = profile_step_time(evaluator, member.job.model, trial.sample,
                                                                         trial.seed)
                except Exception as err:  # the trainer cannot be built or its first steps fail
                    member.life.fail(err)
                    continue
                member.limit = epochs if member.job.max_steps is None else min(epochs, member.job.max_steps)
                fluid.profiles[trial.id] = (step_time, per_epoch)
                trial.info["fluid_step_seconds"] = step_time
                fluid.sched.submit(trial.id, fluid.remaining(member))
                kept.append(track)
        finally:
            torch.set_num_threads(threads)
        return fluid, kept

    def _place(self, track: _UnitTrack, share: float, fluid: _Fluid) -> None:
        """A Fluid share as the task's resource request."""
        member = next(iter(track.members.values()))
        cpus = self.cpus_per_trial * share
        track.resources = {"num_cpus": cpus}
        if fluid.gpu:
            track.resources = {"num_cpus": min(cpus, self.cpus_per_trial), "num_gpus": share}
        track.world = int(share) if share > 1 else 1
        trial = member.job.trial
        trial.info.setdefault("allocation", []).append(
            {"share": share, "from_epoch": member.life.last_step + 1, "resources": dict(track.resources)})
        log.info("fluid on Ray: trial %d gets share %g (%s)%s", trial.id, share,
                 ", ".join(f"{k}={v:g}" for k, v in track.resources.items()),
                 f": torch DDP over {track.world} local processes" if track.world > 1 else "")

    def _launch_unit(self, track: _UnitTrack, evaluator_ref: Any, storage: _Storage) -> None:
        from ..units import configured_max_unit_memory
        from ._ray_units import run_unit

        members = []
        for member in track.unfinished():
            trial = member.job.trial
            trial.info["storage"] = self._directory(storage, trial.id)
            members.append({"trial": trial, "model": member.model, "max_steps": member.job.max_steps,
                            "directory": trial.info["storage"], "start_from": member.job.start_from})
        spec = {"attempt": track.attempt, "root": storage.root, "cpus": track.resources.get("num_cpus", 1.0),
                "optimize": track.optimize and not track.resume, "resume": track.resume, "members": members,
                "max_unit_memory": configured_max_unit_memory(), "world": track.world, "planned": track.planned,
                "settings": track.settings,
                "limit": next(iter(track.members.values())).limit}
        track.started = track.last_message = math.inf
        track.ref = run_unit.options(**track.resources).remote(evaluator_ref, spec, self._hub)

    def _handle_unit(self, message: tuple[Any, ...], owner: Mapping[int, _UnitTrack], storage: _Storage,
                     fluid: _Fluid | None) -> None:
        kind, trial_id, attempt, (pid, node) = message[:4]
        track = owner.get(trial_id)
        if track is None or attempt != track.attempt or trial_id not in track.members:
            return  # a message of a task already given up on
        member = track.members[trial_id]
        life = member.life
        track.last_message = time.monotonic()
        if track.started == math.inf:
            track.started = track.last_message
        if kind == "started":
            life.trial.info["ray"] = {"pid": pid, "node": node, "attempt": attempt, "resources": dict(message[4])}
            life.start()
            return
        if kind == "left":
            self._member_left(member, message[4], storage, fluid)
            return
        step, metrics, last, seconds = message[4:]
        verdict = life.report(step, metrics, last=last, seconds=seconds)
        if fluid is not None:
            fluid.sched.progress(trial_id, fluid.remaining(member))
        if verdict is Verdict.DROP:  # past its timeout: failed by the protocol
            self._fluid_finish(fluid, trial_id)
        elif (fluid is not None and verdict is Verdict.CONTINUE and step == life.last_step
              and trial_id in fluid.sched.rescales()):
            verdict = Verdict.YIELD  # to its new share at this epoch boundary
            log.info("fluid on Ray: trial %d moves to share %g after epoch %d", trial_id,
                     fluid.sched.rescales()[trial_id], step + 1)
        self._hub.answer.remote(trial_id, attempt, step, verdict.value)

    @staticmethod
    def _fluid_finish(fluid: _Fluid | None, trial_id: int) -> None:
        if fluid is not None:
            fluid.sched.finish(trial_id)

    def _member_left(self, member: _Member, outcome: Mapping[str, Any], storage: _Storage,
                     fluid: _Fluid | None) -> None:
        """A member's outcome (from its ``left`` message or the task's result; the first counts)."""
        kind = outcome["kind"]
        if member.done or kind == "dropped":
            return
        if kind == "yielded":
            member.yielded = True
            return
        self._fluid_finish(fluid, member.job.trial.id)
        _record_outcome(member.life, outcome, storage)

    def _fail_unfinished(self, track: _UnitTrack, fluid: _Fluid | None, error: str) -> None:
        for member in track.unfinished():
            self._fluid_finish(fluid, member.job.trial.id)
            member.life.fail(error.format(trial=member.job.trial.id))

    def _unit_done(self, track: _UnitTrack, ref: Any, storage: _Storage, fluid: _Fluid | None) -> bool:
        """Record the outcomes of a finished unit task; False when its worker died and it runs again."""
        try:
            outcomes = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            return True  # cancelled by the timeout, already recorded
        except ray.exceptions.RayTaskError as err:  # raised outside the training (e.g. unpickling a model)
            self._fail_unfinished(track, fluid, str(err).replace("{", "{{").replace("}", "}}"))
            return True
        except ray.exceptions.RayError as err:  # the worker process or its node died
            text = str(err).strip()
            track.deaths.append(f"{type(err).__name__}: {text.splitlines()[0] if text else ''}")
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
            last = track.deaths[-1].replace("{", "{{").replace("}", "}}")
            self._fail_unfinished(track, fluid, f"the worker of trial {{trial}} died {len(track.deaths)} time(s) and "
                                                f"max_retries={self.max_retries} allows no more restarts; last: {last}")
            return True
        for trial_id, outcome in outcomes.items():
            if trial_id in track.members:
                self._member_left(track.members[trial_id], outcome, storage, fluid)
        for member in [m for m in track.unfinished() if not m.yielded]:
            self._fluid_finish(fluid, member.job.trial.id)
            member.life.fail(f"the unit task of trial {member.job.trial.id} ended without its outcome")
        return True

    def _unit_timeout(self, running: list[_UnitTrack], fluid: _Fluid | None) -> None:
        """A task silent for longer than ``trial_timeout`` hangs inside an epoch: cancel it (its
        members' epoch times are checked as they report, by their protocols)."""
        for track in list(running):
            members = track.unfinished()
            if track.last_message != math.inf and members and members[0].life.silent_too_long(track.last_message):
                ray.cancel(track.ref, force=True)
                timeout = members[0].life.hooks.trial_timeout or 0.0
                self._fail_unfinished(track, fluid, timeout_error("{trial}", timeout, "inside an epoch and was killed"))

    # -- trials of user loops ------------------------------------------------------------------
    def _run_trials(self, jobs: Sequence[Job], evaluator_ref: Any, storage: _Storage, hooks: GroupHooks) -> None:
        if self.allocation is not None and jobs:
            log.warning("allocation=%r places the trials of declarative evaluators only; this evaluator's "
                        "trials run one per task with %s CPU(s)", self.allocation, self.cpus_per_trial)
        resources = self._resources()
        queue = [_Track(TrialProtocol(job, hooks, clock="wall")) for job in jobs]
        running: dict[int, _Track] = {}   # trial id -> track
        try:
            while queue or running:
                while queue and len(running) < self.workers:
                    track = queue.pop(0)
                    self._launch(track, evaluator_ref, storage, resources)
                    running[track.job.trial.id] = track
                for message in ray.get(self._hub.drain.remote(_POLL_S)):
                    self._handle(message, running)
                refs = {t.ref: t for t in running.values()}
                done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                for ref in done:
                    track = refs[ref]
                    if track.job.trial.id not in running:
                        continue  # dropped by its timeout meanwhile
                    if self._finish(track, ref, storage):
                        del running[track.job.trial.id]
                    else:  # its worker died: again
                        self._launch(track, evaluator_ref, storage, resources)
                self._enforce_timeout(running)
        finally:
            for track in running.values():  # interrupted (Ctrl-C, driver error): free the workers
                ray.cancel(track.ref, force=True)

    def _launch(self, track: _Track, evaluator_ref: Any, storage: _Storage, resources: Mapping[str, float]) -> None:
        trial = track.job.trial
        spec = {"trial_id": trial.id, "attempt": track.attempt, "sample": trial.sample, "seed": trial.seed,
                "max_steps": track.job.max_steps, "root": storage.root, "cpus": resources["num_cpus"],
                "directory": self._directory(storage, trial.id)}
        trial.info["storage"] = spec["directory"]
        track.life.started_at = math.inf  # the timeout counts from the worker's first message
        track.ref = _run_trial.options(**resources).remote(evaluator_ref, track.job.model, spec, self._hub)

    def _handle(self, message: tuple[Any, ...], running: dict[int, _Track]) -> None:
        kind, trial_id, attempt, (pid, node) = message[:4]
        track = running.get(trial_id)
        if track is None or attempt != track.attempt:
            return  # a message of a worker already given up on
        life = track.life
        trial = life.trial
        if trial.info.get("ray", {}).get("attempt") != attempt or life.started_at == math.inf:
            trial.info["ray"] = {"pid": pid, "node": node, "attempt": attempt}
            life.start()
        if kind == "started":
            trial.info["ray"]["resources"] = dict(message[4])
            return
        step, metrics, last, seconds = message[4:]
        verdict = life.report(step, metrics, seconds=seconds)  # a user loop is asked after every report
        self._hub.answer.remote(trial_id, attempt, step, verdict.value)
        if verdict is Verdict.DROP:  # past its timeout: failed by the protocol; its worker is freed
            ray.cancel(track.ref, force=True)
            del running[trial_id]

    def _finish(self, track: _Track, ref: Any, storage: _Storage) -> bool:
        """Record the trial's outcome; False when its worker died and it runs again."""
        life = track.life
        try:
            result = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            return True  # cancelled by the timeout, already recorded
        except ray.exceptions.RayTaskError as err:  # raised outside the training (e.g. unpickling the model)
            life.fail(str(err))
            return True
        except ray.exceptions.RayError as err:  # the worker process or its node died
            track.deaths.append(f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
            life.trial.info["ray_restarts"] = len(track.deaths)
            if len(track.deaths) <= self.max_retries:
                log.warning("trial %d: its worker died (%s); restarting it from its last checkpoint (retry %d of %d)",
                            life.trial.id, type(err).__name__, len(track.deaths), self.max_retries)
                track.attempt += 1
                return False
            life.fail(f"the worker of trial {life.trial.id} died {len(track.deaths)} time(s) and max_retries="
                      f"{self.max_retries} allows no more restarts; last: {track.deaths[-1]}")
            return True
        _record_outcome(life, result, storage)
        return True

    def _enforce_timeout(self, running: dict[int, _Track]) -> None:
        for trial_id, track in list(running.items()):
            if track.life.over_time():
                ray.cancel(track.ref, force=True)
                track.life.time_out("and was killed")
                del running[trial_id]
