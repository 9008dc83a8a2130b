"""A one-shot run (``tridens.oneshot``) through the engine's trial protocol.

:func:`tridens.oneshot.run_oneshot` trains the supernet, scores subnets with its weights and
retrains the best; each of those trials lives through a :class:`~tridens.executors.TrialProtocol` whose
hooks are this run's (:class:`OneShotRun`, a :class:`~._loop._Run`): the store rows, the callbacks
and loggers, the progress view, ``trial_timeout`` and ``max_duration`` are those of a multi-trial run.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from ..store import Store
from ..trial import Decision, Fork, Objective, Trial, TrialStatus
from ..units import Job
from ._loop import _Run
from ..executors import TrialProtocol

if TYPE_CHECKING:
    from ._experiment import Experiment

__all__ = ["OneShotRun", "run_one_shot"]

class _NoDecisions:
    """The strategy a one-shot run's hooks talk to: a one-shot strategy trains its supernet for its
    epochs and scores what its search proposes, so it decides nothing per step."""

    def report(self, trial: Trial, step: int, value: float) -> None:
        pass

    def decide(self, trial: Trial, step: int) -> Decision:
        return Decision.CONTINUE

    def tell(self, trial: Trial) -> None:
        pass

    def fork(self, trial: Trial, step: int) -> Fork | None:
        return None

    def objective_named(self, objective: Objective) -> None:
        pass

def _supernet(trial: Trial) -> bool:
    info = trial.info.get("oneshot")
    return isinstance(info, dict) and info.get("role") == "supernet"

class OneShotRun(_Run):
    """The hooks of a one-shot run's trials, and what :func:`tridens.oneshot.run_oneshot` asks of
    the engine (:class:`tridens.oneshot.OneShotTrials`)."""

    def __init__(self, exp: Experiment, db: Store, name: str, objective: Objective):
        super().__init__(exp, db, name, _NoDecisions(), objective, exp.space)  # type: ignore[arg-type]
        self.zoo = None             # the supernet starts from its own initialization
        self.names_checked = True   # the supernet reports its training loss; subnets the evaluator's metrics
        self.naming_objective = False

    # -- OneShotTrials ------------------------------------------------------------------------------
    def add(self, trial: Trial) -> Trial:
        return self.db.add_trial(self.name, trial)

    def life(self, trial: Trial) -> TrialProtocol:
        return TrialProtocol(Job(trial, None), self, clock="train")

    def out_of_budget(self) -> str | None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return f"max_duration={self.exp.max_duration!r} reached"
        return None

    def planned(self, total: int) -> None:
        self.progress.total = total
        if getattr(self.progress, "_live", None) is not None:
            self.progress.bar.update(self.progress.task, total=total)

    # -- hooks -------------------------------------------------------------------------------------
    def finish(self, trial: Trial, status: TrialStatus, *, error: str | None = None,
               weights: Mapping[str, Any] | None = None, value: float | None = None) -> None:
        # The supernet has no value of the objective (its checkpoint is written each epoch): it never ranks.
        super().finish(trial, status, error=error, weights=None if _supernet(trial) else weights,
                       value=None if _supernet(trial) else value)

    def _explain_failure(self, trial: Trial, error: str | None) -> str | None:
        return error if _supernet(trial) else super()._explain_failure(trial, error)

    @contextlib.contextmanager
    def running(self) -> Iterator[OneShotRun]:
        """The callbacks and the progress view around the run's trials."""
        trials = self.db.trials(self.name)
        for callback in self.exp.callbacks:  # a logger that cannot start (not installed) stops the run here
            callback.on_experiment_start(self.name, self.db.get_experiment(self.name).config)
        finished = [t for t in trials if t.status.finished]
        self.progress.start(self.name, sum(t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED) for t in finished),
                            bool(trials), finished)
        try:
            yield self
        finally:
            self.progress.close()
            self._end_callbacks(completed=sys.exc_info()[0] is None)

def run_one_shot(exp: Experiment, strategy: Any) -> str:
    """Run (or resume) ``exp`` with the one-shot ``strategy``; returns why it stopped."""
    from ..oneshot import run_oneshot

    def trials_of(db: Store, name: str) -> contextlib.AbstractContextManager[OneShotRun]:
        return OneShotRun(exp, db, name, exp._objective()).running()

    return run_oneshot(exp, strategy, trials_of)
