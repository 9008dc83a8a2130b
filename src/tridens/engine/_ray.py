"""The Ray executor: each trial a Ray task on a local Ray or on an existing cluster.

Workers train, the driver decides. A worker trains one epoch (or runs the user's loop up to its
next ``td.report``), writes a checkpoint to ``storage``, and posts the step's metrics to a small
hub actor; the driver drains the hub, records the metrics (it alone writes the store and talks
to the strategy) and answers with the strategy's decision, which the worker reads before its next
step. A trial whose worker dies (killed, out of memory, node lost) starts again on another worker
from its last checkpoint, at most ``max_retries`` times; the steps it had reported are not
recorded twice.

Differences from the in-process executor, by design: trials train separately (no fused units),
and rung decisions are made as results arrive (asynchronously, as in ASHA) rather than after the
whole group reported a step, so which trials an early-stopping strategy stops may differ. A
trial's metrics for the steps it trains are the same, bit for bit, as in-process with the same seed.

Storage layout (``storage`` is a directory every worker sees, or an fsspec URI)::

    <storage>/<experiment>/trial-<id>/epoch-<n>.pt   the latest per-epoch checkpoint (step-wise evaluators)
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

from ..evaluators._base import Evaluator, StepwiseEvaluator, drive
from ..trial import Decision, TrialStatus
from ._execution import Executor, GroupHooks, Job, _error_text, _final_status

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
    """The Reporter of a trial on a worker: checkpoint (step-wise), post the metrics, wait for the decision."""

    def __init__(self, hub: Any, spec: Mapping[str, Any], storage: _Storage, trainer: Any = None, limit: int | None = None):
        self.hub, self.spec, self.storage, self.trainer, self.limit = hub, spec, storage, trainer, limit
        self.mark = time.monotonic()  # training time is counted from here to the next report

    def report(self, step: int, metrics: Mapping[str, float]) -> Decision:
        metrics = {k: float(v) for k, v in metrics.items()}
        seconds = time.monotonic() - self.mark
        last = False
        if self.trainer is not None:
            directory = self.spec["directory"]
            epoch = self.trainer.epoch
            # Checkpoint before reporting: a worker killed after this line resumes past the epoch
            # and posts its metrics again (the driver ignores a step it already has).
            self.storage.save(self.storage.child(directory, f"epoch-{epoch}.pt"),
                              {"trainer": self.trainer.state_dict(), "step": step, "metrics": metrics})
            if epoch > 1:  # only the latest checkpoint is needed to go on
                self.storage.remove(self.storage.child(directory, f"epoch-{epoch - 1}.pt"))
            last = self.limit is not None and epoch >= self.limit
        answer = ray.get(self.hub.ask.remote(self.spec["trial_id"], self.spec["attempt"], step, metrics, last, seconds,
                                             self.spec["worker"]))
        self.mark = time.monotonic()
        return Decision(answer)


def _limit(trainer: Any, max_steps: int | None) -> int:
    return trainer.epochs if max_steps is None else min(trainer.epochs, max_steps)


@ray.remote(max_retries=0)
def _run_trial(evaluator: Evaluator, model: Any, spec: dict[str, Any], hub: Any) -> dict[str, Any]:
    """Train one trial on a worker. Errors of the training itself are returned (the trial failed);
    only the worker's death raises on the driver (and restarts the trial)."""
    torch.set_num_threads(max(1, int(spec["cpus"])))
    # Every message names its worker: an async actor may run a worker's calls out of order.
    spec["worker"] = (os.getpid(), ray.util.get_node_ip_address())
    hub.post.remote(("started", spec["trial_id"], spec["attempt"], spec["worker"]))
    storage = _Storage(spec["root"])
    directory = spec["directory"]
    try:
        if spec["attempt"] == 0:
            storage.clear(directory)  # a new run of this trial (after a driver crash too) starts afresh
        value: float | None
        if isinstance(evaluator, StepwiseEvaluator):
            trainer = evaluator.trainer(model, spec["sample"], spec["seed"])
            limit = _limit(trainer, spec["max_steps"])
            reporter = _HubReporter(hub, spec, storage, trainer, limit)
            epoch = storage.latest_epoch(directory)
            value = None
            stopped = False
            if epoch is not None:
                state = storage.load(storage.child(directory, f"epoch-{epoch}.pt"))
                trainer.load_state_dict(state["trainer"])
                metrics = state["metrics"]
                value = next(iter(metrics.values()))
                # the report may not have reached the driver before the old worker died
                answer = ray.get(hub.ask.remote(spec["trial_id"], spec["attempt"], state["step"], metrics,
                                                trainer.epoch >= limit, 0.0, spec["worker"]))
                stopped = Decision(answer) is Decision.STOP
            if not stopped:
                reporter.mark = time.monotonic()
                result = drive(trainer, evaluator.objective, reporter, max_steps=spec["max_steps"])
                value = result if result is not None else value
            model = trainer.model
        else:
            value = evaluator.evaluate(model, spec["sample"], spec["seed"], _HubReporter(hub, spec, storage),
                                       max_steps=spec["max_steps"])
        final = None
        if model is not None:
            final = storage.child(directory, "final.pt")
            storage.save(final, {k: v.detach().cpu() for k, v in model.state_dict().items()})
        return {"kind": "done", "value": None if value is None else float(value), "final": final}
    except Exception as err:  # the user's loop or model may raise anything: the trial failed
        return {"kind": "error", "error": _error_text(err)}


# -- the driver side ---------------------------------------------------------------------------------
@dataclass
class _Track:
    """The driver's view of one trial."""

    job: Job
    attempt: int = 0
    ref: Any = None
    last_step: int = -1                       # the last step recorded in the store
    decisions: dict[int, Decision] = field(default_factory=dict)
    last_value: float | None = None
    started: float = math.inf                 # when the current attempt's worker started
    deaths: list[str] = field(default_factory=list)


class RayExecutor(Executor):
    """Trials as Ray tasks, at most ``workers`` at a time, each asking for one CPU (and a share
    of a GPU where the cluster has GPUs).

    ``address=None`` starts a local Ray with ``workers`` CPUs (no dashboard, quiet logs) and stops
    it on :meth:`close`; an address (``"host:port"``, ``"auto"``, ``"ray://host:10001"``) joins a
    running cluster. A Ray already started in this process is used as it is. Checkpoints go to
    ``storage`` (a directory every worker sees, or an fsspec URI such as ``s3://bucket/runs``).
    The space, evaluator and model are pickled to the workers: define them at module level.

    >>> exp = td.Experiment(space, evaluator, td.strategy.ASHA(max_steps=9), executor="ray",
    ...                     workers=4, max_retries=2)                       # doctest: +SKIP
    """

    def __init__(self, workers: int = 2, address: str | None = None, storage: str | os.PathLike[str] | None = None,
                 max_retries: int = 0, experiment: str = "experiment", cpus_per_trial: float = 1.0):
        self.workers = workers
        self.address = address
        self.storage = storage
        self.max_retries = max_retries
        self.experiment = experiment
        self.cpus_per_trial = cpus_per_trial
        self._started_ray = False
        self._hub: Any = None
        self._evaluator: tuple[Any, Any] | None = None  # (evaluator, its object ref): one copy for all groups

    # -- Ray ---------------------------------------------------------------------------------
    def _connect(self) -> None:
        if self._hub is not None:
            return
        if self.storage is None:
            raise ValueError("The 'storage' parameter of RayExecutor must be a directory or an fsspec URI. Got None instead.")
        if not ray.is_initialized():
            options: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.ERROR,
                                       "configure_logging": True}
            if self.address is None:
                options["num_cpus"] = self.workers
            else:
                options["address"] = self.address
            ray.init(**options)
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
        resources = self._resources()
        queue = [_Track(job) for job in jobs]
        running: dict[int, _Track] = {}   # trial id -> track
        try:
            while queue or running:
                while queue and len(running) < self.workers:
                    track = queue.pop(0)
                    self._launch(track, evaluator_ref, storage, resources)
                    running[track.job.trial.id] = track
                for message in ray.get(self._hub.drain.remote(_POLL_S)):
                    self._handle(message, running, hooks, stepwise=isinstance(evaluator, StepwiseEvaluator))
                refs = {t.ref: t for t in running.values()}
                done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                for ref in done:
                    track = refs[ref]
                    if self._finish(track, ref, storage, hooks):
                        del running[track.job.trial.id]
                    else:  # its worker died: again, from the last checkpoint
                        self._launch(track, evaluator_ref, storage, resources)
                self._enforce_timeout(running, hooks)
        finally:
            for track in running.values():  # interrupted (Ctrl-C, driver error): free the workers
                ray.cancel(track.ref, force=True)

    def _launch(self, track: _Track, evaluator_ref: Any, storage: _Storage, resources: Mapping[str, float]) -> None:
        trial = track.job.trial
        spec = {"trial_id": trial.id, "attempt": track.attempt, "sample": trial.sample, "seed": trial.seed,
                "max_steps": track.job.max_steps, "root": storage.root, "cpus": resources["num_cpus"],
                "directory": storage.join(self.experiment, f"trial-{trial.id}")}
        trial.info["storage"] = spec["directory"]
        track.started = math.inf
        track.ref = _run_trial.options(**resources).remote(evaluator_ref, track.job.model, spec, self._hub)

    def _handle(self, message: tuple[Any, ...], running: Mapping[int, _Track], hooks: GroupHooks, *, stepwise: bool) -> None:
        kind, trial_id, attempt, (pid, node) = message[:4]
        track = running.get(trial_id)
        if track is None or attempt != track.attempt:
            return  # a message of a worker already given up on
        trial = track.job.trial
        if trial.info.get("ray", {}).get("attempt") != attempt or track.started == math.inf:
            track.started = time.monotonic()
            trial.info["ray"] = {"pid": pid, "node": node, "attempt": attempt}
        if kind == "started":
            return
        step, metrics, last, seconds = message[4:]
        trial.info["train_seconds"] = trial.info.get("train_seconds", 0.0) + seconds  # as the in-process units count it
        if step > track.last_step:
            hooks.record(trial, step, metrics)
            track.last_step = step
            track.last_value = next(iter(metrics.values()), None)
            # The in-process executor asks no decision after a trial's last epoch; a user loop is
            # asked after every report.
            track.decisions[step] = Decision.CONTINUE if (stepwise and last) else hooks.decide(trial, step)
        decision = track.decisions.get(step, Decision.CONTINUE)
        self._hub.answer.remote(trial_id, attempt, step, decision.value)

    def _finish(self, track: _Track, ref: Any, storage: _Storage, hooks: GroupHooks) -> bool:
        """Record the trial's outcome; False when its worker died and it runs again."""
        trial = track.job.trial
        try:
            result = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            return True  # cancelled by the timeout, already recorded
        except ray.exceptions.RayTaskError as err:  # raised outside the training (e.g. unpickling the model)
            hooks.finish(trial, TrialStatus.FAILED, value=track.last_value, error=str(err))
            return True
        except ray.exceptions.RayError as err:  # the worker process or its node died
            track.deaths.append(f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
            trial.info["ray_restarts"] = len(track.deaths)
            if len(track.deaths) <= self.max_retries:
                log.warning("trial %d: its worker died (%s); restarting it from its last checkpoint (retry %d of %d)",
                            trial.id, type(err).__name__, len(track.deaths), self.max_retries)
                track.attempt += 1
                return False
            hooks.finish(trial, TrialStatus.FAILED, value=track.last_value,
                         error=f"the worker of trial {trial.id} died {len(track.deaths)} time(s) and max_retries="
                               f"{self.max_retries} allows no more restarts; last: {track.deaths[-1]}")
            return True
        if result["kind"] == "error":
            hooks.finish(trial, TrialStatus.FAILED, value=track.last_value, error=result["error"])
            return True
        value = track.last_value if result["value"] is None else result["value"]
        weights = None
        if result["final"] is not None:
            trial.info["final_weights"] = result["final"]
            weights = storage.load(result["final"])
        status, error = _final_status(value)
        if status is TrialStatus.COMPLETED and trial.status is TrialStatus.STOPPED:
            status = TrialStatus.STOPPED
        hooks.finish(trial, status, error=error, weights=weights, value=value)
        return True

    def _enforce_timeout(self, running: dict[int, _Track], hooks: GroupHooks) -> None:
        timeout = hooks.trial_timeout
        if timeout is None:
            return
        for trial_id, track in list(running.items()):
            if time.monotonic() - track.started > timeout:
                ray.cancel(track.ref, force=True)
                hooks.finish(track.job.trial, TrialStatus.FAILED, value=track.last_value,
                             error=f"trial {trial_id} exceeded trial_timeout={timeout} s and was killed")
                del running[trial_id]
