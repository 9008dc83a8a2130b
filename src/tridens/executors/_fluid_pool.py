"""Fluid on the process pool: a TrialGroup's trials placed on the
:class:`~._execution.ProcessExecutor`'s workers with the shares of a Fluid policy (:mod:`._fluid`).

A device is a worker process (one CPU core): packed trials take turns epoch by epoch in one worker,
and a share above 1 runs the trial with torch DDP (gloo) over that many workers (:mod:`._ddp`); its
ranks leave the gloo group cleanly and the workers serve the next placement. Step times are
measured on each trial's first real training steps (never on extra steps) and cached by structure
across the experiment's groups, or given by the policy's ``profile``. Fluid needs a declarative
(step-wise) evaluator; other evaluators run one trial per worker.

The driver side is :class:`FluidRun`, a :class:`~._driver.Placement` of the one driver
(:class:`~._driver.LockstepDriver`, each trial a site of one member): the schedule says which
sites start (:meth:`FluidRun.admit`) and which trials move (:meth:`FluidRun.moves`); a trial's
:class:`_TrialChannel` reads its messages off the pipes of the workers it is placed on (several
trials share a packed worker's pipe), so the driver's hang check, death message and outcomes
apply to each trial as to any other. A worker that dies or is killed (a trial on it hangs) takes
every trial on it. The worker side is :func:`serve_placement`. The epoch helpers :func:`budget`
and :func:`epoch_metrics` are shared with the Ray workers' DDP ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Hashable, Mapping, Sequence

import torch

from ..evaluators import Evaluator, StepwiseEvaluator
from ..units import Job
from ._lockstep import load_bytes, model_bytes, state_bytes, weights_bytes
from ._fluid import Placement as Shares, StaticFluid
from ._channel import Channel, ChannelClosed, PipeChannel
from ._driver import LockstepDriver, Placement, Site
from ._messages import Answer, Closed, End, Left, Outcome, Place, Profile, Report, ShipEvaluator, Started, Yielded
from ._protocol import GroupHooks, TrialProtocol, Verdict, error_text

if TYPE_CHECKING:
    from ._execution import ProcessExecutor

__all__ = ["FluidRun", "serve_placement", "epoch_metrics", "budget"]

log = logging.getLogger("tridens")


# -- the process executor's Fluid placement (driver side) --------------------------------------------
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


class _Pipe:
    """The pipe of the worker in ``slot``, read for the Fluid trials placed on it: each message goes
    to its trial's channel (``readers``); ``death`` says how the worker ended, once it did."""

    def __init__(self, slot: int, channel: PipeChannel):
        self.slot, self.channel = slot, channel
        self.readers: dict[int, _TrialChannel] = {}
        self.death: str | None = None

    def pump(self) -> None:
        """Every message the worker sent so far, to its trial's channel."""
        if self.death is None and self.channel.conn.closed:   # replaced meanwhile (it had died)
            self.death = self.channel.exit_description(wait=0)
        while self.death is None and self.channel.poll():
            try:
                message = self.channel.receive()
            except ChannelClosed:
                self.death = self.channel.exit_description()
                return
            reader = self.readers.get(message.trial_id)
            if reader is not None:
                reader.inbox.append((self.slot, message))


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
    history: list[dict[str, Any]] = field(default_factory=list)
    site: Site | None = None
    placement: Shares | None = None   # where the schedule placed it, until its site starts
    channel: _TrialChannel | None = None

    @property
    def job(self) -> Job:
        return self.life.job

    def remaining(self) -> float:
        return self.step_time * self.steps_per_epoch * max(self.limit - self.epochs_done, 0)


class _TrialChannel(Channel):
    """The driver's channel to one Fluid trial: what the workers it is placed on (``pipes``, rank
    0 first) say about it, after :meth:`FluidRun.heard` took what is the placement's (profiles,
    moves, the ranks' teardown); answers go to rank 0. Its :class:`~._messages.End` comes once the
    trial left and its devices are free (every rank of a DDP placement tore its group down)."""

    def __init__(self, run: FluidRun, ft: _FluidTrial):
        self.run, self.ft = run, ft
        self.pipes: list[_Pipe] = []
        self.inbox: list[tuple[int, Any]] = []   # (slot, message) as read off the pipes
        self.out: list[Any] = []                 # what the driver reads next
        self.closing: set[int] = set()           # DDP ranks (slots) yet to tear their group down
        self.closed: set[int] = set()            # ranks that tore it down (one may say so before rank 0 is read)
        self.deadline = 0.0
        self.over = False                        # the trial left (its End follows once the ranks closed)
        self.clean = True                        # no rank failed: the workers serve on

    def place(self, pipes: Sequence[_Pipe]) -> None:
        self.pipes, self.closed = list(pipes), set()
        for pipe in pipes:
            pipe.readers[self.ft.life.trial.id] = self

    def vacate(self) -> None:
        for pipe in self.pipes:
            if pipe.readers.get(self.ft.life.trial.id) is self:
                del pipe.readers[self.ft.life.trial.id]
        self.pipes = []

    def waitables(self) -> list[Any]:
        return [pipe.channel.conn for pipe in self.pipes if pipe.death is None and not pipe.channel.conn.closed]

    def _death(self) -> str | None:
        return next((pipe.death for pipe in self.pipes if pipe.death is not None), None)

    def buffered(self) -> bool:
        return bool(self.out or self.inbox) or self._finished() or self._death() is not None

    def _finished(self) -> bool:
        return self.over and not self.closing

    def teardown(self) -> bool:
        """The ranks of a DDP placement tear their group down: True when all of them did already."""
        self.closing, self.deadline = set(self.ft.slots) - self.closed, time.monotonic() + CLOSE_TIMEOUT
        return not self.closing

    def poll(self, timeout: float = 0.0) -> bool:
        for pipe in self.pipes:
            pipe.pump()
        while self.inbox:
            slot, message = self.inbox.pop(0)
            message = self.run.heard(self, slot, message)
            if message is not None:
                self.out.append(message)
        if self.closing and time.monotonic() > self.deadline:
            self.run.overdue(self)
        return bool(self.out) or self._finished() or self._death() is not None

    def receive(self) -> Any:
        if self.out:
            return self.out.pop(0)
        if self._finished():
            return End()
        death = self._death()
        if death is not None:
            raise ChannelClosed(death)
        raise RuntimeError(f"nothing to read from trial {self.ft.life.trial.id}'s workers")   # (poll() first)

    def send(self, message: Any) -> None:
        if not self.pipes:
            raise ChannelClosed(f"trial {self.ft.life.trial.id} is on no worker")
        self.pipes[0].channel.send(message)
        if isinstance(message, Answer) and message.verdict == Verdict.DROP.value:   # past its timeout
            self.run.left(self)

    def exit_description(self, wait: float = 2.0) -> str:
        return self._death() or "it ended"


class FluidRun(Placement):
    """One TrialGroup on a :class:`~._execution.ProcessExecutor`'s workers with Fluid shares (see
    the module docstring): the :class:`~._driver.Placement` of its trials, whose outcomes go
    through their :class:`~._protocol.TrialProtocol` in the driver; :meth:`run` trains it.

    Profiles: a trial's seconds per step come from ``policy.profile`` when given, else from the
    step times measured on earlier trials of the same structure (cached on the executor across
    groups), else they are assumed (the median of those measured so far, or 1 s) until the worker
    running the trial reports its first real steps -- no step is trained twice to measure it.
    """

    name, process, where = "a pool worker", "worker process", "in its worker"

    def __init__(self, executor: ProcessExecutor, jobs: Sequence[Job], evaluator: StepwiseEvaluator,
                 hooks: GroupHooks, policy: StaticFluid):
        self.executor, self.evaluator, self.hooks, self.policy = executor, evaluator, hooks, policy
        self.slots = executor.workers
        self.sched = policy.scheduler(executor.workers)
        self.cache: dict[Hashable, float] = executor.fluid_profiles  # kept across groups
        self.trials: dict[int, _FluidTrial] = {}
        self.token = id(evaluator)
        self.pipes: dict[int, _Pipe] = {}   # slot -> its worker's pipe
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
        ft.site, ft.channel = Site({job.trial.id: life}, ft), _TrialChannel(self, ft)
        if measured:
            job.trial.info["fluid_step_seconds"] = step_time
        self.sched.submit(job.trial.id, ft.remaining())

    def run(self) -> None:
        executor = self.executor
        for slot in range(executor.workers):
            # Every worker has started (and holds the evaluator) before anything is placed: the plan
            # assumes all devices are there, and a worker still starting would hold its trials back.
            executor.ship(executor.worker(slot), self.evaluator)
        LockstepDriver(self, lockstep=False).run([ft.site for ft in self.trials.values() if ft.site is not None])

    # -- the placement -------------------------------------------------------------------------------
    def admit(self, queue: Sequence[Site], running: int) -> list[Site]:
        """The sites of the trials the schedule places now; a trial that moved is placed again on
        its site, and one waiting for devices is not silent."""
        starting = []
        waiting = {id(site) for site in queue}
        for placement in self.sched.schedule():
            ft = self.trials[placement.key]   # type: ignore[index]
            assert ft.site is not None
            if id(ft.site) in waiting:
                ft.placement = placement
                starting.append(ft.site)
            else:
                self._place(ft, placement)
        now = time.monotonic()
        for ft in self.trials.values():
            if ft.site is not None and id(ft.site) not in waiting and not ft.slots:
                ft.site.last_message = now
        return starting

    def launch(self, site: Site) -> Channel:
        ft: _FluidTrial = site.data
        assert ft.placement is not None and ft.channel is not None
        self._place(ft, ft.placement)
        return ft.channel

    def _place(self, ft: _FluidTrial, p: Shares) -> None:
        assert ft.channel is not None and ft.site is not None
        ft.slots, ft.placement = p.devices, None
        ft.history.append({"share": p.share, "workers": list(p.devices), "from_epoch": ft.epochs_done})
        job = ft.job
        job.trial.info["allocation"] = ft.history
        port = None
        if p.share > 1:
            from ._ddp import free_port

            port = free_port()
        payload = model_bytes(job.model)
        pipes = []
        for rank, slot in enumerate(p.devices):
            worker = self.executor.worker(slot)
            pipe = self.pipes.get(slot)
            if pipe is None or pipe.channel is not worker.channel:
                pipe = self.pipes[slot] = _Pipe(slot, worker.channel)
            pipes.append(pipe)
            try:
                token = self.executor.ship(worker, self.evaluator)
                worker.channel.send(Place(job.trial.id, token, payload, job.trial.sample, job.trial.seed,
                                          job.max_steps, ft.state, not ft.measured, rank, len(p.devices), port))
            except ChannelClosed:   # died meanwhile: read as its death
                pass
        ft.state = None
        ft.channel.place(pipes)
        ft.site.last_message = time.monotonic()

    def moves(self, life: TrialProtocol, step: int) -> bool:
        return life.trial.id in self.sched.rescales()

    def kill(self, site: Site) -> None:
        """The trial's workers are replaced (it hangs, a worker died, or the run stops): every
        other trial on them dies with them."""
        ft: _FluidTrial = site.data
        channel = ft.channel
        assert channel is not None
        label = ft.life.trial.label
        for pipe in channel.pipes:
            if pipe.death is None and not pipe.channel.conn.closed:
                self.executor.replace(pipe.slot)
                pipe.death = f"{pipe.channel.exit_description(wait=0)}, killed with trial {label}"
        self._done(ft)

    def release(self, site: Site) -> None:
        """The trial left and its devices are free (a DDP placement whose rank failed is replaced:
        its other ranks may wait in a collective forever)."""
        ft: _FluidTrial = site.data
        assert ft.channel is not None
        if not ft.channel.clean and len(ft.channel.pipes) > 1:
            self.kill(site)
            return
        self._done(ft)

    def _done(self, ft: _FluidTrial) -> None:
        assert ft.channel is not None
        ft.channel.vacate()
        ft.slots = ()
        self.trials.pop(ft.life.trial.id, None)
        self.sched.finish(ft.life.trial.id)

    # -- what the workers say ----------------------------------------------------------------------
    def heard(self, channel: _TrialChannel, slot: int, message: Any) -> Any:
        """A message of ``channel``'s trial from the worker in ``slot``: what the placement takes
        (a rank's teardown, a move's checkpoint) is kept here, the rest goes on to the driver
        (None: nothing does)."""
        ft = channel.ft
        if isinstance(message, Closed):
            channel.closed.add(slot)
            if slot in channel.closing:
                channel.closing.discard(slot)
                if not channel.closing and not channel.over:   # moved off a DDP placement: placed again later
                    self._moved(ft)
            return None
        if isinstance(message, Profile):
            if not ft.measured:
                self._learn(ft, message.step_time, message.per_epoch, message.epochs,
                            float(len(ft.slots)) if len(ft.slots) > 1 else 1.0)
        elif isinstance(message, Report):
            ft.epochs_done = message.step + 1
            self.sched.progress(ft.life.trial.id, ft.remaining())
            return dataclasses.replace(message, last=ft.epochs_done >= ft.limit)
        elif isinstance(message, Yielded):
            ft.state = message.state
            log.info("fluid: trial %d moves from %s to share %s after epoch %d", ft.life.trial.id, ft.slots,
                     self.sched.rescales().get(ft.life.trial.id), ft.epochs_done)
            if len(channel.pipes) == 1 or channel.teardown():   # (a DDP placement's ranks tear their group down first)
                self._moved(ft)
            return None
        elif isinstance(message, Left):
            channel.clean = message.outcome.kind != "error"
            self.left(channel)
        return message

    def left(self, channel: _TrialChannel) -> None:
        """The trial leaves its workers (its outcome, or dropped past its timeout): its End follows
        once a clean DDP placement's ranks tore their group down."""
        if not channel.over:
            channel.over = True
            if len(channel.pipes) > 1 and channel.clean:
                channel.teardown()

    def overdue(self, channel: _TrialChannel) -> None:
        """Ranks of a DDP placement that did not tear their gloo group down in time are replaced;
        the trial goes on as if they had (it ends, or moves)."""
        log.warning("fluid: the ranks %s of trial %d did not tear their gloo group down within %s s; replaced",
                    sorted(channel.closing), channel.ft.life.trial.id, CLOSE_TIMEOUT)
        for pipe in channel.pipes:
            if pipe.slot in channel.closing:
                self.executor.replace(pipe.slot)
        channel.closing = set()
        if not channel.over:
            self._moved(channel.ft)

    def _moved(self, ft: _FluidTrial) -> None:
        """The trial left its workers to move: it waits to be placed again at its new share."""
        assert ft.channel is not None
        ft.channel.vacate()
        ft.slots = ()
        self.sched.release(ft.life.trial.id, ft.remaining())

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
