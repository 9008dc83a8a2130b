"""User loops on Ray: a trial of a non-step-wise evaluator (``FunctionalEvaluator``, a loop that
reports with ``td.report``) is one Ray task that runs the whole loop on a worker.

Each ``td.report`` on the worker posts the step's metrics to the hub and waits for the driver's
verdict (:class:`HubReporter`); the driver runs at most ``workers`` such tasks at a time
(:class:`UserLoopGroup`), records every report through the trial's
:class:`~._protocol.TrialProtocol`, cancels a task whose trial ran past ``trial_timeout``, and
starts a task whose worker died again, at most ``max_retries`` times (the steps already recorded
are not recorded twice). Step-wise evaluators run as units instead (:mod:`._ray_units`).
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
import torch

from ..evaluators import Evaluator
from ..trial import Decision
from ..units import Job
from ._protocol import GroupHooks, TrialProtocol, TrialTimeout, Verdict, error_text
from ._channel import HubChannel
from ._messages import Answer, Outcome, Posted, Report, Started
from ._ray_hub import POLL_S, death_cause
from ._ray_storage import CheckpointStorage
from ._watchdog import check_overtime, death_error, for_trial, settle

__all__ = ["HubReporter", "UserLoopGroup", "run_trial"]

log = logging.getLogger("tridens")


# -- the worker side ---------------------------------------------------------------------------------
class HubReporter:
    """The Reporter of a user loop on a worker: post the metrics, wait for the decision."""

    def __init__(self, hub: Any, spec: Mapping[str, Any]):
        self.hub, self.spec = hub, spec
        self.mark = time.monotonic()  # training time is counted from here to the next report

    def report(self, step: int, metrics: Mapping[str, float]) -> Decision:
        metrics = {k: float(v) for k, v in metrics.items()}
        seconds = time.monotonic() - self.mark
        answer = ray.get(self.hub.ask.remote(Posted(self.spec["attempt"], self.spec["worker"],
                                                    Report(self.spec["trial_id"], step, metrics, seconds))))
        self.mark = time.monotonic()
        if answer == Verdict.DROP.value:  # past its timeout: the driver failed it
            raise TrialTimeout()
        return Decision.STOP if answer == Verdict.STOP.value else Decision.CONTINUE


@ray.remote(max_retries=0)
def run_trial(evaluator: Evaluator, model: Any, spec: dict[str, Any], hub: Any) -> Outcome:
    """Run one trial of a user loop on a worker; returns its outcome (:mod:`._ray_hub`). Errors
    of the training itself are returned (the trial failed); only the worker's death raises on the
    driver (and restarts the trial)."""
    torch.set_num_threads(max(1, int(spec["cpus"])))
    # Every message names its worker: an async actor may run a worker's calls out of order.
    spec["worker"] = (os.getpid(), ray.util.get_node_ip_address())
    hub.post.remote(Posted(spec["attempt"], spec["worker"],
                           Started(spec["trial_id"], ray.get_runtime_context().get_assigned_resources())))
    storage = CheckpointStorage(spec["root"])
    directory = spec["directory"]
    try:
        if spec["attempt"] == 0:
            storage.clear(directory)  # a new run of this trial (after a driver crash too) starts afresh
        value = evaluator.evaluate(model, spec["sample"], spec["seed"], HubReporter(hub, spec),
                                   max_steps=spec["max_steps"])
        final = None
        if model is not None:
            final = storage.child(directory, "final.pt")
            storage.save(final, {k: v.detach().cpu() for k, v in model.state_dict().items()})
        return Outcome("done", None if value is None else float(value), final)
    except TrialTimeout:
        return Outcome("dropped")
    except Exception as err:  # the user's loop or model may raise anything: the trial failed
        return Outcome("error", error=error_text(err))


# -- the driver side ---------------------------------------------------------------------------------
@dataclass
class _Task:
    """The driver's view of one trial's task."""

    life: TrialProtocol
    attempt: int = 0
    ref: Any = None
    deaths: list[str] = field(default_factory=list)

    @property
    def job(self) -> Job:
        return self.life.job


class UserLoopGroup:
    """The driver's run of one group of user-loop trials: at most ``workers`` tasks at once, each
    asking for ``resources``, checkpoints under ``storage``/``experiment``, messages through ``hub``
    (the driver's end of the Ray hub, :class:`~._channel.HubChannel`).

    >>> UserLoopGroup(HubChannel(start_hub()), evaluator_ref, storage, "search", workers=2, max_retries=1,
    ...               resources={"num_cpus": 1.0}).run(jobs, hooks)             # doctest: +SKIP
    """

    def __init__(self, hub: HubChannel, evaluator_ref: Any, storage: CheckpointStorage, experiment: str, *, workers: int,
                 max_retries: int, resources: Mapping[str, float]):
        self.hub, self.evaluator_ref, self.storage, self.experiment = hub, evaluator_ref, storage, experiment
        self.workers, self.max_retries, self.resources = workers, max_retries, dict(resources)

    def run(self, jobs: Sequence[Job], hooks: GroupHooks) -> None:
        """Run every job's trial to its end (completed, stopped, failed)."""
        queue = [_Task(TrialProtocol(job, hooks, clock="wall")) for job in jobs]
        running: dict[int, _Task] = {}   # trial id -> task
        try:
            while queue or running:
                while queue and len(running) < self.workers:
                    task = queue.pop(0)
                    self._launch(task)
                    running[task.job.trial.id] = task
                for message in self.hub.receive_all(POLL_S):
                    self._handle(message, running)
                refs = {t.ref: t for t in running.values()}
                done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                for ref in done:
                    task = refs[ref]
                    if task.job.trial.id not in running:
                        continue  # dropped by its timeout meanwhile
                    if self._finish(task, ref):
                        del running[task.job.trial.id]
                    else:  # its worker died: again
                        self._launch(task)
                self._enforce_timeout(running)
        finally:
            for task in running.values():  # interrupted (Ctrl-C, driver error): free the workers
                ray.cancel(task.ref, force=True)

    def _launch(self, task: _Task) -> None:
        trial = task.job.trial
        spec = {"trial_id": trial.id, "attempt": task.attempt, "sample": trial.sample, "seed": trial.seed,
                "max_steps": task.job.max_steps, "root": self.storage.root, "cpus": self.resources["num_cpus"],
                "directory": self.storage.trial_directory(self.experiment, trial.id)}
        trial.info["storage"] = spec["directory"]
        task.life.started_at = math.inf  # the timeout counts from the worker's first message
        task.ref = run_trial.options(**self.resources).remote(self.evaluator_ref, task.job.model, spec, self.hub.hub)

    def _handle(self, posted: Posted, running: dict[int, _Task]) -> None:
        attempt, (pid, node), message = posted.attempt, posted.worker, posted.message
        trial_id = message.trial_id
        task = running.get(trial_id)
        if task is None or attempt != task.attempt:
            return  # a message of a worker already given up on
        life = task.life
        trial = life.trial
        if trial.info.get("ray", {}).get("attempt") != attempt or life.started_at == math.inf:
            trial.info["ray"] = {"pid": pid, "node": node, "attempt": attempt}
            life.start()
        if isinstance(message, Started):
            trial.info["ray"]["resources"] = dict(message.resources or {})
            return
        # a Report; a user loop is asked after every report
        verdict = life.report(message.step, message.metrics, seconds=message.seconds)
        self.hub.send(Answer(trial_id, verdict.value, message.step, attempt))
        if verdict is Verdict.DROP:  # past its timeout: failed by the protocol; its worker is freed
            ray.cancel(task.ref, force=True)
            del running[trial_id]

    def _finish(self, task: _Task, ref: Any) -> bool:
        """Record the trial's outcome; False when its worker died and it runs again."""
        life = task.life
        try:
            result = ray.get(ref)
        except ray.exceptions.TaskCancelledError:
            return True  # cancelled by the timeout, already recorded
        except ray.exceptions.RayTaskError as err:  # raised outside the training (e.g. unpickling the model)
            life.fail(str(err))
            return True
        except ray.exceptions.RayError as err:  # the worker process or its node died
            task.deaths.append(death_cause(err, life.trial.info))
            life.trial.info["ray_restarts"] = len(task.deaths)
            if len(task.deaths) <= self.max_retries:
                log.warning("trial %d: its worker died (%s); restarting it from its last checkpoint (retry %d of %d)",
                            life.trial.label, type(err).__name__, len(task.deaths), self.max_retries)
                task.attempt += 1
                return False
            life.fail(for_trial(death_error("worker", task.deaths[-1], times=len(task.deaths),
                                            limit=f"max_retries={self.max_retries}"), life.trial))
            return True
        settle(life, result, self.storage.load)
        return True

    def _enforce_timeout(self, running: dict[int, _Task]) -> None:
        for trial_id, task in list(running.items()):
            if check_overtime(task.life, functools.partial(ray.cancel, task.ref, force=True)):
                del running[trial_id]
