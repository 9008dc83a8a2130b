"""The lockstep loop every executor trains units with (:func:`run_lockstep`: epochs, then
verdicts, then forks), its judges' base, the restart of members from their last round
(:func:`resume_units`, answered again by the driver's :class:`RoundAnswers`), and what travels to
another process as bytes (models, trainer states, weights; :func:`worker_payload` for what
``__main__`` defines)."""

from __future__ import annotations

import copy
import io
import logging
import pickle
import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
from torch import nn

from ..errors import TridensError
from ..evaluators import StepwiseEvaluator
from ..trial import Fork
from ..units import ExecutionUnit, Job, SeparateUnit
from ._messages import Forked, Outcome, Report, Verdicts
from ._protocol import Verdict, error_text

__all__ = ["weights", "worker_payload", "model_bytes", "state_bytes", "weights_bytes", "load_bytes", "plan_units",
           "UnitReport", "DriverLink", "LockstepJudge", "RoundAnswers", "handed_source", "fork_members", "run_lockstep",
           "resume_units"]

log = logging.getLogger("tridens")


def weights(model: nn.Module | None) -> dict[str, Any] | None:
    """A detached CPU copy of ``model``'s state_dict (None without a model)."""
    return None if model is None else {k: v.detach().cpu() for k, v in model.state_dict().items()}


class _MainSpotter(pickle.Pickler):
    """A pickler that notes the first class or function of ``__main__`` it pickles by reference."""

    main: str | None = None

    def reducer_override(self, obj: Any) -> Any:
        if self.main is None and isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.main = getattr(obj, "__qualname__", repr(obj))
        return NotImplemented


def worker_payload(obj: Any, what: str) -> bytes:
    """``obj`` pickled for a pool worker. Workers never import the driver's ``__main__`` (a script
    without a ``__main__`` guard would run its search again there; ``python -c`` and a notebook
    have no file to import), so what ``obj`` holds from ``__main__`` -- an evaluator function, a
    space, a dataset class defined there -- travels by value through cloudpickle (installed with
    Ray), as does a lambda or a local function. ``what`` names ``obj`` in the one-line error
    raised when that is needed and cloudpickle is not installed.

    >>> import pickle
    >>> pickle.loads(worker_payload({"lr": 0.1}, "a sample"))
    {'lr': 0.1}
    """
    buffer = io.BytesIO()
    spotter = _MainSpotter(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        spotter.dump(obj)
        if spotter.main is None:
            return buffer.getvalue()
        reason = f"{spotter.main} is defined in __main__ (python -c, a notebook, a script), which pool workers do not import"
    except (pickle.PicklingError, AttributeError, TypeError) as err:  # a lambda, a local function
        reason = f"it cannot be pickled by reference ({err})"
    try:
        import cloudpickle
    except ImportError:
        raise TridensError(f"{what} cannot reach td.executors.Process's workers: {reason}; move it to an importable "
                           "module, or install cloudpickle (pip install cloudpickle) to send it by value") from None
    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def model_bytes(model: nn.Module | None) -> bytes:
    """A model pickled by value for a worker (:func:`worker_payload`). Sent as an object instead,
    its tensors would travel as handles to shared memory that torch moves the driver's own
    tensors into: every worker would then train the driver's copy in place (two DDP ranks would
    step the same weights twice)."""
    return worker_payload(model, "the model" if model is None else f"the model {type(model).__name__}")


def state_bytes(state: Any) -> bytes | None:
    """``torch.save`` of ``state`` for a pipe (None stays None): tensors sent as-is would travel as
    shared-memory handles that vanish when the worker exits right after sending."""
    if state is None:
        return None
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def weights_bytes(model: nn.Module | None) -> bytes | None:
    """The final weights of ``model`` serialized for the pipe."""
    return state_bytes(weights(model))


def load_bytes(payload: bytes | None) -> Any:
    """What :func:`state_bytes` wrote (tensors only: nothing else is unpickled)."""
    return None if payload is None else torch.load(io.BytesIO(payload), weights_only=True)


def plan_units(jobs: Sequence[Job], evaluator: StepwiseEvaluator, optimize: Any, **kw: Any
               ) -> tuple[list[ExecutionUnit], list[tuple[Job, BaseException]]]:
    """The units that train ``jobs``: the planner's, and one separate unit for the jobs that start
    from another member's state (``Job.start_from``: a fork), loaded into it. Returns the units and
    the forked jobs whose state could not be loaded (with the error)."""
    from ._planner import plan

    fresh = [job for job in jobs if job.start_from is None]
    forked = [job for job in jobs if job.start_from is not None]
    units: list[ExecutionUnit] = plan(fresh, evaluator, optimize, **kw) if fresh else []
    failed: list[tuple[Job, BaseException]] = []
    if forked:
        unit = SeparateUnit(forked, evaluator, reason="started from another member's state (a fork)")
        for job in forked:
            try:
                unit.load_state_dict(job.trial.id, job.start_from or {})
            except Exception as err:
                failed.append((job, err))
                unit.drop(job.trial.id)
        units.append(unit)
    return units, failed


@dataclass
class UnitReport:
    """One member's epoch, as :func:`run_lockstep` hands it to its judge."""

    unit: ExecutionUnit
    trial_id: int
    step: int
    metrics: Mapping[str, float] | None  # None: it trained nothing (its budget was spent already)
    last: bool                           # the last epoch of its budget
    seconds: float


class DriverLink(Protocol):
    """The worker's end of its conversation with the driver, as :class:`LockstepJudge` uses it:
    a pipe to the driver (a pool worker, a forked child), the Ray hub and storage (a Ray task), or
    the driver itself (units that train in the driver's process)."""

    def keep(self, reports: Sequence[UnitReport]) -> None:
        """Keep each member's state of this round where a fresh worker finds it, before the round
        is reported (:func:`resume_units`); nothing where no worker replaces this one."""

    def round(self, reports: Sequence[Report]) -> Verdicts:
        """Report one round; the driver's answer: each member's verdict value and the forks
        ``(trial, source, sample, handed)``, ``handed`` what :meth:`handed` reads (None: the source
        trains in the same process)."""

    def handed(self, handed: Any) -> tuple[int, dict[str, Any], nn.Module | None, Mapping[str, Any]]:
        """A fork's source trained elsewhere: its seed, sample, initial model and trainer state."""

    def forked(self, message: Forked) -> None:
        """Member ``message.trial_id`` now continues from its source's state (the driver records the lineage)."""

    def leave(self, trial_id: int, outcome: Outcome, weights: Mapping[str, Any] | None) -> None:
        """Member ``trial_id`` leaves with ``outcome`` (its final ``weights`` beside it, sent as the link sends them)."""


class LockstepJudge:
    """What :func:`run_lockstep` asks after each round of epochs, wherever the units train: the
    round goes to the driver through ``link`` (:class:`DriverLink`), whose answer holds each
    member's verdict and the forks (PBT); a member leaves through the link with its outcome.
    ``evaluator`` builds the stand-in of a fork's source that trains elsewhere
    (:func:`handed_source`). Members whose budget was spent before the round are done without
    asking.

    >>> run_lockstep(units, LockstepJudge(link, evaluator))    # doctest: +SKIP
    """

    def __init__(self, link: DriverLink, evaluator: StepwiseEvaluator):
        self.link, self.evaluator = link, evaluator
        self.given: dict[int, tuple[Any, ...]] = {}
        self.left: set[int] = set()

    def checkpoint(self, reports: Sequence[UnitReport]) -> None:
        """Before :meth:`judge`: keep each member's state of this round (a worker that may die
        writes it where a fresh worker finds it, :func:`resume_units`)."""
        self.link.keep(reports)

    def judge(self, reports: Sequence[UnitReport]) -> list[Verdict]:
        """One verdict per report, the driver's for the members that trained this round."""
        asks = [Report(r.trial_id, r.step, dict(r.metrics), r.seconds, r.last) for r in reports if r.metrics is not None]
        answers: dict[int, Any] = {}
        self.given = {}
        if asks:
            answer = self.link.round(asks)
            answers, self.given = answer.answers, {fork[0]: fork for fork in answer.forks}
        return [Verdict.DONE if r.metrics is None else Verdict(answers[r.trial_id]) for r in reports]

    def failed(self, unit: ExecutionUnit | None, trial_id: int, err: BaseException | str) -> None:
        """The member's epoch raised (or its unit could not be planned): it leaves the unit, failed."""
        if trial_id not in self.left:
            self.left.add(trial_id)
            self.link.leave(trial_id, Outcome("error", error=err if isinstance(err, str) else error_text(err)), None)

    def finished(self, report: UnitReport, verdict: Verdict) -> None:
        """The member ends (:attr:`Verdict.STOP`/``DONE``, with its final weights from ``report.unit``),
        or leaves without them (``DROP``: failed on the driver already; ``YIELD``: to another share)."""
        tid = report.trial_id
        if tid in self.left:
            return
        self.left.add(tid)
        value = None if report.metrics is None else report.metrics[next(iter(report.metrics))]
        if verdict is Verdict.DROP:
            self.link.leave(tid, Outcome("dropped"), None)
        elif verdict is Verdict.YIELD:
            self.link.leave(tid, Outcome("yielded", value), None)
        else:
            self.link.leave(tid, Outcome("stopped" if verdict is Verdict.STOP else "done", value),
                            report.unit.weights(tid))

    def forks(self, reports: Sequence[UnitReport]) -> list[tuple[UnitReport, Fork]]:
        """Of the members that continue (``reports``), those the driver moves onto another member's state."""
        return [(r, Fork(self.given[r.trial_id][1], self.given[r.trial_id][2])) for r in reports
                if r.trial_id in self.given]

    def forked(self, report: UnitReport, fork: Fork) -> None:
        """The member now continues from ``fork.source``'s state: the driver records the lineage."""
        self.link.forked(Forked(report.trial_id, fork.source, report.step, dict(fork.sample)))

    def handed(self, report: UnitReport, fork: Fork) -> ExecutionUnit | None:
        """A fork whose source trains in another process: a unit holding only the source member,
        loaded with the state handed over from there (None: the source trains in this loop)."""
        entry = self.given.get(report.trial_id)
        if entry is None or entry[3] is None:
            return None
        seed, sample, model, state = self.link.handed(entry[3])
        return handed_source(self.evaluator, fork.source, seed, sample, model, state)


class RoundAnswers:
    """The driver's last answer to each member of a population that trains in lockstep in other
    processes (PBT on the pool or on Ray): the member's step, the answer as sent (a verdict, with
    the fork's source and sample) and the state handed over with it. A worker that replaces a dead
    one asks its members' last checkpointed round again (:func:`resume_units`) and gets the same
    answers, without the strategy being asked twice.

    >>> answers = RoundAnswers()
    >>> answers.keep(7, step=2, answer="continue")
    >>> answers.again(7, 2), answers.again(7, 3)
    (('continue', None), None)
    """

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, Any, Any]] = {}

    def keep(self, trial_id: int, step: int, answer: Any, handed: Any = None) -> None:
        """The answer given to member ``trial_id`` for ``step`` (its earlier one is dropped)."""
        self._last[trial_id] = (step, answer, handed)

    def again(self, trial_id: int, step: int) -> tuple[Any, Any] | None:
        """The (answer, handed state) given to member ``trial_id`` for ``step``; None when its last
        answer was for another step (or it was never answered)."""
        kept = self._last.get(trial_id)
        return None if kept is None or kept[0] != step else (kept[1], kept[2])

    def clear(self) -> None:
        """Forget every answer (a new group)."""
        self._last.clear()


def handed_source(evaluator: StepwiseEvaluator, source: int, seed: int, sample: dict[str, Any], model: nn.Module | None,
                  state: Mapping[str, Any]) -> ExecutionUnit:
    """A unit holding only member ``source`` (its ``seed``, ``sample`` and initial ``model``), at
    the trainer ``state`` another process handed over: what :meth:`LockstepJudge.handed` returns
    for a fork whose source trains elsewhere (a pool worker, a Ray task)."""
    from ..trial import Trial

    unit = SeparateUnit([Job(Trial(id=source, sample=sample, seed=seed), model)], evaluator,
                        reason=f"the state of trial {source}, handed over from another process")
    unit.load_state_dict(source, state)
    return unit


def fork_members(units: list[ExecutionUnit], forks: Sequence[tuple[UnitReport, Fork]], judge: LockstepJudge) -> None:
    """Carry out forks between rounds: each member leaves its unit and continues from its source's
    current state (weights, optimizer state, step, random state) with the fork's hyperparameters,
    through the source unit's :meth:`~tridens.units.ExecutionUnit.fork` (a source training in
    another process: through a unit the judge loads with its handed-over state, :meth:`LockstepJudge.handed`);
    a new unit that takes it is added to ``units``. A fork whose source has left, or moves in the
    same round, is skipped."""
    where = {trial_id: unit for unit in units for trial_id in unit.trial_ids()}
    moving = {report.trial_id for report, _ in forks}
    for report, fork in forks:
        source = where.get(fork.source)
        handed = judge.handed(report, fork) if source is None else None
        if source is None:
            source = handed
        if source is None or fork.source in moving or report.trial_id not in where:
            log.info("trial %d not forked from trial %d: the source is not training now", report.trial_id, fork.source)
            continue
        if source.state_dict(fork.source) is None:
            log.info("trial %d not forked from trial %d: its %s unit takes no member state", report.trial_id,
                     fork.source, source.kind)
            continue
        old = where[report.trial_id]
        job = old.jobs[report.trial_id]
        model = source.jobs[fork.source].model
        moved = Job(job.trial, None if model is None else copy.deepcopy(model), job.max_steps, job.started,
                    hparams=dict(fork.sample))
        old.drop(report.trial_id)
        try:
            unit = source.fork(fork.source, moved)
        except Exception as err:  # the member left its unit: it fails, the others go on
            judge.failed(old, report.trial_id, err)
            where.pop(report.trial_id, None)
            continue
        if handed is not None:   # the stand-in of the other process's member leaves it
            handed.drop(fork.source)
        if not any(u is unit for u in units):
            units.append(unit)
        where[report.trial_id] = unit
        judge.forked(report, fork)


def resume_units(jobs: Sequence[Job], evaluator: StepwiseEvaluator, judge: LockstepJudge,
                 saved: Callable[[int], Mapping[str, Any] | None], reason: str) -> list[ExecutionUnit]:
    """The units that go on with ``jobs`` after the worker training them died: one separate unit
    (a fused unit cannot resume mid-way; fused equals separate), each member at its last round
    (``saved(trial_id)``: ``{"trainer": state, "step": int, "metrics": {...}, "sample": {...}}`` as
    its judge's :meth:`~LockstepJudge.checkpoint` kept it -- ``sample`` the hyperparameters it
    trained with, a fork's (PBT) -- or None: from its start, or from ``Job.start_from``).
    That round is asked again -- the report may not have reached the driver, which otherwise
    answers it as it did (:class:`RoundAnswers`): members told to stop (or out of budget) leave at
    once, members forked (PBT) move onto their source's state, as the lost worker's would have.
    ``reason`` says in the log why the members train this way. Train the result with
    :func:`run_lockstep`."""
    states = {job.trial.id: saved(job.trial.id) for job in jobs}
    for job in jobs:
        state = states[job.trial.id]
        if state is not None and state.get("sample") is not None:
            job.hparams = dict(state["sample"])
    unit = SeparateUnit(jobs, evaluator, reason=reason)
    log.info("%s", unit.summary())
    reports = []
    for job in jobs:
        tid = job.trial.id
        state = states[tid]
        if tid not in unit.trial_ids():
            continue
        if state is None or state["trainer"] is None:   # no state kept: from its start
            if job.start_from is not None:
                try:
                    unit.load_state_dict(tid, job.start_from)
                except Exception as err:
                    judge.failed(unit, tid, err)
                    unit.drop(tid)
            continue
        unit.load_state_dict(tid, state["trainer"])
        reports.append(UnitReport(unit, tid, int(state["step"]), dict(state["metrics"]),
                                  unit.epoch(tid) >= unit.limit(tid), 0.0))
    going = []
    for report, verdict in zip(reports, judge.judge(reports)):
        if verdict is not Verdict.CONTINUE:
            judge.finished(report, verdict)
            unit.drop(report.trial_id)
        elif report.metrics is not None:
            going.append(report)
    units: list[ExecutionUnit] = [unit]
    forks = judge.forks(going)
    if forks:
        fork_members(units, forks, judge)
    return units


def run_lockstep(units: Sequence[ExecutionUnit], judge: LockstepJudge) -> None:
    """Train ``units`` epoch by epoch: every member's epoch first, then the judge's verdict for
    every member (so a synchronous rule sees the whole rung), then members that end leave their
    unit while the others go on, and members the strategy forks move onto their source's state
    (:func:`fork_members`). The one epoch loop of the in-process executor and of a Ray unit task."""
    units = list(units)
    while any(unit.active() for unit in units):
        reports: list[UnitReport] = []
        for unit in units:
            before = {j.trial.id: j.trial.info.get("train_seconds", 0.0) for j in unit.active()}
            results = unit.train_epoch()
            for trial_id, result in results.items():
                if isinstance(result, BaseException):
                    judge.failed(unit, trial_id, result)
                    unit.drop(trial_id)
                    continue
                epoch = unit.epoch(trial_id)
                seconds = unit.jobs[trial_id].trial.info.get("train_seconds", 0.0) - before.get(trial_id, 0.0)
                reports.append(UnitReport(unit, trial_id, epoch - 1, {k: float(v) for k, v in result.items()},
                                          epoch >= unit.limit(trial_id), seconds))
            for job in unit.active():  # trained nothing this round: its budget is spent
                trial_id = job.trial.id
                if trial_id not in results and unit.epoch(trial_id) >= unit.limit(trial_id):
                    reports.append(UnitReport(unit, trial_id, unit.epoch(trial_id) - 1, None, True, 0.0))
        judge.checkpoint([report for report in reports if report.metrics is not None])
        going = []
        for report, verdict in zip(reports, judge.judge(reports)):
            if verdict is not Verdict.CONTINUE:
                judge.finished(report, verdict)
                report.unit.drop(report.trial_id)
            elif report.metrics is not None:
                going.append(report)
        forks = judge.forks(going)
        if forks:
            fork_members(units, forks, judge)
