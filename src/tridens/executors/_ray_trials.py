"""User loops on Ray: a trial of a non-step-wise evaluator (``FunctionalEvaluator``, a loop that
reports with ``td.report``) is one Ray task that runs the whole loop on a worker.

Each ``td.report`` on the worker posts the step's metrics to the hub and waits for the driver's
verdict (:class:`HubReporter`). The tasks are a :class:`~._driver.Placement` of the one driver
(:class:`TrialTasks`, each trial a site of one member on its own
:class:`~._channel.TaskChannel`): at most ``workers`` at a time, every report recorded through
the trial's :class:`~._protocol.TrialProtocol`, a task whose trial ran past ``trial_timeout``
cancelled, a task whose worker died started again at most ``max_retries`` times (the steps
already recorded are not recorded twice). Step-wise evaluators run as units instead
(:mod:`._ray_units`); :class:`RayTasks` is what both placements share.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Mapping, Sequence

import ray
import torch

from ..evaluators import Evaluator
from ..trial import Decision
from ..units import Job
from ._channel import Channel, HubChannel
from ._driver import Carrier, LockstepDriver, Placement, Site
from ._messages import Outcome, Posted, Report, Started
from ._protocol import GroupHooks, TrialProtocol, TrialTimeout, Verdict, error_text
from ._ray_storage import CheckpointStorage

__all__ = ["HubReporter", "RayTasks", "TrialTasks", "run_trial"]

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
        attempt, tid = self.spec["attempt"], self.spec["trial_id"]
        key = ("report", tid, attempt, step)
        answer = ray.get(self.hub.call.remote(key, Posted(attempt, self.spec["worker"],
                                                          Report(tid, step, metrics, seconds), key)))
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
    spec["worker"] = (os.getpid(), ray.util.get_node_ip_address())
    # waited for: the trial's clock starts before its first report arrives
    ray.get(hub.post.remote(Posted(spec["attempt"], spec["worker"],
                                   Started(spec["trial_id"], ray.get_runtime_context().get_assigned_resources()))))
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
class RayTasks(Placement):
    """Ray tasks as a :class:`~._driver.Placement`: each site one task on its own channel on the
    ``hub`` (:meth:`~._channel.HubChannel.task`), at most ``workers`` at once; a task whose worker
    or node died starts again up to ``max_retries`` times (the death message names the setting);
    states travel as files under ``storage`` (a hand-off is taken, final weights are read where
    they are). :meth:`submit` starts a site's task."""

    name, process, where = "a Ray task", "worker", "in its Ray task"

    def __init__(self, hub: HubChannel, storage: CheckpointStorage, experiment: str, *, workers: int, max_retries: int):
        self.hub, self.storage, self.experiment = hub, storage, experiment
        self.slots, self.retries = workers, max_retries
        self.limit = f"max_retries={max_retries}"
        self.carrier = Carrier(lambda state: storage.hand(experiment, state), storage.take, storage.load)
        self.attempts: dict[int, int] = {}   # id(site) -> how often its task was started

    def launch(self, site: Site) -> Channel:
        attempt = self.attempts.get(id(site), 0)
        self.attempts[id(site)] = attempt + 1
        for life in site.lives.values():
            life.trial.info["storage"] = self.storage.trial_directory(self.experiment, life.trial.id)
        ref = self.submit(site, attempt)
        site.last_message = math.inf   # it may wait for room in the cluster: silent from its first message
        return self.hub.task(ref, attempt, list(site.lives))

    def submit(self, site: Site, attempt: int) -> Any:
        """Start ``site``'s task (its ``attempt``-th start, from 0); its object ref."""
        raise NotImplementedError

    def kill(self, site: Site) -> None:
        if site.deaths:
            for life in site.lives.values():
                life.trial.info["ray_restarts"] = site.deaths
        if site.channel is not None:
            site.channel.kill()

    def release(self, site: Site) -> None:
        if site.channel is not None:
            site.channel.close()


class TrialTasks(RayTasks):
    """The tasks of one group of user-loop trials (see the module docstring): each trial a site
    of one member timed by the wall clock, its task asking for ``resources``; a trial started
    again after its worker died goes on from its own last checkpoint (its loop's).

    >>> TrialTasks(hub, evaluator_ref, storage, "search", workers=2, max_retries=1,
    ...            resources={"num_cpus": 1.0}).run(jobs, hooks)             # doctest: +SKIP
    """

    resumes = "from its last checkpoint"

    def __init__(self, hub: HubChannel, evaluator_ref: Any, storage: CheckpointStorage, experiment: str, *,
                 workers: int, max_retries: int, resources: Mapping[str, float]):
        super().__init__(hub, storage, experiment, workers=workers, max_retries=max_retries)
        self.evaluator_ref, self.resources = evaluator_ref, dict(resources)

    def run(self, jobs: Sequence[Job], hooks: GroupHooks) -> None:
        """Run every job's trial to its end (completed, stopped, failed)."""
        sites = [Site({job.trial.id: TrialProtocol(job, hooks, clock="wall")}, job) for job in jobs]
        LockstepDriver(self, lockstep=False).run(sites)

    def submit(self, site: Site, attempt: int) -> Any:
        job: Job = site.data
        trial = job.trial
        spec = {"trial_id": trial.id, "attempt": attempt, "sample": trial.sample, "seed": trial.seed,
                "max_steps": job.max_steps, "root": self.storage.root, "cpus": self.resources["num_cpus"],
                "directory": trial.info["storage"]}
        site.lives[trial.id].started_at = math.inf  # the timeout counts from the worker's first message
        return run_trial.options(**self.resources).remote(self.evaluator_ref, job.model, spec, self.hub.hub)
