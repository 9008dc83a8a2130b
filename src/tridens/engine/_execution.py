"""Running a group of trials: the in-process executor (lockstep epochs for step-wise evaluators)
and the process-pool executor (each trial in its own process, for user loops that need isolation).

Executors never touch the store or the strategy: they call the hooks of :class:`GroupHooks`
(implemented by the experiment), which alone write results and ask for decisions.
"""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Mapping, Protocol, Sequence

import torch
from torch import nn

from ..evaluators._base import Evaluator, StepwiseEvaluator
from ..trial import Decision, Trial, TrialStatus

__all__ = ["Job", "GroupHooks", "Executor", "InlineExecutor", "ProcessExecutor", "TrialTimeout", "make_executor"]


class TrialTimeout(Exception):
    """A trial ran longer than ``trial_timeout``."""


@dataclass
class Job:
    """One trial to run: its record, its concrete model (None when the evaluator needs none)."""

    trial: Trial
    model: nn.Module | None
    max_steps: int | None = None
    started: float = field(default_factory=time.monotonic)


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


class InlineExecutor(Executor):
    """Runs trials in this process.

    With a step-wise evaluator the group's trials advance in lockstep, one epoch each in turn:
    every trial's result for an epoch is recorded before any decision for that epoch, so
    synchronous rules (Hyperband rungs) see the whole rung. The planner groups them into execution
    units, fused where ``optimize`` allows (:mod:`tridens.xopt`). Otherwise trials run one by one.
    """

    def __init__(self, optimize: bool = True):
        self.optimize = optimize

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
def _child_main(conn: Connection, evaluator: Evaluator, model: nn.Module | None, sample: dict[str, Any],
                seed: int, max_steps: int | None) -> None:
    """Entry point of a worker process: run one trial, talk to the driver over ``conn``."""
    torch.set_num_threads(1)

    class PipeReporter:
        def report(self, step: int, metrics: Mapping[str, float]) -> Decision:
            conn.send(("report", step, {k: float(v) for k, v in metrics.items()}))
            return Decision(conn.recv())

    try:
        conn.send(("started",))  # the timeout counts from here, not from the interpreter's start-up
        value = evaluator.evaluate(model, sample, seed, PipeReporter(), max_steps=max_steps)
        conn.send(("done", None if value is None else float(value), _weights_bytes(model)))
    except BaseException as err:  # report everything, even KeyboardInterrupt, before dying
        conn.send(("error", _error_text(err)))
    finally:
        conn.close()


@dataclass
class _Running:
    job: Job
    process: Any
    conn: Connection
    last: float | None = None


class ProcessExecutor(Executor):
    """Each trial in its own process (``spawn``), at most ``workers`` at a time.

    The driver streams reports back, asks the strategy and answers each report with a decision;
    a trial past ``trial_timeout`` is killed, and a worker that dies is a failed trial. The space,
    evaluator and model are pickled to the worker, so they must be importable (define them at
    module level and guard the script's main code with ``if __name__ == "__main__":``).
    """

    def __init__(self, workers: int = 2):
        self.workers = workers
        self._ctx = mp.get_context("spawn")

    def run_group(self, jobs: Sequence[Job], evaluator: Evaluator, hooks: GroupHooks) -> None:
        queue = list(jobs)
        running: list[_Running] = []
        while queue or running:
            while queue and len(running) < self.workers:
                job = queue.pop(0)
                parent, child = self._ctx.Pipe()
                proc = self._ctx.Process(target=_child_main, daemon=True,
                                         args=(child, evaluator, job.model, job.trial.sample, job.trial.seed, job.max_steps))
                job.started = math.inf  # set when the worker says it started
                proc.start()
                child.close()
                running.append(_Running(job, proc, parent))
            ready = wait([r.conn for r in running], timeout=0.2)
            for run in list(running):
                if run.conn in ready:
                    if not self._handle(run, evaluator, hooks):
                        running.remove(run)
                        continue
                timeout = hooks.trial_timeout
                if timeout is not None and time.monotonic() - run.job.started > timeout and run in running:
                    run.process.kill()
                    run.process.join()
                    hooks.finish(run.job.trial, TrialStatus.FAILED, value=run.last,
                                 error=f"trial {run.job.trial.id} exceeded trial_timeout={timeout} s and was killed")
                    running.remove(run)

    def _handle(self, run: _Running, evaluator: Evaluator, hooks: GroupHooks) -> bool:
        """Process one message; False when the trial is over."""
        trial = run.job.trial
        try:
            message = run.conn.recv()
        except (EOFError, OSError):
            run.process.join()
            hooks.finish(trial, TrialStatus.FAILED, value=run.last,
                         error=f"the worker process of trial {trial.id} died (exit code {run.process.exitcode})")
            return False
        kind = message[0]
        if kind == "started":
            run.job.started = time.monotonic()
            return True
        if kind == "report":
            _, step, metrics = message
            hooks.record(trial, step, metrics)
            run.last = next(iter(metrics.values()), None)
            decision = hooks.decide(trial, step)
            run.conn.send(decision.value)
            return True
        run.process.join()
        if kind == "error":
            hooks.finish(trial, TrialStatus.FAILED, value=run.last, error=message[1])
            return False
        _, value, payload = message
        weights = None if payload is None else torch.load(io.BytesIO(payload), weights_only=True)
        value = run.last if value is None else value
        status, error = _final_status(value)
        if status is TrialStatus.COMPLETED and trial.status is TrialStatus.STOPPED:
            status = TrialStatus.STOPPED
        hooks.finish(trial, status, error=error, weights=weights, value=value)
        return False


def make_executor(kind: str | Executor, workers: int, optimize: bool = True) -> Executor:
    if isinstance(kind, Executor):
        return kind
    if kind in ("inline", "in-process"):
        return InlineExecutor(optimize)
    if kind == "process":
        return ProcessExecutor(workers)
    raise ValueError(f"The 'executor' parameter of Experiment must be 'inline', 'process' or an Executor. Got {kind!r} instead.")
