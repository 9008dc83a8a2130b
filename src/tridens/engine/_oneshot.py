"""A one-shot run (``tridens.oneshot``) through the engine's trial protocol.

:func:`tridens.oneshot.run_oneshot` trains the supernet, scores subnets with its weights and
retrains the best; each of those trials lives through a :class:`~tridens.executors.TrialProtocol` whose
hooks are this run's (:class:`OneShotRun`, a :class:`~._loop._Run`): the store rows, the callbacks
and loggers, the progress view, ``trial_timeout`` and ``max_duration`` are those of a multi-trial run.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from ..evaluators import StepwiseEvaluator
from ..store import Store
from ..trial import Decision, Fork, Objective, Trial, TrialStatus
from ..units import Job
from ._loop import _Run, _halts_on_storage_fault, _trial_seed
from ..executors import CheckpointStorage, Executor, InlineExecutor, TrialProtocol

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
        self.placing: Executor | None = None   # the executor, made on first use, closed when the run ends
        self.relays: dict[int, tuple[Any, str]] = {}  # trial id -> where its worker writes its checkpoints

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

    def scratch(self, trial: Trial) -> tuple[Any, str] | None:
        executor = self._executor()
        if isinstance(executor, InlineExecutor):
            return None
        root = getattr(executor, "storage", None) or executor.context.storage
        storage = CheckpointStorage(str(root))
        return storage, storage.join(self.name, f"supernet-{trial.id}.pt")

    def train(self, trial: Trial, evaluator: Any, model: Any = None) -> None:
        from ..oneshot import SupernetTraining

        job = Job(trial, model, None)
        if isinstance(evaluator, StepwiseEvaluator):
            job.resolve_config(evaluator)
        if isinstance(evaluator, SupernetTraining):  # its epochs' checkpoints come back through its location
            self.relays[trial.id] = (evaluator.storage, evaluator.location)
        try:
            self._executor().run_group([job], evaluator, self)
        finally:
            self.relays.pop(trial.id, None)

    def seed_of(self, architecture: Mapping[str, Any]) -> int:
        if self.exp.seeds == "per-architecture":  # the seed a multi-trial run gives the architecture
            return _trial_seed(self.exp.seed, json.dumps(dict(architecture), sort_keys=True, default=str))
        return int(self.exp.seed)

    def violation(self, trial: Trial, model: Any) -> str | None:
        if self.wants_flops and "flops" not in trial.info:
            from ..graph import trace

            trial.info["flops"] = trace(model, self.space.example_inputs).flops()
        return self._violated(trial, model)

    def _executor(self) -> Executor:
        if self.placing is None:
            self.placing = self.exp._executor(self.db.path, self.name, self.plan)
        return self.placing

    # -- hooks -------------------------------------------------------------------------------------
    @_halts_on_storage_fault
    def record(self, trial: Trial, step: int, metrics: Mapping[str, float]) -> None:
        relay = self.relays.get(trial.id)
        if relay is not None:  # the supernet on a worker: the epoch's checkpoint into the store first
            from ..oneshot import note_training

            storage, location = relay
            state = dict(storage.load(location))
            if int(state.get("epoch", -1)) == step + 1:
                note_training(trial, state.pop("info", {}))
                trial.checkpoint = str(self.db.save_checkpoint(trial.id, state, kind="supernet"))
        super().record(trial, step, metrics)

    def decide(self, trial: Trial, step: int) -> Decision:
        if _supernet(trial) and self.out_of_budget() is not None:  # max_duration: the supernet stops after this epoch
            trial.status = TrialStatus.STOPPED
            return Decision.STOP
        return super().decide(trial, step)

    def finish(self, trial: Trial, status: TrialStatus, *, error: str | None = None,
               weights: Mapping[str, Any] | None = None, value: float | None = None) -> None:
        # The supernet has no value of the objective (its checkpoint is written each epoch): it never ranks.
        super().finish(trial, status, error=error, weights=None if _supernet(trial) else weights,
                       value=None if _supernet(trial) else value)

    def _final_value(self, trial: Trial, value: float | None) -> float | None:
        # A supernet that validated each epoch (under a Lightning module) still has no value: it never ranks.
        return None if _supernet(trial) else super()._final_value(trial, value)

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
            if self.placing is not None:
                self.placing.close()
            self.progress.close()
            self._end_callbacks(completed=sys.exc_info()[0] is None)

def run_one_shot(exp: Experiment, strategy: Any) -> str:
    """Run (or resume) ``exp`` with the one-shot ``strategy``; returns why it stopped. A resumed
    experiment of another search space is refused (its supernet checkpoint and its subnets belong
    to that space) unless ``RunOptions(resume="force")``."""
    from ..oneshot import run_oneshot
    from ..store import StoreError
    from ._preflight import check_same_space, describe_space

    def trials_of(db: Store, name: str) -> contextlib.AbstractContextManager[OneShotRun]:
        return OneShotRun(exp, db, name, exp._objective()).running()

    if exp.space is None or exp.evaluator is None:  # refused by run_oneshot, naming what is missing
        return run_oneshot(exp, strategy, trials_of)
    described = describe_space(exp.space.search_space().merged(exp.evaluator.search_space()))
    path, name = exp._store_path(), exp._name()
    if exp.resume != "force" and path.exists():
        with Store(path, readonly=True) as db:
            try:
                recorded = db.get_experiment(name).config.get("search_space")
            except StoreError:
                recorded = None
        check_same_space(name, recorded, described)
    return run_oneshot(exp, strategy, trials_of, config={"search_space": described})
