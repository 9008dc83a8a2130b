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

In the process executor (``td.Experiment(..., executor="process", workers=n, allocation="static")``)
a device is a worker process (one CPU core): packed trials take turns epoch by epoch in one
worker, and a share above 1 runs the trial with torch DDP (gloo) over that many workers
(:mod:`._ddp`); its ranks leave the gloo group cleanly and the workers serve the next placement.
Step times are measured on each trial's first real training steps (never on extra steps) and
cached by structure across the experiment's groups, or given by the policy's ``profile``. Fluid
needs a declarative (step-wise) evaluator; other evaluators run one trial per worker.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, Sequence

import torch

from ..evaluators import Evaluator, StepwiseEvaluator
from ..units import Job
from ._execution import load_bytes, model_bytes, state_bytes, weights_bytes
from ._protocol import GroupHooks, TrialProtocol, Verdict, error_text, timeout_error

if TYPE_CHECKING:
    from ._execution import ProcessExecutor

__all__ = ["fluid_shares", "StaticFluid", "DynamicFluid", "FluidScheduler", "Placement", "fluid_policy",
           "profile_step_time", "FluidRun", "serve_placement", "epoch_metrics", "budget"]

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


# -- the process executor's Fluid loop (driver side) -------------------------------------------------
PROFILE_STEPS = 5      # steps timed (after one warm-up step) at the start of a trial's first epoch
CLOSE_TIMEOUT = 60.0   # seconds the ranks of a DDP placement get to tear their gloo group down


def _plan(evaluator: StepwiseEvaluator, sample: Mapping[str, Any]) -> tuple[int, int | None, Any]:
    """``(steps per epoch, epochs, config)`` known before training, from the evaluator's ``config``
    when it has one (the declarative supervised evaluators); otherwise the worker says later."""
    config = getattr(evaluator, "config", None)
    if callable(config):
        try:
            cfg = config(sample)
            return int(cfg.steps_per_epoch), int(cfg.epochs), cfg
        except Exception:  # an invalid sample: the worker fails the trial with the evaluator's own message
            pass
    return 1, None, None


def _structure(token: int, job: Job, cfg: Any) -> Hashable:
    """What a step time depends on: the evaluator, the network (the trial's structural fingerprint:
    ops, their configuration, parameter shapes; else the model's repr) and the batch size and
    optimizer. Successive-halving rungs and evolution's survivors come back with structures
    already measured."""
    net = job.trial.fingerprint or repr(job.model)
    return (token, net, getattr(cfg, "batch_size", None), getattr(cfg, "optimizer", None))


@dataclass
class _FluidTrial:
    life: TrialProtocol
    structure: Hashable
    step_time: float
    steps_per_epoch: int
    limit: int
    measured: bool = False           # step_time was measured on this trial (or given), not assumed
    epochs_done: int = 0
    state: bytes | None = None       # the trainer's checkpoint while it waits to move
    slots: tuple[int, ...] = ()
    last_message: float = field(default_factory=time.monotonic)
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def job(self) -> Job:
        return self.life.job

    def remaining(self) -> float:
        return self.step_time * self.steps_per_epoch * max(self.limit - self.epochs_done, 0)


class FluidRun:
    """One TrialGroup on a :class:`~._execution.ProcessExecutor`'s workers with Fluid shares (see
    the module docstring); :meth:`run` trains it. Each trial's outcome goes through its
    :class:`~._protocol.TrialProtocol`; this class only places trials and relays messages.

    Profiles: a trial's seconds per step come from ``policy.profile`` when given, else from the
    step times measured on earlier trials of the same structure (cached on the executor across
    groups), else they are assumed (the median of those measured so far, or 1 s) until the worker
    running the trial reports its first real steps -- no step is trained twice to measure it.
    """

    def __init__(self, executor: ProcessExecutor, jobs: Sequence[Job], evaluator: StepwiseEvaluator,
                 hooks: GroupHooks, policy: StaticFluid):
        self.executor, self.evaluator, self.hooks, self.policy = executor, evaluator, hooks, policy
        self.sched = policy.scheduler(executor.workers)
        self.cache: dict[Hashable, float] = executor.fluid_profiles  # kept across groups
        self.trials: dict[int, _FluidTrial] = {}
        self.token = id(evaluator)
        self.hosts: dict[int, set[int]] = {i: set() for i in range(executor.workers)}  # slot -> trial ids on it
        # DDP placements whose ranks are tearing their group down: trial id -> [slots yet to say
        # "closed", deadline, what frees the devices in the schedule once all have]
        self.closing: dict[int, list[Any]] = {}
        for job in jobs:
            self._submit(job)

    def _assumed(self, structure: Hashable) -> tuple[float, bool]:
        if structure in self.cache:
            return self.cache[structure], True
        known = sorted(self.cache.values())
        return (known[len(known) // 2] if known else 1.0), False

    def _submit(self, job: Job) -> None:
        life = TrialProtocol(job, self.hooks, clock="train")
        per_epoch, epochs, cfg = _plan(self.evaluator, job.trial.sample)
        structure = _structure(self.token, job, cfg)
        try:
            step_time, measured = ((self.policy.step_time(job.trial.sample), True) if self.policy.profile is not None
                                   else self._assumed(structure))
        except Exception as err:  # the user's profile function failed on this sample
            life.fail(err)
            return
        epochs = 1 if epochs is None else epochs
        limit = epochs if job.max_steps is None else min(epochs, job.max_steps)
        ft = self.trials[job.trial.id] = _FluidTrial(life, structure, step_time, per_epoch, limit, measured=measured)
        ft.state = state_bytes(job.start_from)
        if measured:
            job.trial.info["fluid_step_seconds"] = step_time
        self.sched.submit(job.trial.id, ft.remaining())

    # -- devices ---------------------------------------------------------------------------------
    def _vacate(self, tid: int, slots: Sequence[int], then: Callable[[], None], clean: bool = True) -> None:
        """The trial leaves ``slots``; ``then()`` frees its devices in the schedule. A DDP
        placement that ended cleanly first tears its gloo group down (barrier, destroy) and each
        rank says "closed": the devices are free only then, so nothing is sent to a rank still
        inside the teardown. A DDP placement that failed may have ranks blocked in a collective
        and is replaced."""
        if len(slots) > 1 and clean:
            self.closing[tid] = [set(slots), time.monotonic() + CLOSE_TIMEOUT, then]
            return
        for slot in slots:
            self.hosts[slot].discard(tid)
            if len(slots) > 1:
                self.executor.replace(slot)
        then()

    def _closed(self, tid: int, slot: int | None) -> None:
        entry = self.closing[tid]
        for s in ([slot] if slot is not None else list(entry[0])):
            entry[0].discard(s)
            self.hosts[s].discard(tid)
            if slot is None:
                self.executor.replace(s)
        if not entry[0]:
            del self.closing[tid]
            entry[2]()

    def _end(self, tid: int, clean: bool = True) -> TrialProtocol:
        """The trial leaves the run (its outcome is given to the returned protocol next)."""
        ft = self.trials.pop(tid)
        slots, ft.slots = ft.slots, ()
        self._vacate(tid, slots, lambda: self.sched.finish(tid), clean)
        if ft.history:
            ft.job.trial.info["allocation"] = ft.history
        return ft.life

    def _learn(self, ft: _FluidTrial, step_time: float, per_epoch: int | None, epochs: int | None,
               share: float) -> None:
        """A measured step time (of a share-``share`` placement) becomes the trial's profile and
        the structure's; trials still waiting on an assumed profile are re-estimated."""
        if share > 1:  # a data-parallel step: the one-device time by the policy's own model
            step_time *= 1 + (share - 1) * self.policy.efficiency
        job = ft.job
        if per_epoch:
            ft.steps_per_epoch = int(per_epoch)
        if epochs:
            ft.limit = epochs if job.max_steps is None else min(epochs, job.max_steps)
        ft.step_time, ft.measured = step_time, True
        job.trial.info["fluid_step_seconds"] = step_time
        self.cache[ft.structure] = step_time
        self.sched.progress(job.trial.id, ft.remaining())
        for tid, other in self.trials.items():
            if not other.measured and not other.slots:
                other.step_time, other.measured = self._assumed(other.structure)
                self.sched.progress(tid, other.remaining())

    def _launch(self, p: Placement) -> None:
        ft = self.trials[p.key]
        ft.slots = p.devices
        ft.last_message = time.monotonic()
        ft.history.append({"share": p.share, "workers": list(p.devices), "from_epoch": ft.epochs_done})
        job = ft.job
        port = None
        if p.share > 1:
            from ._ddp import free_port

            port = free_port()
        payload = model_bytes(job.model)
        measure = not ft.measured
        for rank, slot in enumerate(p.devices):
            worker = self.executor.worker(slot)
            self.hosts[slot].add(p.key)
            token = self.executor.ship(worker, self.evaluator)
            common = (job.trial.id, token, payload, job.trial.sample, job.trial.seed, job.max_steps, ft.state, measure)
            if port is None:
                worker.conn.send(("host", *common))
            else:
                worker.conn.send(("ddp", *common, rank, len(p.devices), port))
        ft.state = None

    def _kill_slot(self, slot: int, reason: str) -> None:
        """A worker died or hangs: kill it; every trial on it fails (with the other ranks of a DDP trial)."""
        victims = sorted(self.hosts[slot])
        slots = {slot}
        for tid in victims:
            slots |= set(self.trials[tid].slots) if tid in self.trials else set(self.closing.get(tid, [()])[0])
        for s in slots:
            self.executor.replace(s)
        for s in slots:
            for tid in sorted(self.hosts[s]):
                if tid in self.closing:  # its outcome is recorded already; only the devices are freed
                    self._closed(tid, None)
                elif tid in self.trials:
                    error = (reason.format(trial=tid) if tid in victims else
                             f"trial {tid} was lost with worker {s} (killed because of trial(s) {victims})")
                    self._end(tid, clean=False).fail(error)

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        executor = self.executor
        for slot in range(executor.workers):
            # Every worker has started (and holds the evaluator) before anything is placed: the plan
            # assumes all devices are there, and a worker still starting would hold its trials back.
            executor.ship(executor.worker(slot), self.evaluator)
        while self.trials or self.closing:
            for placement in self.sched.schedule():
                self._launch(placement)
            conns = {}
            for s, tids in self.hosts.items():
                worker = executor.running(s)
                if tids and worker is not None:
                    conns[worker.conn] = s
            for conn in wait(list(conns), timeout=0.2):
                slot = conns[conn]
                if self.hosts[slot]:
                    self._receive(slot, conn)
            now = time.monotonic()
            for tid in [t for t, entry in self.closing.items() if now > entry[1]]:
                log.warning("fluid: the ranks %s of trial %d did not tear their gloo group down within %s s; replaced",
                            sorted(self.closing[tid][0]), tid, CLOSE_TIMEOUT)
                self._closed(tid, None)
            for tid, ft in list(self.trials.items()):
                # A trial silent for longer than the timeout hangs inside an epoch: kill its worker.
                if ft.slots and tid in self.trials and ft.life.silent_too_long(ft.last_message):
                    self._kill_slot(ft.slots[0], timeout_error("{trial}", self.hooks.trial_timeout or 0.0,
                                                               "inside an epoch and was killed"))

    def _receive(self, slot: int, conn: Connection) -> None:
        """One message from the worker in ``slot``."""
        try:
            message = conn.recv()
        except (EOFError, OSError):
            worker = self.executor.running(slot)
            code = None if worker is None else worker.exit_code()
            self._kill_slot(slot, "the worker process of trial {trial} died (exit code %s)" % code)
            return
        kind, tid = message[0], message[1]
        if kind == "closed":
            if tid in self.closing and slot in self.closing[tid][0]:
                self._closed(tid, slot)
            return
        ft = self.trials.get(tid)
        if ft is None:
            return
        ft.last_message = time.monotonic()
        life = ft.life
        if kind == "started":
            life.start()
        elif kind == "profile":
            _, _, step_time, per_epoch, epochs = message
            if not ft.measured:
                self._learn(ft, step_time, per_epoch, epochs, float(len(ft.slots)) if len(ft.slots) > 1 else 1.0)
        elif kind == "report":
            _, _, step, metrics, seconds = message
            ft.epochs_done = step + 1
            verdict = life.report(step, metrics, last=ft.epochs_done >= ft.limit, seconds=seconds)
            self.sched.progress(tid, ft.remaining())
            if verdict is Verdict.DROP:  # past its timeout: failed by the protocol
                conn.send(("decision", tid, Verdict.DROP.value))
                self._end(tid)
            elif verdict is Verdict.CONTINUE and tid in self.sched.rescales():
                conn.send(("decision", tid, Verdict.YIELD.value))
            else:
                conn.send(("decision", tid, verdict.value))
        elif kind == "yielded":
            ft.state = message[2]
            new = self.sched.rescales().get(tid)
            log.info("fluid: trial %d moves from %s to share %s after epoch %d", tid, ft.slots, new, ft.epochs_done)
            slots, ft.slots = ft.slots, ()
            self._vacate(tid, slots, lambda tid=tid, ft=ft: self.sched.release(tid, ft.remaining()))
        elif kind == "error":  # the other ranks of a DDP trial may wait in a collective forever: replaced
            self._end(tid, clean=False).fail(message[2])
        elif kind == "done":
            _, _, value, payload = message
            self._end(tid).finish(value, load_bytes(payload))


# -- the worker side ------------------------------------------------------------------------------
def _trainer(evaluator: StepwiseEvaluator, model: bytes, sample: Mapping[str, Any], seed: int, state: bytes | None) -> Any:
    import pickle

    trainer = evaluator.trainer(pickle.loads(model), sample, seed)
    if state is not None:
        trainer.load_state_dict(load_bytes(state))
    return trainer


def budget(trainer: Any, max_steps: int | None) -> int:
    """How many epochs ``trainer`` trains in all: its epochs, capped by the group's ``max_steps``."""
    return trainer.epochs if max_steps is None else min(trainer.epochs, max_steps)


def _per_epoch(trainer: Any) -> int | None:
    return getattr(getattr(trainer, "config", None), "steps_per_epoch", None)


def _profiled_epoch(trainer: Any, conn: Connection, tid: int) -> dict[str, float]:
    """``trainer.train_epoch()`` (the same steps, the same numbers), timing its first steps: after
    one warm-up step and ``PROFILE_STEPS`` more, the fastest (the least disturbed by other work)
    goes to the driver as the trial's profile while the epoch goes on. A trainer without the
    step-wise parts (``begin_epoch``/``epoch_batches``/``train_batch``/``end_epoch``) is timed
    by the epoch."""
    def send(seconds: float, per_epoch: int | None) -> None:
        conn.send(("profile", tid, seconds, per_epoch, trainer.epochs))

    if not all(hasattr(trainer, m) for m in ("begin_epoch", "epoch_batches", "train_batch", "end_epoch")):
        t0 = time.perf_counter()
        out = trainer.train_epoch()
        send(time.perf_counter() - t0, 1)
        return out
    times: list[float] = []
    trainer.begin_epoch()
    total, count = 0.0, 0
    t0 = time.perf_counter()
    for batch, x, y in trainer.epoch_batches():  # as SupervisedTrainer.train_epoch
        total += trainer.train_batch(x, y, batch) * len(y)
        count += len(y)
        if len(times) <= PROFILE_STEPS:
            t1 = time.perf_counter()
            times.append(t1 - t0)  # the batch's preparation and its optimizer step
            t0 = t1
            if len(times) == PROFILE_STEPS + 1:
                send(min(times[1:]), _per_epoch(trainer))
    if len(times) <= PROFILE_STEPS:  # a short epoch: all of its steps
        send(min(times[1:] or times), _per_epoch(trainer))
    return trainer.end_epoch(total / count)


def epoch_metrics(trainer: Any, evaluator: Evaluator, train: dict[str, float],
                  validated: dict[str, float] | None = None) -> dict[str, float]:
    """An epoch's metrics as a unit reports them: the objective first, then validation, then training."""
    metric = evaluator.objective.metric
    metrics = {**(trainer.validate() if validated is None else validated), **train}
    if metric not in metrics:
        from ..errors import TridensError

        raise TridensError(f"the objective metric {metric!r} is not among the metrics {sorted(metrics)} "
                           f"that {type(trainer).__name__} produced")
    return {metric: float(metrics[metric]), **{k: float(v) for k, v in metrics.items()}}


def _await_decision(conn: Connection, tid: int, pending: list[tuple[Any, ...]], hosted: dict[int, Any] | None,
                    evaluators: Mapping[int, Evaluator]) -> str:
    """Read until the decision for ``tid`` arrives; placements arriving meanwhile join ``hosted``."""
    while True:
        message = conn.recv()
        if message[0] == "decision" and message[1] == tid:
            return message[2]
        if message[0] == "host" and hosted is not None:
            _host(conn, message, hosted, evaluators)
        elif message[0] == "evaluator":
            import pickle

            evaluators[message[1]] = pickle.loads(message[2])  # type: ignore[index]
        else:
            pending.append(message)


def _host(conn: Connection, message: tuple[Any, ...], hosted: dict[int, Any], evaluators: Mapping[int, Evaluator]) -> None:
    _, tid, token, model, sample, seed, max_steps, state, measure = message
    evaluator = evaluators[token]
    try:
        conn.send(("started", tid))
        hosted[tid] = [evaluator, _trainer(evaluator, model, sample, seed, state), max_steps, measure]
    except Exception as err:
        conn.send(("error", tid, error_text(err)))


def serve_placement(conn: Connection, message: tuple[Any, ...], evaluators: dict[int, Evaluator],
                    pending: list[tuple[Any, ...]]) -> None:
    """Worker side of a Fluid placement: host packed trials (taking turns epoch by epoch, and
    accepting more while they run) or run one rank of a data-parallel trial."""
    torch.set_num_threads(1)
    if message[0] == "ddp":
        _serve_ddp(conn, message, evaluators, pending)
        return

    hosted: dict[int, Any] = {}
    _host(conn, message, hosted, evaluators)
    while hosted:
        for tid in list(hosted):
            while conn.poll():  # more trials packed onto this worker meanwhile
                incoming = conn.recv()
                if incoming[0] == "host":
                    _host(conn, incoming, hosted, evaluators)
                elif incoming[0] == "evaluator":
                    import pickle

                    evaluators[incoming[1]] = pickle.loads(incoming[2])
                else:
                    pending.append(incoming)
            evaluator, trainer, max_steps, measure = hosted[tid]
            try:
                t0 = time.perf_counter()
                step = trainer.epoch
                train = _profiled_epoch(trainer, conn, tid) if measure else trainer.train_epoch()
                hosted[tid][3] = False
                metrics = epoch_metrics(trainer, evaluator, train)
                conn.send(("report", tid, step, metrics, time.perf_counter() - t0))
            except Exception as err:
                conn.send(("error", tid, error_text(err)))
                del hosted[tid]
                continue
            decision = _await_decision(conn, tid, pending, hosted, evaluators)
            if decision == "drop":
                del hosted[tid]
            elif decision == "yield":
                conn.send(("yielded", tid, state_bytes(trainer.state_dict())))
                del hosted[tid]
            elif decision in (Verdict.STOP.value, Verdict.DONE.value) or trainer.epoch >= budget(trainer, max_steps):
                conn.send(("done", tid, metrics[evaluator.objective.metric], weights_bytes(trainer.model)))
                del hosted[tid]


def _serve_ddp(conn: Connection, message: tuple[Any, ...], evaluators: dict[int, Evaluator],
               pending: list[tuple[Any, ...]]) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from . import _ddp

    _, tid, token, model, sample, seed, max_steps, state, measure, rank, world, port = message
    evaluator = evaluators[token]
    try:
        if rank == 0:
            conn.send(("started", tid))
        _ddp.init_group(rank, world, port)
        trainer = _trainer(evaluator, model, sample, seed, state)
        ddp = DistributedDataParallel(trainer.model)
        limit = budget(trainer, max_steps)
        while True:
            t0 = time.perf_counter()
            step = trainer.epoch
            times: list[float] | None = [] if measure and rank == 0 else None
            train = _ddp.train_epoch(trainer, rank, world, ddp, step_times=times, max_timed=PROFILE_STEPS + 1)
            validated = _ddp.validate(trainer, rank, world)  # every rank scores its share of the batches
            decision = None
            if rank == 0:
                if times:
                    conn.send(("profile", tid, min(times[1:] or times), _per_epoch(trainer), trainer.epochs))
                    measure = False
                metrics = epoch_metrics(trainer, evaluator, train, validated)
                conn.send(("report", tid, step, metrics, time.perf_counter() - t0))
                decision = _await_decision(conn, tid, pending, None, evaluators)
            decision = _ddp.broadcast(decision, rank)
            if decision == "drop":
                break
            if decision == "yield":
                if rank == 0:
                    conn.send(("yielded", tid, state_bytes(trainer.state_dict())))
                break
            if decision in (Verdict.STOP.value, Verdict.DONE.value) or trainer.epoch >= limit:
                if rank == 0:
                    conn.send(("done", tid, metrics[evaluator.objective.metric], weights_bytes(trainer.model)))
                break
    except Exception as err:
        # A rank that failed alone may leave the others inside a collective: tearing the group
        # down could then wait for them (the hang seen before), so the driver replaces the ranks.
        conn.send(("error", tid, f"rank {rank} of {world}: " + error_text(err)))
        _KEEP.append(locals().get("ddp"))  # no destructor runs before the driver kills this worker
        return
    # Every rank got here after the same last collective (the decision's broadcast): drop the DDP
    # wrapper (its reducer holds the group), meet at a barrier so no rank leaves while another
    # still has gloo work in flight, then destroy the group; this worker then serves placements again.
    del ddp
    _ddp.close_group()
    conn.send(("closed", tid))


_KEEP: list[Any] = []
