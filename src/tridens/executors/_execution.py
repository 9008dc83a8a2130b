"""Executors: where a TrialGroup's trials train. Each is an object passed to
``td.Experiment(executor=...)``:

* :class:`InlineExecutor` (``td.executors.Inline()``, the default): in this process; step-wise
  evaluators train their planned units in lockstep epochs (:func:`run_lockstep`).
* :class:`ProcessExecutor` (``td.executors.Process(workers=2)``): long-lived worker processes that
  run trials one after another, for user loops that need isolation; with Fluid allocation, see
  :mod:`._fluid_pool`.
* :class:`~tridens.executors._ray.RayExecutor` (``td.executors.Ray(...)``): Ray tasks.

Executors never touch the store or the strategy: each trial's :class:`~._protocol.TrialProtocol`
turns what happened into the trial's records and outcome.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import select
import signal
import sys
import threading
import time
import types
from multiprocessing.connection import Connection
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..errors import ExecutorFault, UnknownMetric
from ..evaluators import Evaluator, StepwiseEvaluator, drive
from ..trial import Decision, Fork
from ..units import Job
from ._protocol import GroupHooks, RunHalted, TrialProtocol, TrialTimeout, Verdict, error_text
from ._threads import ThreadPolicy
from ._channel import PipeChannel
from ._messages import (Answer, End, Forked, Left, Outcome, Place, Quit, Report, RunTrial, RunUnit, ShipEvaluator,
                        Started, Verdicts)
from ._driver import decide_round
from ._watchdog import settle
from ._base import Executor, RunContext, run_context as _context
from ._lockstep import (LockstepJudge, UnitReport, fork_members, handed_source, load_bytes, model_bytes, plan_units,
                        run_lockstep, state_bytes, weights, weights_bytes, worker_payload)

__all__ = ["Executor", "RunContext", "InlineExecutor", "ProcessExecutor", "run_lockstep", "plan_units",
           "model_bytes", "weights_bytes", "state_bytes", "make_executor", "check_forks", "fork_members", "handed_source"]

log = logging.getLogger("tridens")


class _InProcessLink:
    """The :class:`~._lockstep.DriverLink` of units that train in the driver's process: each round
    decided at once by :func:`~._driver.decide_round` (every report recorded, then each member's
    verdict, then the forks); a member's outcome goes straight to its protocol."""

    def __init__(self, lives: Mapping[int, TrialProtocol]):
        self.lives = lives

    def keep(self, reports: Sequence[UnitReport]) -> None:
        """Nothing to keep: no other process takes over these members."""

    def round(self, reports: Sequence[Report]) -> Verdicts:
        # seconds 0: a unit in this process counts its members' training time itself
        decision = decide_round([(self.lives[r.trial_id], dataclasses.replace(r, seconds=0.0)) for r in reports])
        return Verdicts({tid: verdict.value for tid, verdict in decision.verdicts.items()},
                        [(tid, fork.source, fork.sample, None) for tid, fork in decision.forks.items()])

    def handed(self, handed: Any) -> Any:  # pragma: no cover - every source trains in this process
        raise TypeError("units in the driver's process hand no state over")

    def forked(self, message: Forked) -> None:
        self.lives[message.trial_id].forked(self.lives[message.source].trial, message.step,
                                            Fork(message.source, message.sample))

    def leave(self, trial_id: int, outcome: Outcome, weights: Mapping[str, Any] | None) -> None:
        settle(self.lives[trial_id], dataclasses.replace(outcome, weights=weights), lambda state: state)


class _Deadline:
    """``trial_timeout`` for a user's loop in this process: SIGALRM raises :class:`TrialTimeout`
    inside the loop, even one that never reports. Outside the main thread (no signals there) the
    timeout is checked at each report only. Deferred while the trial's records are written."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.quiet = 0
        self.pending = False

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        usable = (self.seconds is not None and hasattr(signal, "setitimer")
                  and threading.current_thread() is threading.main_thread())
        if not usable:
            yield
            return
        previous = signal.signal(signal.SIGALRM, self._expire)
        signal.setitimer(signal.ITIMER_REAL, float(self.seconds))  # type: ignore[arg-type]
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def _expire(self, signum: int, frame: Any) -> None:
        if self.quiet:
            self.pending = True
        else:
            raise TrialTimeout()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """No timeout raised inside the block (a store write); raised right after it instead."""
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1
        if self.pending and not self.quiet:
            self.pending = False
            raise TrialTimeout()


class _ProtocolReporter:
    """The Reporter handed to a user's loop in this process."""

    def __init__(self, life: TrialProtocol, deadline: _Deadline):
        self.life, self.deadline = life, deadline

    def report(self, step: int, metrics: Mapping[str, float]) -> Decision:
        with self.deadline.deferred():
            verdict = self.life.report(step, metrics)
        if verdict is Verdict.DROP:  # past its timeout: the protocol failed it
            raise TrialTimeout()
        return Decision.STOP if verdict is Verdict.STOP else Decision.CONTINUE


class InlineExecutor(Executor):
    """Runs trials in this process (the default executor).

    With a step-wise evaluator the group's trials advance in lockstep, one epoch each in turn:
    every trial's result for an epoch is recorded before any decision for that epoch, so
    synchronous rules (Hyperband rungs) see the whole rung. The planner groups them into execution
    units, fused where ``optimize`` allows (:mod:`tridens.xopt`). When the thread policy runs
    several units at once (idle cores, where side by side measured faster), they train side by
    side in forked processes in the same lockstep (:mod:`._forked`); otherwise one at a time, in
    this process. A user's loop runs its trials one by one,
    and ``trial_timeout`` interrupts a loop even between its reports (SIGALRM, main thread).
    ``optimize`` (None: the experiment's; True, False or a :class:`tridens.xopt.Settings`) overrides
    the experiment's ``optimize``, resolved once when the run starts; ``max_unit_memory`` (bytes or
    e.g. ``"2GiB"``; None: ``$TRIDENS_MAX_UNIT_MEMORY``, else half the RAM) bounds a fused unit's
    estimated memory. ``threads`` (a :class:`~tridens.engine.ThreadPolicy`, default ``ThreadPolicy()``) sets the torch
    threads each group's units train with, and those a user's loop (``FunctionalEvaluator``) runs
    with: the user's count where given, one on a machine with no idle core, every idle core
    otherwise.

    >>> exp = td.Experiment(space, evaluator, executor=td.executors.Inline())  # doctest: +SKIP
    """

    forks_members = True

    def __init__(self, optimize: Any = None, threads: ThreadPolicy | None = None,
                 max_unit_memory: int | str | None = None):
        self.optimize = optimize
        self.threads = ThreadPolicy() if threads is None else threads
        self.max_unit_memory = max_unit_memory

    def start(self, context: RunContext) -> None:
        """Take the run's settings; an ``optimize`` of this executor is resolved to one frozen
        :class:`tridens.xopt.Settings` for the run (True: the environment's)."""
        super().start(context)
        if self.optimize is not None and self.optimize is not False:
            from ..xopt import resolve_settings

            self.optimize = resolve_settings(self.optimize) or False

    def run_group(self, jobs: Sequence[Job], evaluator: Evaluator, hooks: GroupHooks) -> None:
        if isinstance(evaluator, StepwiseEvaluator):
            self._lockstep(jobs, evaluator, hooks)
        else:  # a user's loop: its step size is unknown, so the machine's load decides
            plan = self.threads.decide(None)
            log.info("threads: %d for the user's loop: %s", plan.threads, plan.reason)
            with plan.applied():
                for job in jobs:
                    self._one(job, evaluator, hooks)

    def _one(self, job: Job, evaluator: Evaluator, hooks: GroupHooks) -> None:
        life = TrialProtocol(job, hooks, clock="wall")
        life.start()
        deadline = _Deadline(hooks.trial_timeout)
        try:
            with deadline.armed():
                value = evaluator.evaluate(job.model, job.trial.sample, job.trial.seed,
                                           _ProtocolReporter(life, deadline), max_steps=job.max_steps)
        except TrialTimeout:
            life.time_out("and was interrupted")
            return
        except UnknownMetric:  # the run's objective names a metric the loop does not report: the run stops
            raise
        except Exception as err:  # a user's loop may raise anything; the run continues
            life.fail(err)
            return
        except SystemExit as err:  # sys.exit() inside the loop ends the trial, not the process
            life.fail(f"{error_text(err)}\ntrial {job.trial.label} called sys.exit({err.code!r}) inside its loop; "
                      "return (or raise) from the function instead")
            return
        life.finish(value, weights(job.model))

    def _lockstep(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, hooks: GroupHooks) -> None:
        optimize = _context(self).optimize if self.optimize is None else self.optimize
        lives = {job.trial.id: TrialProtocol(job, hooks, clock="train") for job in jobs}
        for life in lives.values():
            life.start()
        context = _context(self)
        units, failed = plan_units(jobs, evaluator, optimize, context=context.plan)
        for job, err in failed:
            lives[job.trial.id].fail(err)
        forks = bool(getattr(context, "forks", False))
        from ._forked import forkable

        why = "a strategy that forks members trains in one process" if forks else forkable(units)
        decisions = context.plan.decisions
        plan = self.threads.decide_units(units, parts=0 if forks else len(jobs) - len(failed), rates=decisions,
                                         splittable=not why)
        from ._threads import unit_sizes

        measured, before = unit_sizes(units), {tid: life.last_step for tid, life in lives.items()}
        started = time.perf_counter()
        if plan.concurrent > 1 and why:
            log.info("units one at a time in this process: %s", why)
        elif plan.concurrent > 1:
            from ._forked import run_forked
            from ._planner import spread_units
            from ._threads import shares

            order = [tid for unit in units for tid in unit.jobs]
            units = spread_units(units, evaluator, optimize, plan.concurrent, where="processes",
                                 context=context.plan)
            if len(units) > 1:
                with plan.applied():
                    run_forked(shares(units, plan.concurrent), lives, hooks, plan.threads, order,
                               decisions=decisions)
                _record_thread_rate(plan, measured, lives, before, time.perf_counter() - started, decisions)
                return
            if plan.option:  # a group that does not split: one unit on every idle core instead
                plan = self.threads.decide_units(units, rates=decisions, splittable=False)
        with plan.applied():
            run_lockstep(units, LockstepJudge(_InProcessLink(lives), evaluator))
        if plan.concurrent == 1:
            _record_thread_rate(plan, measured, lives, before, time.perf_counter() - started, decisions)


def _record_thread_rate(plan: Any, sizes: Sequence[tuple[float, Sequence[int]]], lives: Mapping[int, TrialProtocol],
                        before: Mapping[int, int], seconds: float, decisions: Any) -> None:
    """Record what a group's thread option achieved (its work per wall second: ``sizes``, each
    unit's step FLOPs and trials, times the epochs they trained) for later groups, when the option
    was the policy's choice."""
    if not plan.option or seconds <= 0:
        return
    from ._threads import ALONE, SIDE

    paired = decisions.thread_rates.get(tuple(plan.key), {})
    if paired.get(ALONE) and paired.get(SIDE):  # both options timed on one group: nothing to add
        return

    epochs = {tid: max(0, life.last_step - before[tid]) for tid, life in lives.items()}
    work = sum(flops * sum(epochs.get(tid, 0) for tid in tids) for flops, tids in sizes)
    if work > 0:
        decisions.record_thread_rate(plan.key, plan.option, work / seconds)
        log.info("threads: %s trained at %.3g GFLOP per second", plan.option, work / seconds / 1e9)


# -- process pool --------------------------------------------------------------------------------
# Messages (tridens.executors._messages), driver -> worker: ShipEvaluator (once per worker and evaluator),
# RunTrial (a trial alone, see ._pool_units.TrialRun), Place (Fluid, see ._fluid_pool), RunUnit (trials in
# lockstep, see ._pool_units), Answer (to a Report), Quit. Worker -> driver: Started, Report, Left (the
# trial's Outcome), End.


def _exit_with_driver(driver: int) -> None:
    """Watch the driver from a daemon thread: when it is gone (killed, even with SIGKILL) this
    worker exits too, whatever its trial is doing (a hanging trial included). The worker's parent
    is the driver, whose death changes it, or the forkserver, which exits with the driver; a
    forkserver killed on its own leaves the worker training, watching the driver's pid alone."""
    parent = os.getppid()
    forked_by_server = parent != driver

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):  # (PermissionError: the pid reused by another user)
            return False
        return True

    def watch() -> None:
        while (forked_by_server or os.getppid() == parent) and alive(driver):
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="tridens-driver-watch", daemon=True).start()


# What pool workers import before they serve: multiprocessing's forkserver imports them once, and
# each worker forked from it starts without re-importing torch, the evaluators, and torch._dynamo
# (which the first torch.optim optimizer imports): seconds of CPU per worker otherwise.
WORKER_PRELOAD = ["tridens.executors._execution", "torch._dynamo"]


def worker_context() -> Any:
    """The multiprocessing context pool workers start in: forkserver with :data:`WORKER_PRELOAD`
    where the platform has it (Linux, macOS), else spawn. Neither copies the driver's threads or
    CUDA state; both import the main module as spawn does (its ``if __name__ == "__main__"`` guard
    holds)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(WORKER_PRELOAD)  # (once the server runs, later calls change nothing)
        return ctx
    return mp.get_context("spawn")


def _worker_main(conn: Connection, index: int, driver: int | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
    """Entry point of a pool worker: serve trials one after another until told to quit.
    ``environ``: the driver's environment when it started the worker (a worker forked from the
    forkserver would otherwise have the server's, taken when the first pool started)."""
    import pickle

    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    # Ctrl-C and SIGTERM reach the whole process group: the driver alone stops the run (its trials
    # interrupted, not failed) and then ends its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if driver is not None:
        _exit_with_driver(driver)
    torch.set_num_threads(1)
    evaluators: dict[int, Evaluator] = {}
    pending: list[Any] = []  # messages read while waiting for something else
    while True:
        try:
            message = pending.pop(0) if pending else conn.recv()
        except (EOFError, OSError):  # the driver went away
            return
        if isinstance(message, Quit):
            return
        if isinstance(message, ShipEvaluator):
            evaluators[message.token] = pickle.loads(message.payload)
        elif isinstance(message, RunTrial):
            _serve_trial(conn, evaluators[message.token], message.trial_id, pickle.loads(message.model),
                         message.sample, message.seed, message.max_steps, load_bytes(message.state))
        elif isinstance(message, Place):
            from ._fluid_pool import serve_placement

            serve_placement(conn, message, evaluators, pending)
        elif isinstance(message, RunUnit):
            from ._pool_units import serve_unit

            serve_unit(conn, message, evaluators)


def _serve_trial(conn: Connection, evaluator: Evaluator, trial_id: int, model: nn.Module | None,
                 sample: dict[str, Any], seed: int, max_steps: int | None, state: Any = None) -> None:
    """Run one whole trial in this worker, streaming its reports to the driver."""

    class PipeReporter:
        def report(self, step: int, metrics: Mapping[str, float]) -> Decision:
            conn.send(Report(trial_id, step, {k: float(v) for k, v in metrics.items()}))
            reply: Answer = conn.recv()
            return Decision.STOP if reply.verdict == Verdict.STOP.value else Decision.CONTINUE

    torch.set_num_threads(1)  # a previous user loop may have changed it
    try:
        conn.send(Started(trial_id))  # the timeout counts from here, not from the worker's start-up
        if state is not None and isinstance(evaluator, StepwiseEvaluator):  # a fork: from that state on
            trainer = evaluator.trainer(model, sample, seed)
            trainer.load_state_dict(state)
            value = drive(trainer, evaluator.objective, PipeReporter(), max_steps=max_steps)
        else:
            value = evaluator.evaluate(model, sample, seed, PipeReporter(), max_steps=max_steps)
        conn.send(Left(trial_id, Outcome("done", None if value is None else float(value), weights_bytes(model))))
    except BaseException as err:  # report everything (SystemExit too); the worker serves the next trial
        conn.send(Left(trial_id, Outcome("error", error=error_text(err))))
        if isinstance(err, KeyboardInterrupt):
            raise
    conn.send(End())


@contextlib.contextmanager
def _main_not_imported() -> Iterator[None]:
    """While a worker starts, ``__main__`` is a bare module: multiprocessing then tells the worker
    to import no main module (a script without a ``__main__`` guard would run its search again
    there). What the worker needs from ``__main__`` travels by value (:func:`worker_payload`)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


_START_ATTEMPTS = 3
"""How many times a pool worker's start is tried when the forkserver dies under it."""


class PoolWorker:
    """One long-lived worker process of the pool and the driver's end of its pipe (``channel``)."""

    def __init__(self, ctx: Any, index: int):
        self.index = index
        ours, child = ctx.Pipe()
        for attempt in range(_START_ATTEMPTS):
            self.process = ctx.Process(target=_worker_main, args=(child, index, os.getpid(), dict(os.environ)),
                                       daemon=True, name=f"tridens-worker-{index}")
            try:
                with _main_not_imported():
                    self.process.start()
                break
            except (EOFError, OSError) as err:  # the forkserver died (killed) before it answered
                if ctx.get_start_method() != "forkserver":
                    raise
                if attempt + 1 == _START_ATTEMPTS:
                    ours.close()
                    child.close()
                    raise RunHalted(ExecutorFault(
                        f"multiprocessing's forkserver, the process that starts pool workers, died while starting "
                        f"worker {index} ({type(err).__name__}: {err or 'no answer'}), {_START_ATTEMPTS} times in a "
                        "row; finished trials are kept, the running ones run again on the next run")) from None
                log.warning("multiprocessing's forkserver, the process that starts pool workers, died while starting "
                            "worker %d; starting a new one", index)
                time.sleep(0.2 * (attempt + 1))   # (until the dead server is reaped: a new one is started then)
        child.close()
        self.channel = PipeChannel(ours, self.process)
        self.evaluators: set[int] = set()  # tokens of the evaluators this worker holds
        # A worker the forkserver started is the server's child, not ours: multiprocessing learns
        # its end from the server, and once the server died it takes every such worker for ended
        # (exit code 255) and its kill() sends nothing. A pidfd names this very process (never
        # another that reuses its pid), to see whether it runs and to kill it whatever the server did.
        self._pidfd = _pidfd_of(self.process.pid)

    def alive(self) -> bool:
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]   # a pidfd reads as ready once its process ended
        return self.channel.alive()

    def kill(self) -> None:
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(self._pidfd)
            self._pidfd = None
        self.channel.kill()

    def __del__(self) -> None:
        fd = getattr(self, "_pidfd", None)
        if fd is not None:
            os.close(fd)


def _pidfd_of(pid: int | None) -> int | None:
    """A pidfd of the process ``pid`` (Linux 5.3 and later), or None where there is none."""
    if pid is None or not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


class ProcessExecutor(Executor):
    """A pool of ``workers`` long-lived processes (:func:`worker_context`) that run trials one after another.

    Each trial runs in a worker, so a user loop that crashes its process, hangs or leaks memory
    cannot take the driver down: a trial past ``trial_timeout`` is killed with its worker, a worker
    that dies fails only its trial, and either way a fresh worker replaces it. The driver streams
    reports back and gives each to the trial's protocol; final weights come back as bytes. Workers
    are started on first use and kept until :meth:`close` (the experiment's end), so interpreter
    start-up and imports are paid once per worker, not once per trial; a worker exits when its
    driver dies. State a user loop leaves at module level in a worker (globals, caches) is seen by
    the next trial that worker runs; the random state is re-seeded for every trial by the evaluator.

    The evaluator and the models are pickled to the workers: by reference when they live in an
    importable module, by value (cloudpickle) when they are defined in ``__main__`` (``python -c``,
    a notebook, a script with or without a ``__main__`` guard), which workers never import.
    ``optimize`` (True, False or a :class:`tridens.xopt.Settings`) and ``max_unit_memory`` say
    whether and within what memory trials are fused, as for :class:`InlineExecutor`.
    With ``allocation`` (a :class:`~tridens.engine.StaticFluid` or
    :class:`~tridens.engine.DynamicFluid` policy) a declarative evaluator's TrialGroups are placed
    by Fluid: several trials packed on a worker, or one trial data-parallel over several.

    A declarative evaluator's trials that share training prefixes train as stage trees on the
    workers, and a strategy that forks members (PBT) trains its population in lockstep over the
    workers (:mod:`._pool_units`).

    >>> exp = td.Experiment(space, evaluator, executor=td.executors.Process(workers=4))  # doctest: +SKIP
    """

    forks_members = True

    def __init__(self, workers: int = 2, allocation: Any = None, optimize: Any = None,
                 max_unit_memory: int | str | None = None):
        self.workers = workers
        self.allocation = allocation  # (overrides the experiment's allocation)
        self.optimize = optimize  # None: fused where it pays (True); False or a td.xopt.Settings
        self.max_unit_memory = max_unit_memory  # a fused unit's bound (None: the environment's, else half the RAM)
        self._ctx = worker_context()
        self._pool: dict[int, PoolWorker] = {}
        self._payloads: dict[int, tuple[Evaluator, bytes]] = {}  # id(evaluator) -> (kept alive, pickle)
        self.fluid_profiles: dict[Any, float] = {}  # Fluid: measured seconds per step by trial structure

    @property
    def parallelism(self) -> int:  # type: ignore[override]
        return self.workers

    # -- the pool ------------------------------------------------------------------------------
    def worker(self, index: int) -> PoolWorker:
        """The live worker in slot ``index`` (started, or restarted after a death or a kill)."""
        current = self._pool.get(index)
        if current is None or not current.alive():
            if current is not None:
                current.kill()
            current = self._pool[index] = PoolWorker(self._ctx, index)
        return current

    def replace(self, index: int) -> None:
        """Kill the worker in slot ``index``; the next :meth:`worker` call starts a fresh one."""
        current = self._pool.pop(index, None)
        if current is not None:
            current.kill()

    def ship(self, worker: PoolWorker, evaluator: Evaluator) -> int:
        """Send ``evaluator`` to ``worker`` unless it holds it already; returns its token."""
        token = id(evaluator)
        if token not in self._payloads:
            self._payloads[token] = (evaluator, worker_payload(evaluator, f"the evaluator {type(evaluator).__name__}"))
        if token not in worker.evaluators:
            worker.channel.send(ShipEvaluator(token, self._payloads[token][1]))
            worker.evaluators.add(token)
        return token

    def pids(self) -> dict[int, int]:
        """Slot -> process id of the live workers."""
        return {i: w.process.pid for i, w in self._pool.items() if w.alive()}

    def close(self) -> None:
        for worker in self._pool.values():
            try:
                worker.channel.send(Quit())
            except OSError:
                pass
        for worker in self._pool.values():
            if worker.channel.exit_code(wait=5) is None:
                worker.channel.kill()
            worker.channel.close()
        self._pool.clear()

    # -- running a group -------------------------------------------------------------------------
    def run_group(self, jobs: Sequence[Job], evaluator: Evaluator, hooks: GroupHooks) -> None:
        wanted = min(self.workers, len(jobs))
        starting = [i for i in range(wanted) if i not in self.pids()]
        if starting:
            _context(self).say(f"starting {len(starting)} pool worker process(es) ({self._ctx.get_start_method()}; "
                               "the first start imports torch once); trials report once they run")
        for index in range(wanted):
            # Start the interpreters together: a first send blocks until its worker has started.
            self.worker(index)
        allocation = self.allocation if self.allocation is not None else _context(self).allocation
        if isinstance(evaluator, StepwiseEvaluator):
            from ._pool_units import UnitRun

            units = UnitRun.plan(self, jobs, evaluator, hooks, fluid=allocation is not None)
            if units is not None:   # stage trees, or a population that forks (PBT)
                units.run()
                return
        if allocation is not None and isinstance(evaluator, StepwiseEvaluator):
            from ._fluid import fluid_policy
            from ._fluid_pool import FluidRun

            FluidRun(self, jobs, evaluator, hooks, fluid_policy(allocation)).run()
            return
        from ._pool_units import TrialRun

        TrialRun(self, evaluator).run(jobs, hooks)


def check_forks(strategy: Any, executor: Any, evaluator: Any) -> None:
    """A strategy that forks running trials (``strategy.forks``, PBT) needs an executor that carries
    forks out and a declarative (step-wise) evaluator: one line naming what is missing otherwise.

    >>> check_forks(object(), "ray", None)  # a strategy that does not fork: anything goes
    """
    if not getattr(strategy, "forks", False):
        return
    name = type(strategy).__name__
    able = executor in (None, "inline", "in-process", "process", "ray") or getattr(executor, "forks_members", False)
    if not able:
        shown = executor if isinstance(executor, str) else type(executor).__name__
        raise ValueError(f"{name} forks running trials onto each other's state, which the executor {shown!r} cannot "
                         f"do (its forks_members is False); use td.executors.Inline(), Process() or Ray()")
    if evaluator is not None and not isinstance(evaluator, StepwiseEvaluator):
        raise ValueError(f"{name} forks running trials onto each other's state, which needs a declarative evaluator "
                         f"(td.evaluators.Classification or Regression). Got {type(evaluator).__name__} instead.")


def make_executor(kind: str | Executor, workers: int = 2, optimize: Any = None, *, ray_address: str | None = None,
                  storage: str | None = None, max_retries: int = 0, experiment: str | None = None,
                  allocation: Any = None) -> Executor:
    """An executor from today's ``executor=`` names (``"inline"``, ``"process"``, ``"ray"``) and
    their keyword arguments; an :class:`Executor` is returned as it is."""
    if isinstance(kind, Executor):
        return kind
    if kind in ("inline", "in-process"):
        return InlineExecutor(optimize)
    if kind == "process":
        return ProcessExecutor(workers, allocation)
    if kind == "ray":
        from ._ray import RayExecutor  # Ray is optional: imported only when asked for

        return RayExecutor(workers, ray_address, storage, max_retries, experiment=experiment, optimize=optimize,
                           allocation=allocation)
    raise ValueError(f"The 'executor' parameter of Experiment must be td.executors.Inline(), Process(...) or "
                     f"Ray(...). Got {kind!r} instead.")
