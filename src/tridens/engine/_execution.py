"""Running a group of trials: the in-process executor (lockstep epochs for step-wise evaluators)
and the process-pool executor (long-lived worker processes that run trials one after another, for
user loops that need isolation; with Fluid allocation, see :mod:`._fluid`).

Executors never touch the store or the strategy: they call the hooks of :class:`GroupHooks`
(implemented by the experiment), which alone write results and ask for decisions.
"""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping, Protocol, Sequence

import torch
from torch import nn

from ..evaluators._base import Evaluator, StepwiseEvaluator
from ..trial import Decision, Trial, TrialStatus
from ..units import ExecutionUnit, Job
from ._threads import ThreadPolicy

__all__ = ["Job", "GroupHooks", "Executor", "InlineExecutor", "ProcessExecutor", "TrialTimeout", "make_executor"]


class TrialTimeout(Exception):
    """A trial ran longer than ``trial_timeout``."""


class GroupHooks(Protocol):
    """What executors call back into (implemented by the experiment)."""

    trial_timeout: float | None

    def record(self, trial: Trial, step: int, metrics: Mapping[str, float]) -> None:
        """Store one step's metrics and tell the strategy the objective's value."""

    def decide(self, trial: Trial, step: int) -> Decision:
        """Ask the strategy whether ``trial`` continues after ``step``."""

    def finish(self, trial: Trial, status: TrialStatus, *, error: str | None = None,
               weights: Mapping[str, Any] | None = None, value: float | None = None) -> None:
        """Store the outcome (and final weights) of ``trial``; tell the strategy."""


class Executor:
    """Runs the jobs of one TrialGroup."""

    def run_group(self, jobs: Sequence[Job], evaluator: Evaluator, hooks: GroupHooks) -> None:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Release workers."""


def _error_text(err: BaseException) -> str:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)).strip()


def _weights(model: nn.Module | None) -> dict[str, Any] | None:
    return None if model is None else {k: v.detach().cpu() for k, v in model.state_dict().items()}


def model_bytes(model: nn.Module | None) -> bytes:
    """A model pickled by value for a worker. Sent as an object instead, its tensors would travel
    as handles to shared memory that torch moves the driver's own tensors into: every worker
    would then train the driver's copy in place (two DDP ranks would step the same weights twice)."""
    import pickle

    return pickle.dumps(model)


def _weights_bytes(model: nn.Module | None) -> bytes | None:
    """Weights serialized for the pipe: tensors sent as-is would travel as shared-memory handles
    that vanish when the worker exits right after sending."""
    weights = _weights(model)
    if weights is None:
        return None
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    return buffer.getvalue()


class _HookReporter:
    """The Reporter handed to a user loop: records, asks for a decision, enforces the timeout."""

    def __init__(self, job: Job, hooks: GroupHooks):
        self.job, self.hooks = job, hooks
        self.last: float | None = None
        self.reported = False

    def report(self, step: int, metrics: Mapping[str, float]) -> Decision:
        self.reported = True
        self.hooks.record(self.job.trial, step, metrics)
        first = next(iter(metrics.values()), None)
        self.last = None if first is None else float(first)
        timeout = self.hooks.trial_timeout
        if timeout is not None and time.monotonic() - self.job.started > timeout:
            raise TrialTimeout(f"trial {self.job.trial.id} exceeded trial_timeout={timeout} s at step {step}")
        return self.hooks.decide(self.job.trial, step)


def _final_status(value: float | None) -> tuple[TrialStatus, str | None]:
    if value is not None and isinstance(value, float) and math.isnan(value):
        return TrialStatus.FAILED, "the final metric is NaN"
    return TrialStatus.COMPLETED, None


def _done_outcome(message: tuple[Any, ...], last: float | None,
                  trial: Trial) -> tuple[TrialStatus, str | None, dict[str, Any] | None, float | None]:
    """A worker's ``("done", trial id, value, weight bytes)`` message as the trial's outcome:
    (status, error, weights, final value); a trial the strategy stopped stays STOPPED."""
    _, _, value, payload = message
    weights = None if payload is None else torch.load(io.BytesIO(payload), weights_only=True)
    value = last if value is None else value
    status, error = _final_status(value)
    if status is TrialStatus.COMPLETED and trial.status is TrialStatus.STOPPED:
        status = TrialStatus.STOPPED
    return status, error, weights, value


class InlineExecutor(Executor):
    """Runs trials in this process.

    With a step-wise evaluator the group's trials advance in lockstep, one epoch each in turn:
    every trial's result for an epoch is recorded before any decision for that epoch, so
    synchronous rules (Hyperband rungs) see the whole rung. The planner groups them into execution
    units, fused where ``optimize`` allows (:mod:`tridens.xopt`). Otherwise trials run one by one.
    ``threads`` (a :class:`~tridens.engine.ThreadPolicy`, default ``ThreadPolicy()``) sets the torch
    threads each group's units train with.
    """

    def __init__(self, optimize: bool = True, threads: ThreadPolicy | None = None):
        self.optimize = optimize
        self.threads = ThreadPolicy() if threads is None else threads

    def run_group(self, jobs: Sequence[Job], evaluator: Evaluator, hooks: GroupHooks) -> None:
        if isinstance(evaluator, StepwiseEvaluator):
            self._lockstep(jobs, evaluator, hooks)
        else:
            for job in jobs:
                self._one(job, evaluator, hooks)

    def _one(self, job: Job, evaluator: Evaluator, hooks: GroupHooks) -> None:
        job.started = time.monotonic()
        reporter = _HookReporter(job, hooks)
        try:
            value = evaluator.evaluate(job.model, job.trial.sample, job.trial.seed, reporter, max_steps=job.max_steps)
        except Exception as err:  # a user's loop may raise anything; the run continues
            hooks.finish(job.trial, TrialStatus.FAILED, error=_error_text(err))
            return
        value = reporter.last if value is None else float(value)
        status, error = _final_status(value)
        stopped = job.trial.status is TrialStatus.STOPPED
        hooks.finish(job.trial, TrialStatus.STOPPED if stopped and status is TrialStatus.COMPLETED else status,
                     error=error, weights=_weights(job.model), value=value)

    def _lockstep(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, hooks: GroupHooks) -> None:
        from ._planner import plan

        units = plan(jobs, evaluator, self.optimize)
        with self.threads.decide_units(units).applied():
            self._epochs(units, hooks)

    def _epochs(self, units: Sequence[ExecutionUnit], hooks: GroupHooks) -> None:
        step = 0
        while any(unit.active() for unit in units):
            for unit in units:
                for trial_id, result in unit.train_epoch().items():
                    job = unit.jobs[trial_id]
                    if isinstance(result, BaseException):
                        hooks.finish(job.trial, TrialStatus.FAILED, error=_error_text(result))
                        unit.drop(trial_id)
                    else:
                        hooks.record(job.trial, step, result)
            for unit in units:
                for job in unit.active():
                    trial_id = job.trial.id
                    values = job.trial.metrics.get(unit.objective.metric)
                    value = values[-1] if values else None
                    timeout = hooks.trial_timeout
                    if timeout is not None and job.trial.info.get("train_seconds", 0.0) > timeout:
                        hooks.finish(job.trial, TrialStatus.FAILED, value=value,
                                     error=f"trial {trial_id} exceeded trial_timeout={timeout} s after epoch {step}")
                    elif unit.epoch(trial_id) >= unit.limit(trial_id):
                        status, error = _final_status(value)
                        hooks.finish(job.trial, status, error=error, weights=unit.weights(trial_id), value=value)
                    elif hooks.decide(job.trial, step) is Decision.STOP:
                        hooks.finish(job.trial, TrialStatus.STOPPED, weights=unit.weights(trial_id), value=value)
                    else:
                        continue
                    unit.drop(trial_id)
            step += 1


# -- process pool --------------------------------------------------------------------------------
# Messages, driver -> worker:  ("evaluator", token, pickled evaluator)  sent once per worker and evaluator
#                              ("run", trial id, token, model bytes, sample, seed, max_steps)  one whole trial
#                              ("host", ...) / ("ddp", ...)  a Fluid placement (see tridens.engine._fluid)
#                              ("decision", trial id, value)  the answer to a "report"
#                              ("quit",)
# worker -> driver:            ("started", trial id)  ("report", trial id, step, metrics[, seconds])
#                              ("done", trial id, value, weights bytes)  ("error", trial id, traceback)
#                              ("yielded", trial id, trainer state bytes)  (Fluid)


def _worker_main(conn: Connection, index: int) -> None:
    """Entry point of a pool worker: serve trials one after another until told to quit."""
    import pickle

    torch.set_num_threads(1)
    evaluators: dict[int, Evaluator] = {}
    pending: list[tuple[Any, ...]] = []  # messages read while waiting for something else
    while True:
        try:
            message = pending.pop(0) if pending else conn.recv()
        except (EOFError, OSError):  # the driver went away
            return
        kind = message[0]
        if kind == "quit":
            return
        if kind == "evaluator":
            evaluators[message[1]] = pickle.loads(message[2])
        elif kind == "run":
            _, trial_id, token, model, sample, seed, max_steps = message
            _serve_trial(conn, evaluators[token], trial_id, pickle.loads(model), sample, seed, max_steps)
        elif kind in ("host", "ddp"):
            from ._fluid import serve_placement

            serve_placement(conn, message, evaluators, pending)


def _serve_trial(conn: Connection, evaluator: Evaluator, trial_id: int, model: nn.Module | None,
                 sample: dict[str, Any], seed: int, max_steps: int | None) -> None:
    """Run one whole trial in this worker, streaming its reports to the driver."""

    class PipeReporter:
        def report(self, step: int, metrics: Mapping[str, float]) -> Decision:
            conn.send(("report", trial_id, step, {k: float(v) for k, v in metrics.items()}))
            reply = conn.recv()
            return Decision(reply[2])

    torch.set_num_threads(1)  # a previous user loop may have changed it
    try:
        conn.send(("started", trial_id))  # the timeout counts from here, not from the worker's start-up
        value = evaluator.evaluate(model, sample, seed, PipeReporter(), max_steps=max_steps)
        conn.send(("done", trial_id, None if value is None else float(value), _weights_bytes(model)))
    except BaseException as err:  # report everything (SystemExit too); the worker serves the next trial
        conn.send(("error", trial_id, _error_text(err)))
        if isinstance(err, KeyboardInterrupt):
            raise


class _Worker:
    """One long-lived worker process of the pool and the driver's end of its pipe."""

    def __init__(self, ctx: Any, index: int):
        self.index = index
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, index), daemon=True,
                                   name=f"tridens-worker-{index}")
        self.process.start()
        child.close()
        self.evaluators: set[int] = set()  # tokens of the evaluators this worker holds

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


@dataclass
class _Running:
    job: Job
    worker: _Worker
    last: float | None = None


class ProcessExecutor(Executor):
    """A pool of ``workers`` long-lived processes (``spawn``) that run trials one after another.

    Each trial runs in a worker, so a user loop that crashes its process, hangs or leaks memory
    cannot take the driver down: a trial past ``trial_timeout`` is killed with its worker, a worker
    that dies fails only its trial, and either way a fresh worker replaces it. The driver streams
    reports back, records them and answers each with the strategy's decision; final weights come
    back as bytes. Workers are started on first use and kept until :meth:`close` (the experiment's
    end), so interpreter start-up and imports are paid once per worker, not once per trial. State a
    user loop leaves at module level in a worker (globals, caches) is seen by the next trial that
    worker runs; the random state is re-seeded for every trial by the evaluator.

    The evaluator and the models are pickled to the workers, so they must be importable (define
    them at module level and guard the script's main code with ``if __name__ == "__main__":``).
    With ``allocation`` (a :class:`~tridens.engine.StaticFluid` or
    :class:`~tridens.engine.DynamicFluid` policy) a declarative evaluator's TrialGroups are
    placed by Fluid: several trials packed on a worker, or one trial data-parallel over several.

    >>> exp = td.Experiment(space, evaluator, executor=td.engine.ProcessExecutor(workers=4))  # doctest: +SKIP
    """

    def __init__(self, workers: int = 2, allocation: Any = None):
        self.workers = workers
        self.allocation = allocation
        self._ctx = mp.get_context("spawn")
        self._pool: dict[int, _Worker] = {}
        self._payloads: dict[int, tuple[Evaluator, bytes]] = {}  # id(evaluator) -> (kept alive, pickle)
        self._fluid_profiles: dict[Any, float] = {}  # Fluid: measured seconds per step by trial structure

    # -- the pool ------------------------------------------------------------------------------
    def worker(self, index: int) -> _Worker:
        """The live worker in slot ``index`` (started, or restarted after a death or a kill)."""
        current = self._pool.get(index)
        if current is None or not current.alive():
            if current is not None:
                current.kill()
            current = self._pool[index] = _Worker(self._ctx, index)
        return current

    def replace(self, index: int) -> None:
        """Kill the worker in slot ``index``; the next :meth:`worker` call starts a fresh one."""
        current = self._pool.pop(index, None)
        if current is not None:
            current.kill()

    def ship(self, worker: _Worker, evaluator: Evaluator) -> int:
        """Send ``evaluator`` to ``worker`` unless it holds it already; returns its token."""
        import pickle

        token = id(evaluator)
        if token not in self._payloads:
            self._payloads[token] = (evaluator, pickle.dumps(evaluator))
        if token not in worker.evaluators:
            worker.conn.send(("evaluator", token, self._payloads[token][1]))
            worker.evaluators.add(token)
        return token

    def pids(self) -> dict[int, int]:
        """Slot -> process id of the live workers."""
        return {i: w.process.pid for i, w in self._pool.items() if w.alive()}

    def close(self) -> None:
        for worker in self._pool.values():
            try:
                worker.conn.send(("quit",))
            except (OSError, BrokenPipeError):
                pass
        for worker in self._pool.values():
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self._pool.clear()

    # -- running a group -------------------------------------------------------------------------
    def run_group(self, jobs: Sequence[Job], evaluator: Evaluator, hooks: GroupHooks) -> None:
        for index in range(min(self.workers, len(jobs))):
            # Start the interpreters together: a first send blocks until its worker has started.
            self.worker(index)
        if self.allocation is not None:
            from ._fluid import fluid_policy, run_fluid

            if isinstance(evaluator, StepwiseEvaluator):
                run_fluid(self, jobs, evaluator, hooks, fluid_policy(self.allocation))
                return
        queue = list(jobs)
        running: dict[int, _Running] = {}  # slot -> its trial
        while queue or running:
            for index in range(self.workers):
                if queue and index not in running:
                    job = queue.pop(0)
                    worker = self.worker(index)
                    job.started = math.inf  # set when the worker says it started
                    try:
                        token = self.ship(worker, evaluator)
                        worker.conn.send(("run", job.trial.id, token, model_bytes(job.model), job.trial.sample,
                                          job.trial.seed, job.max_steps))
                    except (OSError, BrokenPipeError):  # died between two trials: its message is read below
                        pass
                    running[index] = _Running(job, worker)
            ready = wait([run.worker.conn for run in running.values()], timeout=0.2)
            for index, run in list(running.items()):
                if run.worker.conn in ready and not self._handle(index, run, hooks):
                    del running[index]
                    continue
                timeout = hooks.trial_timeout
                if timeout is not None and time.monotonic() - run.job.started > timeout:
                    self.replace(index)
                    hooks.finish(run.job.trial, TrialStatus.FAILED, value=run.last,
                                 error=f"trial {run.job.trial.id} exceeded trial_timeout={timeout} s and was killed")
                    del running[index]

    def _handle(self, index: int, run: _Running, hooks: GroupHooks) -> bool:
        """Process one message of ``run``'s worker; False when the trial is over."""
        trial = run.job.trial
        try:
            message = run.worker.conn.recv()
        except (EOFError, OSError):
            run.worker.process.join()
            code = run.worker.process.exitcode
            self.replace(index)
            hooks.finish(trial, TrialStatus.FAILED, value=run.last,
                         error=f"the worker process of trial {trial.id} died (exit code {code})")
            return False
        kind = message[0]
        if kind == "started":
            run.job.started = time.monotonic()
            return True
        if kind == "report":
            _, _, step, metrics = message[:4]
            hooks.record(trial, step, metrics)
            run.last = next(iter(metrics.values()), None)
            decision = hooks.decide(trial, step)
            run.worker.conn.send(("decision", trial.id, decision.value))
            return True
        if kind == "error":
            hooks.finish(trial, TrialStatus.FAILED, value=run.last, error=message[2])
            return False
        status, error, weights, value = _done_outcome(message, run.last, trial)
        hooks.finish(trial, status, error=error, weights=weights, value=value)
        return False


def make_executor(kind: str | Executor, workers: int, optimize: bool = True, *, ray_address: str | None = None,
                  storage: str | None = None, max_retries: int = 0, experiment: str = "experiment",
                  allocation: Any = None) -> Executor:
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
    raise ValueError(f"The 'executor' parameter of Experiment must be 'inline', 'process', 'ray' or an Executor. Got {kind!r} instead.")
