"""The thread and parallelism policy: torch threads per execution unit, and units run at once.

On a CPU, the intra-op threads torch starts by default (one per core) pay only for large steps.
A small model's step is a few milliseconds of many short kernels: a second OpenMP thread adds
synchronization to every kernel and, on a machine with other work on it, a thread that waits for a
descheduled partner spins, so a loaded machine can take many times longer with several threads
than with one (BENCHMARKS.md, "Figures behind choices in the code"). :class:`ThreadPolicy` therefore gives each
unit one thread when its training step is small or the machine has no idle core, and every idle
core otherwise. Units may also run several at a time (``concurrent``): the in-process executor
then trains them side by side in forked processes (:mod:`._forked`). That is off by default
(``concurrent=1``): on a small machine it trades more CPU-seconds for less wall time on small
models and can lose on both counts for a NAS search (BENCHMARKS.md); ``concurrent=None`` runs one unit per idle core when steps are small. The size of a step is its
training FLOPs (3x the matmul-like forward FLOPs of one example, counted as it runs by
:func:`tridens.graph.forward_flops`, times the batch size, summed over the unit's models).

A policy is an object passed in (``td.executors.Inline(threads=ThreadPolicy(threads=2))``); each
decision is logged (logger ``tridens``) with its reason.

>>> plan = ThreadPolicy(threads=1, concurrent=None).decide(step_flops=5e9, units=3, total=2, load=0.0)
>>> plan.threads, plan.concurrent
(1, 2)
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

from ..graph import forward_flops

__all__ = ["ThreadPolicy", "ThreadPlan", "step_flops", "cores", "shares"]

log = logging.getLogger("tridens")


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def idle_cores(total: int | None = None, load: float | None = None) -> int:
    """Cores no other process is using: ``total`` minus the 1-minute load average beyond this
    process's own running thread (at least 1)."""
    total = cores() if total is None else total
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # pragma: no cover - not POSIX
            load = 0.0
    return max(1, min(total, int(total - max(0.0, load - 1.0) + 0.5)))


@dataclass(frozen=True)
class ThreadPlan:
    """What the policy decided: ``threads`` torch threads per unit, ``concurrent`` units at once."""

    threads: int
    concurrent: int
    reason: str

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the block with ``torch.set_num_threads(self.threads)``, then restore the count."""
        before = torch.get_num_threads()
        if before != self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)


class ThreadPolicy:
    """Threads per unit and units at once, from the machine (cores, load) and the step size.

    ``threads`` fixes the torch threads per unit (None: decided); ``concurrent`` the units at once
    (default 1; None: one per idle core, when a unit takes one thread); ``large_step_flops`` is the
    training step, in FLOPs, from which a unit gets every idle core (default 2 GFLOP: tens of
    milliseconds at one CPU thread's peak, where kernels are long enough for threads to pay).

    >>> ThreadPolicy(concurrent=None).decide(step_flops=1e7, units=4, total=8, load=0.0)
    ThreadPlan(threads=1, concurrent=4, reason='small steps (10 MFLOP < 2000 MFLOP): one thread per unit, 4 at once on 8 idle cores')
    >>> ThreadPolicy().decide(step_flops=5e10, units=4, total=8, load=0.0).threads
    8
    """

    def __init__(self, threads: int | None = None, concurrent: int | None = 1, large_step_flops: float = 2e9):
        self.threads = threads
        self.concurrent = concurrent
        self.large_step_flops = large_step_flops

    def _check(self) -> None:
        for name in ("threads", "concurrent"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"The '{name}' parameter of ThreadPolicy must be None or an int in the range "
                                 f"[1, inf). Got {value!r} instead.")

    def decide(self, step_flops: float | None, units: int = 1, *, total: int | None = None,
               load: float | None = None) -> ThreadPlan:
        """The plan for ``units`` units whose largest training step is ``step_flops`` FLOPs
        (None: unknown, treated as large); ``total`` cores and ``load`` default to this machine's."""
        self._check()
        free = idle_cores(total, load)
        units = max(1, units)
        if self.threads is not None:
            threads, why = self.threads, f"threads={self.threads} set by the user"
        elif free < 2:
            threads, why = 1, f"no idle core beside this one (load average {_load(load):.1f} on {total or cores()} cores)"
        elif step_flops is not None and step_flops < self.large_step_flops:
            threads, why = 1, f"small steps ({step_flops / 1e6:.0f} MFLOP < {self.large_step_flops / 1e6:.0f} MFLOP)"
        else:
            size = "unknown step size" if step_flops is None else f"large steps ({step_flops / 1e6:.0f} MFLOP)"
            threads, why = free, f"{size}: every idle core"
        text = f"{why}: one thread per unit" if threads == 1 and self.threads is None else why
        if self.concurrent is not None:
            return ThreadPlan(threads, self.concurrent, f"{text}, {self.concurrent} at once ({free} idle cores)")
        concurrent = max(1, min(units, free // threads))
        return ThreadPlan(threads, concurrent, f"{text}, {concurrent} at once on {free} idle cores")

    def decide_units(self, units: Sequence[Any], *, parts: int = 0) -> ThreadPlan:
        """The plan for execution units (each step sized by :func:`unit_step_flops`); logged.
        ``parts``: how many units they could be split into (an executor that splits units to run
        them side by side), when more than there are units."""
        flops = max((unit_step_flops(u) for u in units), default=None, key=lambda v: -1 if v is None else v)
        plan = self.decide(flops, max(len(units), parts))
        log.info("threads: %d per unit, %d unit(s) at once: %s", plan.threads, plan.concurrent, plan.reason)
        return plan

    def __repr__(self) -> str:
        return (f"ThreadPolicy(threads={self.threads!r}, concurrent={self.concurrent!r}, "
                f"large_step_flops={self.large_step_flops!r})")


def _load(load: float | None) -> float:
    if load is not None:
        return load
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return 0.0


def step_flops(model: nn.Module, example: torch.Tensor, batch_size: int) -> float:
    """Training FLOPs of one step of ``model`` on ``batch_size`` examples like ``example`` (one
    example, no batch dimension): 3x one example's forward FLOPs times the batch size.

    >>> step_flops(nn.Linear(10, 4), torch.zeros(10), 32)
    7680.0
    """
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            flops = forward_flops(model, example.unsqueeze(0))
    finally:
        model.train(was_training)
    return 3.0 * flops * batch_size


def _model_step_flops(unit: Any) -> tuple[float | None, int]:
    """(the training FLOPs of one step of ``unit``'s largest model, or None when they cannot be
    counted; the number of its models)."""
    evaluator = getattr(unit, "evaluator", None)
    jobs = [job for job in getattr(unit, "jobs", {}).values() if isinstance(job.model, nn.Module)]
    if evaluator is None or not jobs or not hasattr(evaluator, "config"):
        return None, len(jobs)
    job = max(jobs, key=lambda j: sum(p.numel() for p in j.model.parameters()))
    try:
        cfg = job.config(evaluator)
        example = cfg.train[0][0]
        if not isinstance(example, torch.Tensor):
            return None, len(jobs)
        return step_flops(job.model, example, cfg.batch_size), len(jobs)
    except Exception:  # whatever keeps a model from running on one example: size unknown
        return None, len(jobs)


def unit_step_flops(unit: Any) -> float | None:
    """The training FLOPs of one step of ``unit``: its largest model's step (counted on one
    example), times the number of models where they step as one fused model; None when it cannot
    be counted (a user's loop, a model that does not run on one example)."""
    flops, models = _model_step_flops(unit)
    if flops is None:
        return None
    from ..xopt import BatchedUnit

    return flops * models if isinstance(unit, BatchedUnit) else flops


def shares(units: Sequence[Any], count: int) -> list[list[Any]]:
    """``units`` dealt into at most ``count`` shares of about equal work, for ``count`` processes
    side by side: largest first, each to the lightest share so far (a unit's work: its largest
    model's training step times its number of models; its number of models where the step cannot
    be counted). Shares keep the units' order.

    >>> [len(s) for s in shares([object(), object(), object()], 2)]
    [2, 1]
    """
    work = []
    for unit in units:
        flops, models = _model_step_flops(unit)
        work.append(max(1, models) * (1.0 if flops is None else flops))
    count = max(1, min(count, len(units)))
    loads, dealt = [0.0] * count, [[] for _ in range(count)]   # type: list[float], list[list[int]]
    for index in sorted(range(len(units)), key=lambda i: -work[i]):
        lightest = min(range(count), key=lambda s: loads[s])
        loads[lightest] += work[index]
        dealt[lightest].append(index)
    return [[units[i] for i in sorted(share)] for share in dealt if share]
