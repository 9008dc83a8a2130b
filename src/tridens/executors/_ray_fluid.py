"""Fluid on Ray (``allocation=``): each trial's share of the ``workers`` devices becomes its unit
task's resource request.

A share below 1 asks for that fraction of a CPU (of a GPU when the evaluator trains on CUDA), so
Ray packs several tasks on one device; a share above 1 is one task reserving ``share`` devices
that trains the trial with torch DDP over as many local processes (:mod:`._ray_units`).
DynamicFluid moves a trial at an epoch boundary: the driver answers its report with
``Verdict.YIELD`` (:meth:`~._driver.Placement.moves`), the task checkpoints and ends, and a task
at the new share resumes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import ray
import torch

from ..evaluators import StepwiseEvaluator
from ..units import Job
from ._protocol import GroupHooks, TrialProtocol

if TYPE_CHECKING:
    from ._driver import Site

__all__ = ["FluidOnRay"]

log = logging.getLogger("tridens")


@dataclass
class FluidOnRay:
    """Fluid's bookkeeping for one group on Ray: the policy's scheduler over ``devices`` and each
    trial's profile (seconds per step, steps per epoch) and the epochs it trains in all.

    >>> fluid = FluidOnRay.start("dynamic", 4, jobs, evaluator)              # doctest: +SKIP
    >>> lives = {job.trial.id: TrialProtocol(job, fluid.watch(hooks)) for job in jobs}   # doctest: +SKIP
    >>> sites = fluid.profile(sites, evaluator)                              # doctest: +SKIP
    """

    sched: Any
    gpu: bool
    policy: Any = None
    profiles: dict[int, tuple[float, int]] = field(default_factory=dict)  # trial id -> (step s, steps/epoch)
    limits: dict[int, int] = field(default_factory=dict)                  # trial id -> epochs in all

    @classmethod
    def start(cls, allocation: Any, workers: int, jobs: Sequence[Job], evaluator: StepwiseEvaluator) -> FluidOnRay:
        """The policy's scheduler over ``workers`` devices: CPUs, or the cluster's GPUs when the
        evaluator trains on CUDA."""
        from ._fluid import fluid_policy

        gpu = False
        if jobs:
            try:
                gpu = jobs[0].config(evaluator).device.type == "cuda"
            except Exception:  # not a supervised evaluator (Tabular): CPUs
                gpu = False
        devices = int(ray.cluster_resources().get("GPU", 0)) if gpu else workers
        policy = fluid_policy(allocation)
        return cls(policy.scheduler(max(devices, 1)), gpu, policy)

    def watch(self, hooks: GroupHooks) -> GroupHooks:
        """``hooks`` that also tell the scheduler each trial's progress and end."""
        return _Watched(hooks, self)  # type: ignore[return-value]

    def profile(self, sites: Sequence[Site], evaluator: StepwiseEvaluator) -> list[Site]:
        """Every site's trial (one each) submitted to the scheduler; the sites whose trial could be
        profiled (the others failed). A trial's step time is the policy's ``profile`` function,
        else measured on the driver (:func:`~._fluid.profile_step_time`, one thread, as a worker runs)."""
        from ._fluid import profile_step_time

        policy = self.policy
        kept = []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for site in sites:
                life = next(iter(site.lives.values()))
                job, trial = life.job, life.trial
                try:
                    if policy.profile is not None:  # the user's step times: nothing to measure
                        cfg = job.config(evaluator)
                        step_time, per_epoch, epochs = policy.step_time(trial.sample), cfg.steps_per_epoch, cfg.epochs
                    else:
                        step_time, per_epoch, epochs = profile_step_time(evaluator, job.model, trial.sample, trial.seed)
                except Exception as err:  # the trainer cannot be built or its first steps fail
                    life.fail(err)
                    continue
                self.limits[trial.id] = epochs if job.max_steps is None else min(epochs, job.max_steps)
                self.profiles[trial.id] = (step_time, per_epoch)
                trial.info["fluid_step_seconds"] = step_time
                self.sched.submit(trial.id, self.remaining(trial.id, life.last_step))
                kept.append(site)
        finally:
            torch.set_num_threads(threads)
        return kept

    def remaining(self, trial_id: int, step: int) -> float:
        """The trial's predicted training time left at one device after ``step``."""
        step_time, per_epoch = self.profiles[trial_id]
        return step_time * per_epoch * max(self.limits[trial_id] - (step + 1), 0)

    def place(self, life: TrialProtocol, share: float, cpus_per_trial: float) -> tuple[dict[str, float], int]:
        """A Fluid share as the task's resource request and DDP world size (above 1)."""
        cpus = cpus_per_trial * share
        resources = {"num_cpus": cpus}
        if self.gpu:
            resources = {"num_cpus": min(cpus, cpus_per_trial), "num_gpus": share}
        world = int(share) if share > 1 else 1
        trial = life.trial
        trial.info.setdefault("allocation", []).append(
            {"share": share, "from_epoch": life.last_step + 1, "resources": dict(resources)})
        log.info("fluid on Ray: trial %d gets share %g (%s)%s", trial.id, share,
                 ", ".join(f"{k}={v:g}" for k, v in resources.items()),
                 f": torch DDP over {world} local processes" if world > 1 else "")
        return resources, world

    def moves(self, life: TrialProtocol, step: int) -> bool:
        """Whether the trial, after ``step`` (recorded just now), moves to its new share."""
        rescales = self.sched.rescales()
        if step != life.last_step or life.trial.id not in rescales:
            return False
        log.info("fluid on Ray: trial %d moves to share %g after epoch %d", life.trial.id, rescales[life.trial.id],
                 step + 1)
        return True


class _Watched:
    """A group's hooks that also tell Fluid's scheduler each profiled trial's progress (after a
    recorded step) and its end (completed, stopped or failed: its devices are free)."""

    def __init__(self, hooks: GroupHooks, fluid: FluidOnRay):
        self.hooks, self.fluid = hooks, fluid

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hooks, name)

    def record(self, trial: Any, step: int, metrics: Mapping[str, float]) -> None:
        self.hooks.record(trial, step, metrics)
        if trial.id in self.fluid.profiles:
            self.fluid.sched.progress(trial.id, self.fluid.remaining(trial.id, step))

    def finish(self, trial: Any, status: Any, **kw: Any) -> None:
        if trial.id in self.fluid.profiles:
            self.fluid.sched.finish(trial.id)
        self.hooks.finish(trial, status, **kw)
