"""Fluid: resource-aware placement of a TrialGroup's trials on devices (shared/seeds 001).

A trial's *profile* ``h_i`` is its predicted time to finish on one device (its measured step time
times the steps it has left). :func:`fluid_shares` is Fluid's allocation rule (Algorithm 1): trial
``i`` gets

    w_i = min(max(floor(h_i / sum_j h_j * n), 1 / c), d)

of the ``n`` devices, where ``c`` (``max_pack``) is the most trials packed on one device and ``d``
(``max_span``) the most devices one trial spans. A share below 1 packs the trial with others on one
device; a share above 1 trains it data-parallel over that many devices.

:class:`StaticFluid` places a group's trials with these shares on the idle devices, and places the
trials still waiting the same way whenever devices free up. :class:`DynamicFluid` (Algorithm 2)
re-runs the rule over every unfinished trial and all ``n`` devices whenever trials end, and changes a
running trial's share only when the predicted time improves: up when ``h(w') + epsilon < h(w)``,
down when ``w' * (h(w') + epsilon) < w * h(w)`` (``epsilon``: the cost of moving a trial).

:class:`FluidScheduler` is the event-driven bookkeeping both policies share: which trial runs on
which devices. It knows nothing about processes, so the process pool here, the Ray executor and the
trace-driven simulation in ``bench/fluid.py`` use the same decisions.

>>> fluid_shares([8.0, 4.0, 2.0, 1.0, 1.0], devices=8, max_pack=2, max_span=4)
[4.0, 2.0, 1.0, 0.5, 0.5]

Where the shares are carried out: on the process pool by :mod:`._fluid_pool` (a device is a worker
process), on Ray by :mod:`._ray` (a share is a task's resource request).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Sequence

from ..evaluators import StepwiseEvaluator, SupervisedTrainer

__all__ = ["fluid_shares", "StaticFluid", "DynamicFluid", "FluidScheduler", "Placement", "fluid_policy",
           "profile_step_time"]

log = logging.getLogger("tridens")


# -- the allocation rule -------------------------------------------------------------------------
def _check_int(owner: str, name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"The {name!r} parameter of {owner} must be an int in the range [{low}, inf). Got {value!r} instead.")


def fluid_shares(profiles: Sequence[float], devices: int, max_pack: int = 2, max_span: int | None = None) -> list[float]:
    """Fluid's share of ``devices`` for each trial, from its profile (predicted time on one device).

    ``w_i = min(max(floor(h_i / sum(h) * devices), 1 / max_pack), max_span)``: a share is either
    ``1 / max_pack`` (packed) or a whole number of devices, at most ``max_span`` (default: all).
    The shares may add up to more than ``devices`` (then some trials wait) or less (Fluid's rule
    rounds down; :class:`DynamicFluid` hands freed devices out later).

    >>> fluid_shares([3.0, 1.0], devices=2)
    [1.0, 0.5]
    >>> fluid_shares([1.0], devices=4, max_span=2)
    [2.0]
    """
    _check_int("fluid_shares", "devices", devices, 0)
    _check_int("fluid_shares", "max_pack", max_pack, 1)
    if max_span is not None:
        _check_int("fluid_shares", "max_span", max_span, 1)
    bad = [h for h in profiles if not (isinstance(h, (int, float)) and math.isfinite(h) and h >= 0)]
    if bad:
        raise ValueError(f"The 'profiles' parameter of fluid_shares must hold finite times >= 0. Got {bad[0]!r} instead.")
    span = max(devices, 1) if max_span is None else max_span
    total = float(sum(profiles))
    shares = []
    for h in profiles:
        whole = math.floor(h / total * devices + 1e-9) if total > 0 else 0
        shares.append(float(min(max(whole, 1.0 / max_pack), span)))
    return shares


@dataclass
class Placement:
    """A trial placed on devices: ``share`` below 1 packs it on ``devices[0]``; otherwise it spans
    ``devices`` (``len(devices) == share``)."""

    key: Hashable
    share: float
    devices: tuple[int, ...]


class StaticFluid:
    """Fluid's StaticFluid policy: shares from :func:`fluid_shares` over the idle devices.

    ``max_pack`` (c) is the most trials packed on one device, ``max_span`` (d) the most devices one
    trial spans (default: all). ``efficiency`` is the predicted data-parallel efficiency (a trial
    on ``w`` devices runs ``1 + (w - 1) * efficiency`` times faster) and ``epsilon`` the predicted
    cost in seconds of changing a running trial's share (checkpoint, restart); both only matter to
    :class:`DynamicFluid`. ``profile`` (optional) gives a trial's seconds per optimizer step on one
    device from its sample, for when they are known (earlier runs) or must not depend on this
    machine's load (tests); by default the executor measures them on the trial's first real
    training steps. Parameters are checked when a scheduler is made.

    >>> policy = StaticFluid(max_pack=2)
    >>> policy.shares([6.0, 1.0, 1.0], devices=2)
    [1.0, 0.5, 0.5]
    """

    dynamic = False

    def __init__(self, max_pack: int = 2, max_span: int | None = None, epsilon: float = 1.0, efficiency: float = 0.9,
                 profile: Callable[[Mapping[str, Any]], float] | None = None):
        self.max_pack = max_pack
        self.max_span = max_span
        self.epsilon = epsilon
        self.efficiency = efficiency
        self.profile = profile

    def _check(self) -> None:
        owner = type(self).__name__
        _check_int(owner, "max_pack", self.max_pack, 1)
        if self.max_span is not None:
            _check_int(owner, "max_span", self.max_span, 1)
        if not (isinstance(self.epsilon, (int, float)) and math.isfinite(self.epsilon) and self.epsilon >= 0):
            raise ValueError(f"The 'epsilon' parameter of {owner} must be a number of seconds >= 0. Got {self.epsilon!r} instead.")
        if not (isinstance(self.efficiency, (int, float)) and 0 < self.efficiency <= 1):
            raise ValueError(f"The 'efficiency' parameter of {owner} must be a number in the range (0, 1]. Got {self.efficiency!r} instead.")
        if self.profile is not None and not callable(self.profile):
            raise ValueError(f"The 'profile' parameter of {owner} must be None or a callable sample -> seconds per step. "
                             f"Got {self.profile!r} instead.")

    def step_time(self, sample: Mapping[str, Any]) -> float:
        """Seconds per step of the trial with ``sample`` by the ``profile`` function (checked)."""
        value = self.profile(sample)  # type: ignore[misc]
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
            raise ValueError(f"The 'profile' parameter of {type(self).__name__} must return a finite number of seconds "
                             f">= 0. Got {value!r} for the sample {dict(sample)!r} instead.")
        return float(value)

    def shares(self, profiles: Sequence[float], devices: int) -> list[float]:
        """:func:`fluid_shares` with this policy's limits."""
        return fluid_shares(profiles, devices, self.max_pack, self.max_span)

    def predict(self, h: float, share: float) -> float:
        """Predicted time of a trial with profile ``h`` at ``share`` devices: packed trials take
        turns (``h / share``), data parallel runs ``1 + (share - 1) * efficiency`` times faster."""
        if share < 1:
            return h / share
        return h / (1 + (share - 1) * self.efficiency)

    def scheduler(self, devices: int) -> "FluidScheduler":
        """A :class:`FluidScheduler` of ``devices`` devices under this policy."""
        self._check()
        return FluidScheduler(self, devices)

    def __repr__(self) -> str:
        profile = "" if self.profile is None else f", profile={self.profile!r}"
        return (f"{type(self).__name__}(max_pack={self.max_pack}, max_span={self.max_span}, "
                f"epsilon={self.epsilon}, efficiency={self.efficiency}{profile})")


class DynamicFluid(StaticFluid):
    """Fluid's DynamicFluid policy: re-runs the allocation over every unfinished trial and all
    devices as trials end, and moves a running trial to a new share only when that is predicted to
    pay (see the module docstring).

    >>> sched = DynamicFluid(epsilon=0).scheduler(devices=2)
    >>> sched.submit("a", 10.0); sched.submit("b", 1.0)
    >>> [(p.key, p.share) for p in sched.schedule()]
    [('a', 1.0), ('b', 0.5)]
    >>> sched.finish("b"); sched.schedule(); sched.rescales()
    []
    {'a': 2.0}
    """

    dynamic = True


@dataclass
class _Entry:
    key: Hashable
    remaining: float
    share: float = 0.0
    devices: tuple[int, ...] = ()
    target: float | None = None  # running: the share it should move to; waiting: the share it asked for
    order: int = 0


class FluidScheduler:
    """Which trial runs on which of ``devices`` devices, under a Fluid policy.

    Call :meth:`submit` for each trial (with its profile: predicted seconds left on one device),
    :meth:`schedule` to get the placements to start, :meth:`progress` as trials advance,
    :meth:`finish` when one ends, and, for :class:`DynamicFluid`, :meth:`rescales` for the running
    trials to stop at their next step boundary and :meth:`release` once one has (it is then placed
    again, at its new share, by the next :meth:`schedule`).
    """

    def __init__(self, policy: StaticFluid, devices: int):
        _check_int("FluidScheduler", "devices", devices, 1)
        self.policy, self.devices = policy, devices
        self.waiting: dict[Hashable, _Entry] = {}
        self.running: dict[Hashable, _Entry] = {}
        self.load: list[list[Hashable]] = [[] for _ in range(devices)]
        self._count = 0

    # -- events --------------------------------------------------------------------------------
    def submit(self, key: Hashable, remaining: float) -> None:
        """A new trial, predicted to need ``remaining`` seconds on one device."""
        self._count += 1
        self.waiting[key] = _Entry(key, float(remaining), order=self._count)

    def progress(self, key: Hashable, remaining: float) -> None:
        entry = self.running.get(key) or self.waiting.get(key)
        if entry is not None:
            entry.remaining = float(remaining)

    def finish(self, key: Hashable) -> None:
        """The trial ended (completed, stopped or failed): its devices are free."""
        self.waiting.pop(key, None)
        entry = self.running.pop(key, None)
        if entry is not None:
            self._free(entry)

    def release(self, key: Hashable, remaining: float) -> None:
        """A running trial stopped at a step boundary to change its share: it waits to be placed
        again at the share :meth:`rescales` gave it."""
        entry = self.running.pop(key)
        self._free(entry)
        entry.remaining, entry.share, entry.devices = float(remaining), 0.0, ()
        entry.order = -1  # placed before the others
        self.waiting[key] = entry

    def rescales(self) -> dict[Hashable, float]:
        """Running trials whose share should change: key -> new share."""
        return {k: e.target for k, e in self.running.items() if e.target is not None}

    # -- placing ---------------------------------------------------------------------------------
    def idle(self) -> list[int]:
        return [d for d, keys in enumerate(self.load) if not keys]

    def schedule(self) -> list[Placement]:
        """Place what can be placed now; returns the new placements (they count as running)."""
        policy = self.policy
        wants: dict[Hashable, float] = {}
        if policy.dynamic:
            active = [*self.running.values(), *self.waiting.values()]
            shares = policy.shares([e.remaining for e in active], self.devices) if active else []
            target = {e.key: s for e, s in zip(active, shares)}
            for entry in self.running.values():
                self._consider(entry, target[entry.key])
            for entry in self.waiting.values():
                wants[entry.key] = entry.target if entry.target is not None else target[entry.key]
        else:
            fresh = [e for e in self.waiting.values() if e.target is None]
            shares = policy.shares([e.remaining for e in fresh], len(self.idle())) if fresh else []
            wants = {e.key: s for e, s in zip(fresh, shares)}
            wants.update({e.key: e.target for e in self.waiting.values() if e.target is not None})
        # Idle devices promised to running trials that will grow at their next step boundary.
        reserved = sum(int(t) - (len(self.running[k].devices) if self.running[k].share >= 1 else 0)
                       for k, t in self.rescales().items() if t >= 1 and t > self.running[k].share)
        placed = []
        for entry in sorted(self.waiting.values(), key=lambda e: (e.order >= 0, -e.remaining, e.order)):
            placement = self._place(entry, wants[entry.key], 0 if entry.order < 0 else reserved)
            if placement is not None:
                placed.append(placement)
        return placed

    def _consider(self, entry: _Entry, new: float) -> None:
        """Algorithm 2's test for one running trial."""
        if entry.target is not None or new == entry.share:
            return
        policy, h, old = self.policy, entry.remaining, entry.share
        if old < 1 and self.load[entry.devices[0]] == [entry.key]:
            entry.share = old = 1.0  # its device-mates ended: it has the device to itself, no move needed
            if new == old:
                return
        if new > old:
            own = len(entry.devices) if old >= 1 else (1 if self.load[entry.devices[0]] == [entry.key] else 0)
            new = float(min(new, own + len(self.idle()))) if new >= 1 else new
            if new > old and policy.predict(h, new) + policy.epsilon < policy.predict(h, old):
                entry.target = new
        elif new * (policy.predict(h, new) + policy.epsilon) < old * policy.predict(h, old):
            entry.target = new

    def _place(self, entry: _Entry, share: float, reserved: int = 0) -> Placement | None:
        idle = self.idle()
        idle = idle[:max(len(idle) - reserved, 0)]
        if share >= 1:
            count = min(int(share), len(idle))
            if count < 1:
                return None
            devices = tuple(idle[:count])
            share = float(count)
        else:
            # The fullest device that still has room, else an idle one.
            room = [d for d, keys in enumerate(self.load) if keys and len(keys) < self.policy.max_pack
                    and all(self._share(k) < 1 for k in keys)
                    and sum(self._share(k) for k in keys) + share <= 1 + 1e-9]
            if room:
                devices = (max(room, key=lambda d: (len(self.load[d]), -d)),)
            elif idle:
                devices = (idle[0],)
            else:
                return None
        entry.share, entry.devices, entry.target = share, devices, None
        del self.waiting[entry.key]
        self.running[entry.key] = entry
        for d in devices:
            self.load[d].append(entry.key)
        return Placement(entry.key, share, devices)

    def _share(self, key: Hashable) -> float:
        return self.running[key].share

    def _free(self, entry: _Entry) -> None:
        for d in entry.devices:
            if entry.key in self.load[d]:
                self.load[d].remove(entry.key)


def fluid_policy(allocation: Any) -> StaticFluid:
    """The policy an ``allocation`` parameter names: ``"static"``, ``"dynamic"`` or a policy."""
    if isinstance(allocation, StaticFluid):
        return allocation
    if allocation == "static":
        return StaticFluid()
    if allocation == "dynamic":
        return DynamicFluid()
    raise ValueError(f"The 'allocation' parameter of Experiment must be None, 'static', 'dynamic' or a "
                     f"td.engine.StaticFluid/DynamicFluid. Got {allocation!r} instead.")


def profile_step_time(evaluator: StepwiseEvaluator, model: Any, sample: Mapping[str, Any], seed: int,
                      steps: int = 5) -> tuple[float, int, int]:
    """Measure a declarative trial's optimizer step time on a copy of its model (the trial itself
    is untouched): one warm-up step, then the fastest of ``steps`` steps (the least disturbed by
    other work on the machine). Returns ``(seconds per step, steps per epoch, epochs)``."""
    trainer = evaluator.trainer(copy.deepcopy(model), sample, seed)
    if not isinstance(trainer, SupervisedTrainer):  # only the declarative trainers step batch by batch
        raise TypeError(f"Fluid measures the step time of Classification/Regression trials, not of "
                        f"{type(evaluator).__name__}'s")
    cfg = trainer.config
    trainer.begin_epoch()
    batches = trainer.epoch_batches()
    times = []
    for _ in range(min(steps + 1, cfg.steps_per_epoch)):
        batch, x, y = next(batches)
        t0 = time.perf_counter()
        trainer.train_batch(x, y, batch)
        times.append(time.perf_counter() - t0)
    return min(times[1:] or times), cfg.steps_per_epoch, cfg.epochs
