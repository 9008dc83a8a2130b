"""Fluid on the process pool: a TrialGroup's trials placed on the
:class:`~._execution.ProcessExecutor`'s workers with the shares of a Fluid policy (:mod:`._fluid`).

A device is a worker process (one CPU core): packed trials take turns epoch by epoch in one worker,
and a share above 1 runs the trial with torch DDP (gloo) over that many workers (:mod:`._ddp`); its
ranks leave the gloo group cleanly and the workers serve the next placement. Step times are
measured on each trial's first real training steps (never on extra steps) and cached by structure
across the experiment's groups, or given by the policy's ``profile``. Fluid needs a declarative
(step-wise) evaluator; other evaluators run one trial per worker.

The driver side is :class:`FluidRun` (places trials, relays messages; each trial's outcome goes
through its :class:`~._protocol.TrialProtocol`); the worker side is :func:`serve_placement`. The
epoch helpers :func:`budget` and :func:`epoch_metrics` are shared with the Ray workers' DDP ranks.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, Sequence

import torch

from ..evaluators import Evaluator, StepwiseEvaluator
from ..units import Job
from ._lockstep import load_bytes, model_bytes, state_bytes, weights_bytes
from ._fluid import Placement, StaticFluid
from ._channel import ChannelClosed, PipeChannel, ready
from ._messages import Answer, Closed, Left, Outcome, Place, Profile, Report, ShipEvaluator, Started, Yielded
from ._protocol import GroupHooks, TrialProtocol, Verdict, error_text
from ._watchdog import check_silence, death_error, for_trial, settle

if TYPE_CHECKING:
    from ._execution import ProcessExecutor

__all__ = ["FluidRun", "serve_placement", "epoch_metrics", "budget"]

log = logging.getLogger("tridens")


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
        key = p.key
        assert isinstance(key, int)  # this run's scheduler is keyed by trial id
        ft = self.trials[key]
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
            self.hosts[slot].add(key)
            token = self.executor.ship(worker, self.evaluator)
            worker.channel.send(Place(job.trial.id, token, payload, job.trial.sample, job.trial.seed, job.max_steps,
                                   ft.state, measure, rank, len(p.devices), port))
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
                    number = self.trials[tid].life.trial.label
                    error = (for_trial(reason, number) if tid in victims else
                             f"trial {number} was lost with worker {s} (killed because of trial(s) "
                             f"{[self.trials[v].life.trial.label if v in self.trials else v for v in victims]})")
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
            channels = {}
            for s, tids in self.hosts.items():
                worker = executor.running(s)
                if tids and worker is not None:
                    channels[id(worker.channel)] = (s, worker.channel)
            for channel in ready([c for _, c in channels.values()], timeout=0.2):
                slot = channels[id(channel)][0]
                if self.hosts[slot]:
                    self._receive(slot, channel)
            now = time.monotonic()
            for tid in [t for t, entry in self.closing.items() if now > entry[1]]:
                log.warning("fluid: the ranks %s of trial %d did not tear their gloo group down within %s s; replaced",
                            sorted(self.closing[tid][0]), tid, CLOSE_TIMEOUT)
                self._closed(tid, None)
            for tid, ft in list(self.trials.items()):
                # A trial silent for longer than the timeout hangs inside an epoch: kill its worker.
                if ft.slots and tid in self.trials:
                    check_silence([ft.life], ft.last_message, functools.partial(self._kill_slot, ft.slots[0]))

    def _receive(self, slot: int, channel: PipeChannel) -> None:
        """One message from the worker in ``slot``."""
        try:
            message = channel.receive()
        except ChannelClosed:
            self._kill_slot(slot, death_error("worker process", channel.exit_description()))
            return
        tid = message.trial_id
        if isinstance(message, Closed):
            if tid in self.closing and slot in self.closing[tid][0]:
                self._closed(tid, slot)
            return
        ft = self.trials.get(tid)
        if ft is None:
            return
        ft.last_message = time.monotonic()
        life = ft.life
        if isinstance(message, Started):
            life.start()
        elif isinstance(message, Profile):
            if not ft.measured:
                self._learn(ft, message.step_time, message.per_epoch, message.epochs,
                            float(len(ft.slots)) if len(ft.slots) > 1 else 1.0)
        elif isinstance(message, Report):
            ft.epochs_done = message.step + 1
            verdict = life.report(message.step, message.metrics, last=ft.epochs_done >= ft.limit, seconds=message.seconds)
            self.sched.progress(tid, ft.remaining())
            if verdict is Verdict.DROP:  # past its timeout: failed by the protocol
                channel.send(Answer(tid, Verdict.DROP.value))
                self._end(tid)
            elif verdict is Verdict.CONTINUE and tid in self.sched.rescales():
                channel.send(Answer(tid, Verdict.YIELD.value))
            else:
                channel.send(Answer(tid, verdict.value))
        elif isinstance(message, Yielded):
            ft.state = message.state
            new = self.sched.rescales().get(tid)
            log.info("fluid: trial %d moves from %s to share %s after epoch %d", tid, ft.slots, new, ft.epochs_done)
            slots, ft.slots = ft.slots, ()

            def release(tid: int = tid, ft: _FluidTrial = ft) -> None:
                self.sched.release(tid, ft.remaining())

            self._vacate(tid, slots, release)
        elif isinstance(message, Left):
            # after an error the other ranks of a DDP trial may wait in a collective forever: replaced
            settle(self._end(tid, clean=message.outcome.kind != "error"), message.outcome, load_bytes)


# -- the worker side ------------------------------------------------------------------------------
def _trainer(evaluator: Evaluator, model: bytes, sample: Mapping[str, Any], seed: int, state: bytes | None) -> Any:
    import pickle

    if not isinstance(evaluator, StepwiseEvaluator):  # the driver plans Fluid only for these
        raise TypeError(f"Fluid trains step-wise evaluators, not {type(evaluator).__name__}")
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
        conn.send(Profile(tid, seconds, per_epoch, trainer.epochs))

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


def _await_decision(conn: Connection, tid: int, pending: list[Any], hosted: dict[int, Any] | None,
                    evaluators: dict[int, Evaluator]) -> str:
    """Read until the decision for ``tid`` arrives; placements arriving meanwhile join ``hosted``."""
    while True:
        message = conn.recv()
        if isinstance(message, Answer) and message.trial_id == tid:
            return message.verdict
        if isinstance(message, Place) and message.world == 1 and hosted is not None:
            _host(conn, message, hosted, evaluators)
        elif isinstance(message, ShipEvaluator):
            _take_evaluator(message, evaluators)
        else:
            pending.append(message)


def _take_evaluator(message: ShipEvaluator, evaluators: dict[int, Evaluator]) -> None:
    import pickle

    evaluators[message.token] = pickle.loads(message.payload)


def _host(conn: Connection, message: Place, hosted: dict[int, Any], evaluators: Mapping[int, Evaluator]) -> None:
    tid = message.trial_id
    evaluator = evaluators[message.token]
    try:
        conn.send(Started(tid))
        hosted[tid] = [evaluator, _trainer(evaluator, message.model, message.sample, message.seed, message.state),
                       message.max_steps, message.measure]
    except Exception as err:
        conn.send(Left(tid, Outcome("error", error=error_text(err))))


def serve_placement(conn: Connection, message: Place, evaluators: dict[int, Evaluator], pending: list[Any]) -> None:
    """Worker side of a Fluid placement: host packed trials (taking turns epoch by epoch, and
    accepting more while they run) or run one rank of a data-parallel trial."""
    torch.set_num_threads(1)
    if message.world > 1:
        _serve_ddp(conn, message, evaluators, pending)
        return

    hosted: dict[int, Any] = {}
    _host(conn, message, hosted, evaluators)
    while hosted:
        for tid in list(hosted):
            while conn.poll():  # more trials packed onto this worker meanwhile
                incoming = conn.recv()
                if isinstance(incoming, Place) and incoming.world == 1:
                    _host(conn, incoming, hosted, evaluators)
                elif isinstance(incoming, ShipEvaluator):
                    _take_evaluator(incoming, evaluators)
                else:
                    pending.append(incoming)
            evaluator, trainer, max_steps, measure = hosted[tid]
            try:
                t0 = time.perf_counter()
                step = trainer.epoch
                train = _profiled_epoch(trainer, conn, tid) if measure else trainer.train_epoch()
                hosted[tid][3] = False
                metrics = epoch_metrics(trainer, evaluator, train)
                conn.send(Report(tid, step, metrics, time.perf_counter() - t0))
            except Exception as err:
                conn.send(Left(tid, Outcome("error", error=error_text(err))))
                del hosted[tid]
                continue
            decision = _await_decision(conn, tid, pending, hosted, evaluators)
            if decision == "drop":
                del hosted[tid]
            elif decision == "yield":
                conn.send(Yielded(tid, state_bytes(trainer.state_dict())))
                del hosted[tid]
            elif decision in (Verdict.STOP.value, Verdict.DONE.value) or trainer.epoch >= budget(trainer, max_steps):
                conn.send(Left(tid, Outcome("done", metrics[evaluator.objective.metric], weights_bytes(trainer.model))))
                del hosted[tid]


def _serve_ddp(conn: Connection, message: Place, evaluators: dict[int, Evaluator], pending: list[Any]) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from . import _ddp

    tid, max_steps, measure, rank, world = message.trial_id, message.max_steps, message.measure, message.rank, message.world
    evaluator = evaluators[message.token]
    try:
        if rank == 0:
            conn.send(Started(tid))
        assert message.port is not None, "a data-parallel placement names its port"
        _ddp.init_group(rank, world, message.port)
        trainer = _trainer(evaluator, message.model, message.sample, message.seed, message.state)
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
                    conn.send(Profile(tid, min(times[1:] or times), _per_epoch(trainer), trainer.epochs))
                    measure = False
                metrics = epoch_metrics(trainer, evaluator, train, validated)
                conn.send(Report(tid, step, metrics, time.perf_counter() - t0))
                decision = _await_decision(conn, tid, pending, None, evaluators)
            decision = _ddp.broadcast(decision, rank)
            if decision == "drop":
                break
            if decision == "yield":
                if rank == 0:
                    conn.send(Yielded(tid, state_bytes(trainer.state_dict())))
                break
            if decision in (Verdict.STOP.value, Verdict.DONE.value) or trainer.epoch >= limit:
                if rank == 0:
                    conn.send(Left(tid, Outcome("done", metrics[evaluator.objective.metric],
                                                weights_bytes(trainer.model))))
                break
    except Exception as err:
        # A rank that failed alone may leave the others inside a collective: tearing the group
        # down could then wait for them (the hang seen before), so the driver replaces the ranks.
        conn.send(Left(tid, Outcome("error", error=f"rank {rank} of {world}: " + error_text(err))))
        _KEEP.append(locals().get("ddp"))  # no destructor runs before the driver kills this worker
        return
    # Every rank got here after the same last collective (the decision's broadcast): drop the DDP
    # wrapper (its reducer holds the group), meet at a barrier so no rank leaves while another
    # still has gloo work in flight, then destroy the group; this worker then serves placements again.
    del ddp
    _ddp.close_group()
    conn.send(Closed(tid))


_KEEP: list[Any] = []
