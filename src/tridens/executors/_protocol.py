"""The trial protocol: the one owner of a trial's life, called by every executor.

An executor trains a trial somewhere -- in this process, in a pool worker, in a Ray task, packed
with others or data-parallel under Fluid -- and tells the trial's :class:`TrialProtocol` what
happened. The protocol alone decides what that means and reports it to the experiment (the
:class:`GroupHooks`, which write the store and talk to the strategy):

* :meth:`~TrialProtocol.start`: the training began; the timeout counts from here.
* :meth:`~TrialProtocol.record`: one step's metrics, once (a step replayed after a restart is not
  recorded twice).
* :meth:`~TrialProtocol.verdict`: after a recorded step, in this order: the trial's
  ``trial_timeout``, its budget, the strategy's decision.
* :meth:`~TrialProtocol.finish`, :meth:`~TrialProtocol.fail`, :meth:`~TrialProtocol.time_out`:
  the outcome, once: COMPLETED (STOPPED when the strategy stopped it, FAILED when its final value
  is NaN) with the final weights, which the experiment writes as the trial's checkpoint before the
  trial counts as done; or FAILED with an error text.

The wire values of :class:`Verdict` are what workers of the process pool and of Ray receive.

>>> Verdict.DONE.finishes, Verdict.CONTINUE.finishes
(True, False)
"""

from __future__ import annotations

import enum
import math
import time
import traceback
from typing import Any, Mapping, Protocol

from ..trial import Decision, Fork, Trial, TrialStatus
from ..units import Job

__all__ = ["Verdict", "TrialProtocol", "GroupHooks", "TrialTimeout", "RunHalted", "error_text", "timeout_error",
           "SILENCE_GRACE"]


class TrialTimeout(BaseException):
    """Raised inside a user's loop that ran longer than ``trial_timeout``. A BaseException, so
    that a loop catching ``Exception`` does not swallow it."""


class RunHalted(BaseException):
    """A fault outside every trial stops the run: the store's disk is full, its file is gone
    (``cause``, a :class:`tridens.errors.StorageFault`). Raised through the trial protocol as a
    BaseException, so that neither an executor nor a user's loop takes it for the trial's own
    failure: the trial stays unfinished and runs again on the next run."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class GroupHooks(Protocol):
    """What the trial protocol calls back into (implemented by the experiment)."""

    trial_timeout: float | None

    def started(self, trial: Trial) -> None:
        """The trial's training began in some process (it is RUNNING from now on)."""

    def record(self, trial: Trial, step: int, metrics: Mapping[str, float]) -> None:
        """Store one step's metrics and tell the strategy the objective's value."""

    def decide(self, trial: Trial, step: int) -> Decision:
        """Ask the strategy whether ``trial`` continues after ``step``."""

    def finish(self, trial: Trial, status: TrialStatus, *, error: str | None = None,
               weights: Mapping[str, Any] | None = None, value: float | None = None) -> None:
        """Store the outcome (and final weights) of ``trial``; tell the strategy."""

    def fork(self, trial: Trial, step: int) -> Fork | None:
        """Ask the strategy whether ``trial``, continuing after ``step``, moves onto another
        trial's state."""

    def forked(self, trial: Trial) -> None:
        """``trial`` moved onto another trial's state: store its lineage (``trial.info``)."""


class Verdict(str, enum.Enum):
    """What a trial does after a step (its value is the message sent to a worker)."""

    CONTINUE = "continue"  # train the next step
    STOP = "stop"          # the strategy stopped it: final weights, then finish
    DONE = "done"          # its budget is spent: final weights, then finish
    DROP = "drop"          # over trial_timeout: already failed; leave without a word
    YIELD = "yield"        # (Fluid) checkpoint and leave, to be placed again at a new share

    @property
    def finishes(self) -> bool:
        """Whether the trial's training ends here (with its final weights)."""
        return self in (Verdict.STOP, Verdict.DONE)


def error_text(err: BaseException) -> str:
    """The traceback of ``err`` as stored in a failed trial's ``error``."""
    return "".join(traceback.format_exception(type(err), err, err.__traceback__)).strip()


SILENCE_GRACE = 5.0
"""Seconds past ``trial_timeout`` that a worker may stay silent inside one epoch before it counts as hung."""


def timeout_error(trial: Trial | int | str, timeout: float, where: str) -> str:
    """The one message of a trial that ran past ``trial_timeout``; ``where`` says when it was
    caught (``"after epoch 3"``, ``"and was killed"``). ``trial`` is a trial, its id, or a
    placeholder such as ``"{trial}"`` filled in later.

    >>> timeout_error(4, 2.0, "after epoch 1")
    'trial 4 exceeded trial_timeout=2.0 s after epoch 1'
    """
    number = trial.label if isinstance(trial, Trial) else trial
    return f"trial {number} exceeded trial_timeout={timeout} s {where}"


class TrialProtocol:
    """The life of one trial, driven by whichever executor runs it.

    ``clock`` is what ``trial_timeout`` measures: ``"train"`` -- the seconds spent training its
    epochs (``trial.info["train_seconds"]``, what a trial packed or fused with others costs
    itself; declarative evaluators) -- or ``"wall"`` -- the seconds since :meth:`start` (a
    user's loop).

    >>> from tridens.trial import Trial
    >>> class Hooks:
    ...     trial_timeout = None
    ...     def started(self, trial): pass
    ...     def record(self, trial, step, metrics): pass
    ...     def decide(self, trial, step): return Decision.CONTINUE
    ...     def finish(self, trial, status, **kw): trial.status = status
    >>> life = TrialProtocol(Job(Trial(id=1, sample={}, seed=0), None), Hooks(), clock="train")
    >>> life.report(0, {"val_acc": 0.5}), life.report(1, {"val_acc": 0.7}, last=True)
    (<Verdict.CONTINUE: 'continue'>, <Verdict.DONE: 'done'>)
    >>> life.finish(); life.trial.status
    <TrialStatus.COMPLETED: 'completed'>
    """

    def __init__(self, job: Job, hooks: GroupHooks, *, clock: str = "wall"):
        if clock not in ("wall", "train"):
            raise ValueError(f"The 'clock' parameter of TrialProtocol must be 'wall' or 'train'. Got {clock!r} instead.")
        self.job, self.hooks, self.clock = job, hooks, clock
        self.trial: Trial = job.trial
        self.last: float | None = None          # the first value of the last recorded step's metrics
        self.last_step = -1                     # the last step recorded in the store
        self.verdicts: dict[int, Verdict] = {}  # step -> the verdict it had (replayed after a restart)
        self.finished = False
        self.started_at = math.inf

    # -- running -----------------------------------------------------------------------------------
    def start(self) -> None:
        """The training began (again, after a restart): the wall clock counts from now."""
        self.started_at = self.job.started = time.monotonic()
        self.hooks.started(self.trial)

    def add_seconds(self, seconds: float) -> None:
        """``seconds`` more spent training (what the ``"train"`` clock measures)."""
        info = self.trial.info
        info["train_seconds"] = info.get("train_seconds", 0.0) + seconds

    def elapsed(self) -> float:
        """Seconds counted against ``trial_timeout``."""
        if self.clock == "train":
            return float(self.trial.info.get("train_seconds", 0.0))
        return 0.0 if self.started_at == math.inf else time.monotonic() - self.started_at

    def over_time(self, grace: float = 0.0) -> bool:
        """Whether the trial ran past ``trial_timeout`` (plus ``grace`` seconds)."""
        timeout = self.hooks.trial_timeout
        return timeout is not None and not self.finished and self.elapsed() > timeout + grace

    def silent_too_long(self, since: float) -> bool:
        """Whether a worker that said nothing since ``since`` (``time.monotonic()``) hangs inside an
        epoch: silent for ``trial_timeout`` plus :data:`SILENCE_GRACE` seconds."""
        timeout = self.hooks.trial_timeout
        return timeout is not None and not self.finished and time.monotonic() - since > timeout + SILENCE_GRACE

    def record(self, step: int, metrics: Mapping[str, float]) -> bool:
        """Record one step's metrics; False (and nothing recorded) for a step recorded before or a
        trial already finished."""
        if self.finished or step <= self.last_step:
            return False
        values = {k: float(v) for k, v in metrics.items()}
        self.hooks.record(self.trial, step, values)
        self.last_step = step
        self.last = next(iter(values.values()), None)
        return True

    def verdict(self, step: int, *, last: bool = False) -> Verdict:
        """What the trial does after ``step`` (recorded just before): failed by its timeout
        (:attr:`Verdict.DROP`, the outcome is stored), done with its budget (``last``), or the
        strategy's decision. Asked again for the same step, the same answer."""
        if step in self.verdicts:
            return self.verdicts[step]
        if self.finished:
            return Verdict.DROP
        if self.over_time():
            self.time_out("after epoch %d" % step if self.clock == "train" else f"at step {step}")
            verdict = Verdict.DROP
        elif last:
            verdict = Verdict.DONE
        else:
            verdict = Verdict.STOP if self.hooks.decide(self.trial, step) is Decision.STOP else Verdict.CONTINUE
        self.verdicts[step] = verdict
        return verdict

    def fork(self, step: int) -> Fork | None:
        """After a :attr:`Verdict.CONTINUE` for ``step``: the strategy's fork of this trial, if any."""
        if self.finished or self.verdicts.get(step) is not Verdict.CONTINUE:
            return None
        ask = getattr(self.hooks, "fork", None)  # hooks written before forks existed answer none
        return None if ask is None else ask(self.trial, step)

    def forked(self, source: Trial, step: int, fork: Fork) -> None:
        """The trial continues from ``source``'s state after ``step`` with ``fork.sample``: its
        lineage (``trial.schedule()``, ``info["exploits"]``) is recorded and stored."""
        self.trial.record_fork(source, step + 1, fork.sample)
        store = getattr(self.hooks, "forked", None)
        if store is not None:
            store(self.trial)

    def report(self, step: int, metrics: Mapping[str, float], *, last: bool = False,
               seconds: float | None = None) -> Verdict:
        """A worker's report: ``seconds`` of training, the step's metrics, then the verdict (the
        verdict it had for a step reported again after a restart)."""
        if seconds:
            self.add_seconds(seconds)
        if step <= self.last_step or self.finished:
            return self.verdicts.get(step, Verdict.DROP if self.finished else Verdict.CONTINUE)
        self.record(step, metrics)
        return self.verdict(step, last=last)

    # -- outcomes ----------------------------------------------------------------------------------
    def finish(self, value: float | None = None, weights: Mapping[str, Any] | None = None) -> None:
        """The training ended normally: COMPLETED with ``value`` (default: the last recorded one)
        and the final ``weights``; STOPPED when the strategy stopped it; FAILED when the value is not
        finite (NaN, or an infinity that would otherwise rank best or worst of all: a diverged run)."""
        if self.finished:
            return
        value = self.last if value is None else float(value)
        if value is not None and not math.isfinite(value):
            self._end(TrialStatus.FAILED, error=f"the final metric is {'NaN' if math.isnan(value) else value} (not a finite number)", value=value)
            return
        status = TrialStatus.STOPPED if self.trial.status is TrialStatus.STOPPED else TrialStatus.COMPLETED
        self._end(status, weights=weights, value=value)

    def fail(self, error: str | BaseException) -> None:
        """The trial failed: ``error`` is its message or the exception that failed it."""
        if not self.finished:
            self._end(TrialStatus.FAILED, error=error if isinstance(error, str) else error_text(error), value=self.last)

    def time_out(self, where: str) -> None:
        """The trial ran past ``trial_timeout``; ``where`` says when that was seen."""
        self.fail(timeout_error(self.trial, self.hooks.trial_timeout or 0.0, where))

    def _end(self, status: TrialStatus, *, error: str | None = None, weights: Mapping[str, Any] | None = None,
             value: float | None = None) -> None:
        self.finished = True
        self.hooks.finish(self.trial, status, error=error, weights=weights, value=value)
