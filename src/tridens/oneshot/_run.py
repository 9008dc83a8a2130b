"""The one-shot run of a ``td.Experiment``: train the supernet, search its subnets, retrain.

What goes to the store (the experiment's SQLite file), so ``exp.trials()``, ``top()``, ``best()``,
``export()`` and the ``tridens`` command work as for a multi-trial search:

* one *supernet* trial (``info["oneshot"]["role"] == "supernet"``, no metric, so it never ranks):
  ``train_loss`` per epoch, and its checkpoint ``trial-<number>-supernet.pt`` beside the database,
  rewritten after every epoch (weights, optimizers, architecture parameters, random state);
* one completed trial per subnet scored with inherited weights (``role == "subnet"``,
  ``inherited: True``, ``supernet``: the supernet trial's number): the validation metrics, and the
  subnet's own weights as its checkpoint;
* with ``retrain=True``, one trial of the best architecture trained from scratch by the
  evaluator (``role == "retrain"``, ``of``: the number of the subnet trial it retrains).

Each of these trials lives through the engine's trial protocol, as a multi-trial run's do: the
engine hands :func:`run_oneshot` a :class:`OneShotTrials` (its rows, its :class:`TrialLife` per
trial, the run's budget), so that callbacks and loggers receive every report and outcome, the
progress view counts the trials, ``trial_timeout`` fails a trial that trains too long, and
``max_duration`` stops the run after the supernet's current epoch.

Running the same script again resumes: from the last supernet checkpoint if training was cut,
with the subnets already scored kept (the search replays, scoring only new ones).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Protocol

import torch

from ..errors import TridensError
from ..evaluators import SupervisedEvaluator, BatchSource, Lightning
from ..store import Store, StoreError
from ..trial import Objective, Trial, TrialStatus
from ._search import evaluate_path, evolution, random_search, sample_key
from ._strategies import OneShotStrategy
from ._supernet import Supernet, build_supernet
from ._lightning import LightningScorer, LightningSupernet, lightning_inputs, refuse_lightning
from ._training import SupernetLoop, SupernetTraining, data_inputs, jsonable

__all__ = ["run_oneshot", "OneShotTrials", "TrialLife", "note_training"]

log = logging.getLogger("tridens")


def _violated(trial: Trial) -> bool:
    """A subnet failed unscored because it violates a constraint (an outcome of its architecture)."""
    return trial.status is TrialStatus.FAILED and (trial.error or "").startswith("constraint violated")


def _role(trial: Trial) -> str | None:
    info = trial.info.get("oneshot")
    return info.get("role") if isinstance(info, dict) else None


class TrialLife(Protocol):
    """What a one-shot run tells about one trial: the engine's ``TrialProtocol``."""

    def start(self) -> None:
        """The trial began training."""

    def report(self, step: int, metrics: Mapping[str, float], *, last: bool = False,
               seconds: float | None = None) -> Any:
        """One step's metrics (``seconds`` of training); returns the verdict, whose ``value`` is
        ``"continue"``, ``"done"``, ``"stop"`` or ``"drop"`` (failed by ``trial_timeout``)."""

    def finish(self, value: float | None = None, weights: Mapping[str, Any] | None = None) -> None:
        """The trial ended normally with ``value`` and its final ``weights`` (its checkpoint)."""

    def fail(self, error: str | BaseException) -> None:
        """The trial failed with ``error``."""


class OneShotTrials(Protocol):
    """What the engine gives a one-shot run: new trial rows, each trial's :class:`TrialLife`, the
    run's budget, and the end of the run."""

    def add(self, trial: Trial) -> Trial:
        """Write a new trial row (its ``id`` and ``number`` set)."""

    def life(self, trial: Trial) -> TrialLife:
        """The trial protocol of ``trial`` (started by the caller)."""

    def out_of_budget(self) -> str | None:
        """Why the run must stop now (``max_duration`` reached), or ``None``."""

    def planned(self, total: int) -> None:
        """The run will finish ``total`` trials (the progress view's total)."""

    def scratch(self, trial: Trial) -> tuple[Any, str] | None:
        """Where a worker of the run's executor writes ``trial``'s checkpoints for the driver: a
        checkpoint storage (``save``, ``load``, ``remove``) and a location in it; None when the
        executor trains trials in this process (the caller trains them itself)."""

    def seed_of(self, architecture: Mapping[str, Any]) -> int:
        """The seed of a new trial that trains ``architecture`` from scratch (the run's ``seeds`` policy)."""

    def violation(self, trial: Trial, model: Any) -> str | None:
        """The first of the run's constraints that ``model`` (``trial``'s; its measured facts are
        added to ``trial.info``) violates, as the failed trial's error says it; None when it meets them."""

    def train(self, trial: Trial, evaluator: Any, model: Any = None) -> None:
        """Train ``trial`` (its ``model``, None for an evaluator that builds its own) with
        ``evaluator`` on the run's executor, through the trial protocol, to its outcome."""


class _OutOfBudget(Exception):
    """The run's budget ended inside the search (raised through the search's score function)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# Experiment options a one-shot run cannot apply, with the value that means "not set" and why: one
# that is set is refused before the run, in one line naming it.
_REFUSED = {
    "warm_start": (False, "the supernet starts from its own initialization and a retrain from the evaluator's; "
                          "drop it, or warm-start a multi-trial search (td.strategy.*)"),
    "allocation": (None, "the supernet trains as one trial on one worker; drop it"),
    "stage_policy": (None, "a one-shot run trains no stage trees; drop it"),
}


def _refuse_unapplied(exp: Any, strategy: OneShotStrategy) -> None:
    for option, (unset, why) in _REFUSED.items():
        value = getattr(exp, option, unset)
        if value is not None and value != unset:
            raise ValueError(f"The '{option}' parameter of Experiment is not applied by the one-shot strategy "
                             f"{type(strategy).__name__}: {why}. Got {option}={value!r} instead.")


def run_oneshot(exp: Any, strategy: OneShotStrategy,
                trials_of: Callable[[Store, str], ContextManager[OneShotTrials]],
                config: Mapping[str, Any] | None = None) -> str:
    """Run (or resume) ``exp`` with a one-shot ``strategy``; returns why it stopped (what it did),
    the line the experiment ends with. ``trials_of(store, name)`` is the engine's
    :class:`OneShotTrials` of the run while the trials run (entered once the experiment's record
    exists; it tells the callbacks the run started and ended). ``config``: more the experiment's
    record holds (the engine's description of the search space)."""
    lightning = isinstance(exp.evaluator, Lightning)
    if not isinstance(exp.evaluator, SupervisedEvaluator) and not lightning:
        raise ValueError(f"The 'evaluator' parameter of Experiment must be td.evaluators.Classification or "
                         f"Regression (trained by tridens' own loop) or td.evaluators.Lightning (a Lightning module "
                         f"drives the weight steps) for the one-shot strategy {type(strategy).__name__}. "
                         f"Got {type(exp.evaluator).__name__} instead.")
    strategy.validate()
    _refuse_unapplied(exp, strategy)
    objective = exp._objective()
    if lightning:
        exp.evaluator.check()
        refuse_lightning(strategy, exp.evaluator)
        net = build_supernet(exp.space, seed=exp.seed, example_inputs=lightning_inputs(exp.evaluator))
        return _run_recorded(exp, strategy, trials_of, config, net, None, {}, objective)
    hparams = exp.evaluator.search_space().default_sample()
    for label, value in hparams.items():  # searched by nobody: the user is told, not left to find out
        log.warning("one-shot: %s does not search the evaluator's hyperparameter %r (%r): the supernet, every "
                    "subnet and the retrain use its first candidate %r; fix it in the evaluator, or search it "
                    "with a multi-trial strategy", type(strategy).__name__, label,
                    exp.evaluator.search_space()[label].domain, value)
    cfg = exp.evaluator.config(hparams)
    # refuses a space that cannot be one-shot, before any write
    net = build_supernet(exp.space, seed=exp.seed, example_inputs=data_inputs(cfg))
    return _run_recorded(exp, strategy, trials_of, config, net, cfg, hparams, objective)


def _run_recorded(exp: Any, strategy: OneShotStrategy, trials_of: Callable[[Store, str], ContextManager[OneShotTrials]],
                  config: Mapping[str, Any] | None, net: Supernet, cfg: Any, hparams: dict[str, Any],
                  objective: Objective) -> str:
    """The run of :func:`run_oneshot` once its supernet is built: the experiment's record, its trials."""
    path, name = exp._store_path(), exp._name()
    with Store(path) as db:
        db.lock_run(name)  # a second process running this experiment is refused, naming this one
        new_space = False
        try:
            recorded = db.get_experiment(name).config
        except StoreError:
            record = {**exp._config(objective), **(config or {})}
            record["oneshot"] = {"strategy": type(strategy).__name__, "params": jsonable(strategy.params())}
            db.create_experiment(name, record)
        else:
            # resume="force" with another search space (else refused before): the stored supernet belongs
            # to the old space, so a new one trains; the experiment records the space it now searches.
            current = (config or {}).get("search_space")
            new_space = current is not None and recorded.get("search_space") not in (None, current)
            if new_space:
                db.update_experiment(name, config={**recorded, "search_space": current})
        db.update_experiment(name, status="running")
        try:
            with trials_of(db, name) as trials:
                run = _OneShotRun(exp, db, name, strategy, net, cfg, hparams, objective, trials)
                reason = run.run(new_space=new_space)
        except BaseException:
            with contextlib.suppress(StoreError):  # (a full disk: the store's next open settles it)
                db.update_experiment(name, status="interrupted")
            raise
        db.update_experiment(name, status="done")
    return reason


class _OneShotRun:
    def __init__(self, exp: Any, db: Store, name: str, strategy: OneShotStrategy, net: Supernet, cfg: Any,
                 hparams: dict[str, Any], objective: Objective, trials: OneShotTrials):
        self.exp, self.db, self.name, self.strategy, self.net = exp, db, name, strategy, net
        self.cfg, self.hparams, self.objective, self.trials = cfg, hparams, objective, trials
        self.seed = int(exp.seed)
        self.verbose = bool(exp.verbose)

    def say(self, message: str, *args: Any) -> None:
        log.info(message, *args)
        if self.verbose:
            print(f"[tridens] {self.name}: " + (message % args if args else message), flush=True)

    # -- the whole run -------------------------------------------------------------------------
    def run(self, new_space: bool = False) -> str:
        """Train the supernet, score subnets, retrain; returns what was done (the run's stop reason).
        ``new_space``: the experiment's earlier trials searched another space (a new supernet trains)."""
        trials = self.db.trials(self.name)
        n = self.strategy.samples if self.exp.max_trials is None else min(self.strategy.samples, self.exp.max_trials)
        if self.exp.evaluator.fast_dev_run and n > 1:
            # a check that the code runs: the result is the strategy's export (DARTS' argmax, ENAS' greedy
            # path, else one random path), scored once; a search over subnets would be the run's longest part
            self.say("fast_dev_run: the search scores only %s's export, not %d subnets", type(self.strategy).__name__, n)
            n = 1
        self.trials.planned(1 + n + int(self.strategy.retrain))
        # retry_failed=False: a supernet an earlier run failed stays failed, a new one trains in its place
        retry = bool(getattr(self.exp, "retry_failed", True))
        supernet = None if new_space else next((t for t in reversed(trials) if _role(t) == "supernet"
                                                and (retry or t.status is not TrialStatus.FAILED)), None)
        if new_space:
            self.say("the search space changed (resume='force'): a new supernet trains; the earlier trials stay as they were")
        if supernet is None:
            supernet = self.trials.add(Trial(
                id=-1, sample={}, seed=self.seed, fingerprint=f"supernet:{type(self.strategy).__name__}", group=0,
                info={"oneshot": {"role": "supernet", "strategy": type(self.strategy).__name__}}, experiment=self.name))
        epochs, stopped = self.train_supernet(supernet)
        if stopped is not None:
            return stopped
        try:
            subnets = self.search(supernet, trials, n)
            retrained = self.retrain(subnets, trials) if self.strategy.retrain else 0
        except _OutOfBudget as out:
            return out.reason
        return (f"{type(self.strategy).__name__} is done: the supernet trained {epochs} epoch{'s' if epochs != 1 else ''}, "
                f"{len({t.id for t in subnets})} subnets scored with its weights"
                + (f", {retrained} retrained from scratch" if retrained else ""))

    def _check_budget(self, doing: str) -> None:
        """Raise :class:`_OutOfBudget` when the run's budget ended (``doing``: what is cut short)."""
        reason = self.trials.out_of_budget()
        if reason is not None:
            raise _OutOfBudget(f"{reason} {doing}")

    # -- supernet training ---------------------------------------------------------------------
    def _checkpoint_path(self, trial: Trial) -> Path | None:
        """The supernet's latest checkpoint, as the store records it (whatever the file's name)."""
        return Path(trial.checkpoint) if trial.checkpoint else None

    def train_supernet(self, trial: Trial) -> tuple[int, str | None]:
        """Train (or finish training) the supernet; returns its epochs, and why the run stops here
        (``max_duration`` reached, ``trial_timeout`` exceeded, its process died) or ``None``.
        Where the executor trains trials in other processes, the supernet trains there as one
        trial (:class:`SupernetTraining`); then its final checkpoint is loaded here."""
        if self.cfg is None:
            return self._train_lightning(trial)
        fresh = copy.deepcopy(self.strategy)  # (before it begins training here) for a worker to begin
        loop = SupernetLoop(self.net, self.strategy, self.cfg, self.seed)
        epochs = loop.epochs
        ckpt = self._checkpoint_path(trial)
        state = None
        if ckpt is not None and ckpt.is_file():
            state = self.db.load_checkpoint(ckpt)
            loop.load(state, ckpt)
            if loop.start_epoch < epochs:
                self.say("resuming the supernet at epoch %d of %d from %s", loop.start_epoch, epochs, ckpt)
        if loop.start_epoch >= epochs and trial.status is TrialStatus.COMPLETED:
            return epochs, None
        # A supernet trained again (after a stop, a timeout or a crash) keeps its earlier epochs' rows.
        trial.status, trial.error, trial.finished_at = TrialStatus.PENDING, None, None
        trial.started_at = trial.started_at or time.time()
        scratch = self.trials.scratch(trial)
        if scratch is not None:
            return self._train_elsewhere(trial, loop, fresh, state, *scratch)
        life = self.trials.life(trial)
        life.start()
        for epoch in range(loop.start_epoch, epochs):
            epoch_wall = time.perf_counter()
            try:
                metrics = loop.train_epoch(epoch)
            except TridensError as err:
                life.fail(str(err))
                raise
            verdict = life.report(epoch, metrics, last=epoch + 1 >= epochs, seconds=time.perf_counter() - epoch_wall)
            trial.checkpoint = str(self.db.save_checkpoint(trial.id, loop.state(epoch + 1, metrics), kind="supernet"))
            self.say("supernet epoch %d/%d: train_loss %.4f", epoch + 1, epochs, metrics["train_loss"])
            self._note_training(trial, loop.info())
            if verdict.value == "drop":  # over trial_timeout: the protocol failed it
                return epoch + 1, (f"{trial.error or 'the supernet exceeded trial_timeout'}; its checkpoint after "
                                   f"epoch {epoch + 1} of {epochs} is kept: run again to continue")
            if verdict.value == "done":
                break
            reason = self.trials.out_of_budget()
            if reason is not None or verdict.value == "stop":
                trial.status = TrialStatus.STOPPED
                life.finish()
                return epoch + 1, (f"{reason or 'stopped'} during the supernet's training, after epoch {epoch + 1} "
                                   f"of {epochs} (its checkpoint is kept: run again to continue)")
        life.finish()
        return epochs, None

    def _train_lightning(self, trial: Trial) -> tuple[int, str | None]:
        """:meth:`train_supernet` with a Lightning module driving the weight steps
        (:class:`LightningSupernet`), in this process whatever the executor."""
        run = LightningSupernet(self.net, self.strategy, self.exp.evaluator, self.seed)
        epochs = run.epochs
        ckpt = self._checkpoint_path(trial)
        state, done = None, 0
        if ckpt is not None and ckpt.is_file():
            state = self.db.load_checkpoint(ckpt)
            done = run.load_trained(state, ckpt)
            if done < epochs:
                self.say("resuming the supernet at epoch %d of %d from %s", done, epochs, ckpt)
        if done >= epochs and trial.status is TrialStatus.COMPLETED:
            return epochs, None
        if self.trials.scratch(trial) is not None:
            self.say("the supernet trains in this process: a Lightning module's Trainer drives it")
        trial.status, trial.error, trial.finished_at = TrialStatus.PENDING, None, None
        trial.started_at = trial.started_at or time.time()
        life = self.trials.life(trial)
        life.start()
        ended: dict[str, Any] = {}

        def report(epoch: int, metrics: Mapping[str, float], *, last: bool, seconds: float) -> str:
            verdict = life.report(epoch, metrics, last=last, seconds=seconds)
            ended["epoch"] = epoch + 1
            self.say("supernet epoch %d/%d: train_loss %.4f", epoch + 1, epochs, metrics.get("train_loss", math.nan))
            if verdict.value == "drop":  # over trial_timeout: the protocol failed it
                ended["why"] = (f"{trial.error or 'the supernet exceeded trial_timeout'}; its checkpoint after epoch "
                                f"{epoch + 1} of {epochs} is kept: run again to continue")
                return "drop"
            if verdict.value == "done":
                return "done"
            reason = self.trials.out_of_budget()
            if reason is not None or verdict.value == "stop":
                ended["stopped"] = True
                ended["why"] = (f"{reason or 'stopped'} during the supernet's training, after epoch {epoch + 1} "
                                f"of {epochs} (its checkpoint is kept: run again to continue)")
                return "stop"
            return "continue"

        def save(state: dict[str, Any]) -> None:
            trial.checkpoint = str(self.db.save_checkpoint(trial.id, state, kind="supernet"))
            self._note_training(trial, run.info())

        try:
            run.fit(report, state if done else None, save)
        except KeyboardInterrupt:
            raise
        except Exception as err:
            if not trial.status.finished:
                life.fail(err)
            raise
        if "why" in ended:
            if ended.get("stopped"):
                trial.status = TrialStatus.STOPPED
                life.finish()
            return int(ended["epoch"]), str(ended["why"])
        life.finish()
        return epochs, None

    def _train_elsewhere(self, trial: Trial, loop: SupernetLoop, strategy: OneShotStrategy,
                         state: Mapping[str, Any] | None, storage: Any, location: str) -> tuple[int, str | None]:
        """Train the supernet as one trial of the executor (its epochs' checkpoints come back
        through ``location`` in ``storage`` and into the store), then load its last checkpoint."""
        epochs = loop.epochs
        storage.remove(location)  # what an earlier, killed run left there is older than the store's
        training = SupernetTraining(self.exp.space, self.exp.evaluator, strategy, self.seed,
                                    self.hparams, state, storage, location)
        try:
            self.trials.train(trial, training)
        finally:
            storage.remove(location)
            storage.prune(location)  # its folder (<store>.ray/<experiment>/) only held that file
        ckpt = self._checkpoint_path(trial)
        if ckpt is not None and ckpt.is_file():
            loop.load(self.db.load_checkpoint(ckpt), ckpt)
        done = loop.start_epoch
        kept = (f"its checkpoint after epoch {done} of {epochs} is kept: run again to continue" if done
                else "run again to start it again")
        if trial.status is TrialStatus.FAILED:
            error = (trial.error or "the supernet failed").strip().splitlines()[-1]
            if "the supernet's training loss became" in error:  # as in this process: the run stops with it
                raise TridensError(error.split(": ", 1)[-1])
            return done, f"{error}; {kept}"
        if trial.status is TrialStatus.STOPPED:
            reason = self.trials.out_of_budget() or "stopped"
            return done, (f"{reason} during the supernet's training, after epoch {done} of {epochs} "
                          f"(its checkpoint is kept: run again to continue)")
        return epochs, None

    def _note_training(self, trial: Trial, gained: Mapping[str, Any]) -> None:
        """Add the supernet's training since the last note (:meth:`SupernetLoop.info`) to ``trial.info``
        (written with the trial's next row update)."""
        note_training(trial, gained)

    # -- search over subnets -------------------------------------------------------------------
    def search(self, supernet: Trial, trials: list[Trial], n: int) -> list[Trial]:
        """Score up to ``n`` subnets with the supernet's weights (those scored before are kept)."""
        strategy, net = self.strategy, self.net
        space = self.exp.space
        known: dict[str, Trial] = {}
        for t in trials:
            if _role(t) == "subnet" and t.info["oneshot"].get("supernet") == supernet.label and (
                    t.status is TrialStatus.COMPLETED or _violated(t)):
                known[sample_key(space.restrict(t.sample))] = t
        scorer = self._scorer()
        scored: list[Trial] = []
        seen: set[str] = set()
        cpu0 = time.process_time()
        # BatchNorm recalibration overwrites running statistics: keep the trained ones to restore.
        buffers = {k: v.clone() for k, v in net.model.state_dict().items()}

        def score(sample: dict[str, Any]) -> tuple[float, float]:
            key = sample_key(sample)
            if key in known:
                trial = known[key]
            else:
                self._check_budget(f"during the search, after {len(scored)} subnets scored")
                trial = self._score_subnet(supernet, sample, scorer)
                known[key] = trial
            scored.append(trial)
            return self._rank(trial)

        rng = random.Random(f"{self.seed}:search")
        start = []
        try:
            for sample in strategy.proposals():
                key = sample_key(sample)
                if key not in seen and len(seen) < n:
                    seen.add(key)
                    start.append((sample, score(sample)))
            ss = net.search_space
            if strategy.search == "random":
                random_search(ss, score, n, rng, seen)
            else:
                evolution(ss, score, n, rng, seen, strategy.population, strategy.tournament, start)
        finally:
            net.model.load_state_dict(buffers)
        done = [t for t in scored if t.status is TrialStatus.COMPLETED]
        best = max(done, key=lambda t: (*self._rank(t), -t.id)) if done else None
        if best is not None:
            self.say("searched %d subnets with inherited weights (%.1f CPU-s); best %s = %.4f: %s", len(scored),
                     time.process_time() - cpu0, self.objective.metric, best.metric, space.restrict(best.sample))
        return scored

    def _scorer(self) -> Callable[[dict[str, Any]], dict[str, float]]:
        """The validation metrics of a subnet with the supernet's weights (BatchNorm recalibrated)."""
        cfg, net = self.cfg, self.net
        if cfg is None:
            return LightningScorer(net, self.exp.evaluator, self.strategy.bn_batches)
        val = BatchSource(cfg.val, cfg.device)
        calib_source = BatchSource(cfg.train, cfg.device)
        g = torch.Generator().manual_seed(self.seed)
        calibration = list(itertools.islice(calib_source.batches(torch.randperm(len(calib_source), generator=g),
                                                                 cfg.batch_size, cfg.loader_seed(self.seed, 0)),
                                            self.strategy.bn_batches))
        return lambda sample: evaluate_path(net, sample, cfg, val, calibration)

    def _rank(self, trial: Trial) -> tuple[float, float]:
        """A subnet's rank: the objective, ties broken by the lower validation loss. Accuracy on a
        small validation set is coarse (many subnets tie at one value); the loss separates them. A
        subnet that violates a constraint ranks below all others."""
        if trial.status is not TrialStatus.COMPLETED:
            return -math.inf, -math.inf
        losses = trial.metrics.get("val_loss") if self.objective.metric != "val_loss" else None
        return self.objective.score(trial.metric), (-losses[-1] if losses else 0.0)

    def _score_subnet(self, supernet: Trial, sample: dict[str, Any],
                      scorer: Callable[[dict[str, Any]], dict[str, float]]) -> Trial:
        if self.exp.constraints:  # a subnet that violates one is failed unscored (as a multi-trial run does)
            model = self.net.extract(sample, seed=self.seed)
            trial = Trial(id=-1, sample={**sample, **self.hparams}, seed=self.seed, group=1, experiment=self.name,
                          info={"oneshot": {"role": "subnet", "strategy": type(self.strategy).__name__,
                                            "inherited": True, "supernet": supernet.label},
                                "params": sum(p.numel() for p in model.parameters())})
            violation = self.trials.violation(trial, model)
            if violation is not None:
                trial.fingerprint = _fingerprint(model, self.exp.space.example_inputs, sample)
                trial = self.trials.add(trial)
                life = self.trials.life(trial)
                life.start()
                life.fail(f"constraint violated: {violation}")
                return trial
        cpu0 = time.process_time()
        metrics = scorer(sample)
        cpu = time.process_time() - cpu0
        model = self.net.extract(sample, seed=self.seed)
        trial = Trial(id=-1, sample={**sample, **self.hparams}, seed=self.seed, group=1, experiment=self.name,
                      info={"oneshot": {"role": "subnet", "strategy": type(self.strategy).__name__, "inherited": True,
                                        "supernet": supernet.label, "eval_cpu_s": cpu},
                            "params": sum(p.numel() for p in model.parameters())})
        trial.fingerprint = _fingerprint(model, self.exp.space.example_inputs, sample)
        trial = self.trials.add(trial)
        life = self.trials.life(trial)
        life.start()
        life.report(0, metrics, last=True)  # scoring is not training: trial_timeout counts no seconds here
        life.finish(metrics.get(self.objective.metric), weights=model.state_dict())
        return trial

    # -- retraining the best -------------------------------------------------------------------
    def retrain(self, subnets: list[Trial], trials: list[Trial]) -> int:
        """Train the ``retrain`` best distinct architectures (``True``: the best) from scratch;
        returns how many there are."""
        space = self.exp.space
        k = int(self.strategy.retrain)
        ranked: list[Trial] = []
        for t in sorted(subnets, key=lambda t: (*(-v for v in self._rank(t)), t.id)):
            if t.status is TrialStatus.COMPLETED and all(sample_key(space.restrict(t.sample)) != sample_key(space.restrict(r.sample)) for r in ranked):
                ranked.append(t)
        for best in ranked[:k]:
            self._check_budget(f"before retraining {space.restrict(best.sample)}")
            self._retrain_one(best, trials)
        return len(ranked[:k])

    def _retrain_one(self, best: Trial, trials: list[Trial]) -> None:
        space, evaluator = self.exp.space, self.exp.evaluator
        sample = space.restrict(best.sample)
        key = sample_key(sample)
        mine = [t for t in trials if _role(t) == "retrain" and sample_key(space.restrict(t.sample)) == key]
        if any(t.status is TrialStatus.COMPLETED for t in mine):
            return
        # an unfinished retrain trains again; a failed one too with retry_failed, else a new one in its place
        retry = bool(getattr(self.exp, "retry_failed", True))
        trial = next((t for t in mine if not t.status.finished or (retry and t.status is TrialStatus.FAILED)), None)
        if trial is None:
            trial = self.trials.add(Trial(
                id=-1, sample={**sample, **self.hparams}, seed=self.trials.seed_of(sample), group=2, experiment=self.name,
                info={"oneshot": {"role": "retrain", "strategy": type(self.strategy).__name__, "of": best.label}}))
        else:
            self.db.delete_metrics(trial.id)
            trial.error, trial.metric, trial.finished_at = None, None, None
            trial.info["oneshot"]["of"] = best.label
        cpu0 = time.process_time()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(trial.seed)
            model = space.freeze(sample)
        trial.fingerprint = _fingerprint(model, space.example_inputs, sample)
        trial.info["params"] = sum(p.numel() for p in model.parameters())
        trial.status, trial.metrics = TrialStatus.PENDING, {}
        if self.cfg is None or self.trials.scratch(trial) is not None:  # where the executor trains its trials
            self.trials.train(trial, evaluator, model)
            if trial.status is TrialStatus.FAILED:
                self.say("retraining %s failed: %s", sample, (trial.error or "").strip().splitlines()[-1:])
            elif trial.metric is not None:
                self.say("retrained %s from scratch: %s = %.4f", sample, self.objective.metric, trial.metric)
            return
        life = self.trials.life(trial)
        life.start()
        trainer = evaluator.trainer(model, self.hparams, trial.seed)
        while not trainer.done:
            epoch, wall0 = trainer.epoch, time.perf_counter()
            values = {**trainer.train_epoch(), **trainer.validate()}
            verdict = life.report(epoch, values, last=trainer.done, seconds=time.perf_counter() - wall0)
            if verdict.value == "drop":  # over trial_timeout: the protocol failed it
                self.say("retraining %s stopped: %s", sample, trial.error)
                return
            if verdict.value in ("done", "stop"):
                break
        trial.info["oneshot"]["retrain_cpu_s"] = time.process_time() - cpu0
        final = trial.metrics.get(self.objective.metric)
        life.finish(final[-1] if final else None, weights=trainer.model.state_dict())
        if trial.metric is not None:
            self.say("retrained %s from scratch: %s = %.4f", sample, self.objective.metric, trial.metric)


def _fingerprint(model: Any, inputs: Any, sample: dict[str, Any]) -> str:
    from ..graph import trace

    try:
        return trace(model, inputs).fingerprint()
    except Exception:  # an untraceable model still gets a stable identity
        return "sample:" + sample_key(sample)


def note_training(trial: Trial, gained: Mapping[str, Any]) -> None:
    """Add what the supernet's training ``gained`` (:meth:`SupernetLoop.info`: epochs, steps, the
    strategy's summary, CPU and wall seconds, added up; ``params``) to ``trial.info``."""
    info = dict(trial.info)
    one = dict(info.get("oneshot", {}))
    for key, value in gained.items():
        if key == "params":
            info["params"] = int(value)
        else:
            one[key] = one.get(key, 0.0) + value if key in ("train_cpu_s", "train_wall_s") else value
    info["oneshot"] = one
    trial.info = info
