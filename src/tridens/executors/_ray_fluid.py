"""Fluid on Ray (``allocation=``): each trial's share of the ``workers`` devices becomes its unit
task's resource request.

A share below 1 asks for that fraction of a CPU (of a GPU when the evaluator trains on CUDA), so
Ray packs several tasks on one device; a share above 1 is one task reserving ``share`` devices
that trains the trial with torch DDP over as many local processes (:mod:`._ray_units`).
DynamicFluid moves a trial at an epoch boundary: the executor answers its report with
``Verdict.YIELD``, the task checkpoints and ends, and a task at the new share resumes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import ray
import torch

from ..evaluators import StepwiseEvaluator

if TYPE_CHECKING:
    from ._ray import _Member, _UnitTrack

__all__ = ["FluidOnRay"]

log = logging.getLogger("tridens")


@dataclass
class FluidOnRay:
    """Fluid's bookkeeping for one group on Ray: the policy's scheduler over ``devices`` and each
    trial's profile (seconds per step, steps per epoch).

    >>> fluid, kept = FluidOnRay.profile("dynamic", 4, tracks, evaluator)   # doctest: +SKIP
    >>> for placement in fluid.sched.schedule():                             # doctest: +SKIP
    ...     fluid.place(tracks_by_trial[placement.key], placement.share, cpus_per_trial=1.0)
    """

    sched: Any
    gpu: bool
    profiles: dict[int, tuple[float, int]] = field(default_factory=dict)  # trial id -> (step s, steps/epoch)

    @classmethod
    def profile(cls, allocation: Any, workers: int, tracks: Sequence[_UnitTrack], evaluator: StepwiseEvaluator
                ) -> tuple[FluidOnRay, list[_UnitTrack]]:
        """The group's Fluid bookkeeping with every trial submitted to the scheduler, and the tracks
        whose trial could be profiled (the others failed). A trial's step time is the policy's
        ``profile`` function, else measured on the driver (:func:`~._fluid.profile_step_time`, one
        thread, as a worker runs). ``workers`` devices are CPUs, or the cluster's GPUs for CUDA."""
        from ._fluid import fluid_policy, profile_step_time

        gpu = False
        if tracks:
            try:
                job = next(iter(tracks[0].members.values())).job
                gpu = job.config(evaluator).device.type == "cuda"
            except Exception:  # not a supervised evaluator (Tabular): CPUs
                gpu = False
        devices = int(ray.cluster_resources().get("GPU", 0)) if gpu else workers
        policy = fluid_policy(allocation)
        fluid = cls(policy.scheduler(max(devices, 1)), gpu)
        kept = []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for track in tracks:
                member = next(iter(track.members.values()))
                trial = member.job.trial
                try:
                    if policy.profile is not None:  # the user's step times: nothing to measure
                        cfg = member.job.config(evaluator)
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

    def remaining(self, member: _Member) -> float:
        """The member's predicted training time left at one device."""
        step_time, per_epoch = self.profiles[member.job.trial.id]
        return step_time * per_epoch * max((member.limit or 0) - (member.life.last_step + 1), 0)

    def place(self, track: _UnitTrack, share: float, cpus_per_trial: float) -> None:
        """A Fluid share as the task's resource request (and DDP world size above 1)."""
        member = next(iter(track.members.values()))
        cpus = cpus_per_trial * share
        track.resources = {"num_cpus": cpus}
        if self.gpu:
            track.resources = {"num_cpus": min(cpus, cpus_per_trial), "num_gpus": share}
        track.world = int(share) if share > 1 else 1
        trial = member.job.trial
        trial.info.setdefault("allocation", []).append(
            {"share": share, "from_epoch": member.life.last_step + 1, "resources": dict(track.resources)})
        log.info("fluid on Ray: trial %d gets share %g (%s)%s", trial.id, share,
                 ", ".join(f"{k}={v:g}" for k, v in track.resources.items()),
                 f": torch DDP over {track.world} local processes" if track.world > 1 else "")
