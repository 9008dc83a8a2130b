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

import dataclasses
import itertools
import logging
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Protocol

import torch
from torch.utils.data import Subset

from ..errors import TridensError
from ..evaluators import SupervisedEvaluator, BatchSource
from ..store import Store, StoreError
from ..trial import Objective, Trial, TrialStatus
from ._search import evaluate_path, evolution, random_search, sample_key
from ._strategies import OneShotStrategy
from ._supernet import Supernet, build_supernet

__all__ = ["run_oneshot", "OneShotTrials", "TrialLife"]

log = logging.getLogger("tridens")
CHECKPOINT_FORMAT = 1


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


class _OutOfBudget(Exception):
    """The run's budget ended inside the search (raised through the search's score function)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# Experiment options a one-shot search does not apply (it trains one supernet in this process), with
# the value that means "not set"; a user who set one is told rather than ignored silently.
_IGNORED = {
    "constraints": ((), "subnets are not filtered by them"),
    "warm_start": (False, "the supernet starts from its own initialization"),
    "executor": (None, "the supernet trains in this process"),
    "workers": (2, "the supernet trains in this process"),
    "allocation": (None, "the supernet trains in this process"),
}


def _warn_ignored(exp: Any) -> None:
    for option, (unset, why) in _IGNORED.items():
        value = getattr(exp, option)
        if value != unset and not (option == "constraints" and not value):
            log.warning("one-shot: %s=%r is not applied to a one-shot search (%s)", option, value, why)


def run_oneshot(exp: Any, strategy: OneShotStrategy,
                trials_of: Callable[[Store, str], ContextManager[OneShotTrials]]) -> str:
    """Run (or resume) ``exp`` with a one-shot ``strategy``; returns why it stopped (what it did),
    the line the experiment ends with. ``trials_of(store, name)`` is the engine's
    :class:`OneShotTrials` of the run while the trials run (entered once the experiment's record
    exists; it tells the callbacks the run started and ended)."""
    if not isinstance(exp.evaluator, SupervisedEvaluator):
        raise ValueError(f"The 'evaluator' parameter of Experiment must be a declarative evaluator "
                         f"(td.evaluators.Classification or Regression) for the one-shot strategy "
                         f"{type(strategy).__name__}: the supernet is trained by tridens' own loop. "
                         f"Got {type(exp.evaluator).__name__} instead.")
    strategy.validate()
    _warn_ignored(exp)
    objective = exp._objective()
    path, name = exp._store_path(), exp._name()
    hparams = exp.evaluator.search_space().default_sample()
    for label, value in hparams.items():  # searched by nobody: the user is told, not left to find out
        log.warning("one-shot: %s does not search the evaluator's hyperparameter %r (%r): the supernet, every "
                    "subnet and the retrain use its first candidate %r; fix it in the evaluator, or search it "
                    "with a multi-trial strategy", type(strategy).__name__, label,
                    exp.evaluator.search_space()[label].domain, value)
    cfg = exp.evaluator.config(hparams)
    # refuses a space that cannot be one-shot, before any write
    net = build_supernet(exp.space, seed=exp.seed, example_inputs=_data_inputs(cfg))
    with Store(path) as db:
        db.lock_run(name)  # a second process running this experiment is refused, naming this one
        try:
            db.get_experiment(name)
        except StoreError:
            config = exp._config(objective)
            config["oneshot"] = {"strategy": type(strategy).__name__, "params": _jsonable(strategy.params())}
            db.create_experiment(name, config)
        db.update_experiment(name, status="running")
        try:
            with trials_of(db, name) as trials:
                reason = _OneShotRun(exp, db, name, strategy, net, cfg, hparams, objective, trials).run()
        except BaseException:
            db.update_experiment(name, status="interrupted")
            raise
        db.update_experiment(name, status="done")
    return reason


def _data_inputs(cfg: Any) -> tuple[torch.Tensor, ...] | None:
    """A few validation inputs, for a supernet that needs inputs the space does not give."""
    if cfg.val is None or len(cfg.val) == 0:
        return None
    x, _ = next(BatchSource(cfg.val, torch.device("cpu")).batches(None, 4))
    return (x,)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return repr(obj)


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
    def run(self) -> str:
        """Train the supernet, score subnets, retrain; returns what was done (the run's stop reason)."""
        trials = self.db.trials(self.name)
        n = self.strategy.samples if self.exp.max_trials is None else min(self.strategy.samples, self.exp.max_trials)
        self.trials.planned(1 + n + int(self.strategy.retrain))
        supernet = next((t for t in trials if _role(t) == "supernet"), None)
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

    def _split(self) -> tuple[Any, Any | None]:
        """The training examples for weights and (for DARTS/ENAS) the held-out ones for architecture steps."""
        train = self.cfg.train
        fraction = float(getattr(self.strategy, "arch_fraction", 0.0) or 0.0)
        if fraction <= 0:
            return train, None
        g = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(len(train), generator=g).tolist()
        n_arch = max(1, int(round(len(train) * fraction)))
        return Subset(train, order[n_arch:]), Subset(train, order[:n_arch])

    def _arch_batcher(self, arch: Any) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """The held-out batch of optimizer step ``step``: a pure function of the step, so a resumed
        run reads the batches an uninterrupted one would."""
        source = BatchSource(arch, self.cfg.device)
        bs = min(self.cfg.batch_size, len(source))
        per_round = len(source) // bs
        cache: dict[int, torch.Tensor] = {}

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            rnd, pos = divmod(step, per_round)
            if rnd not in cache:
                cache.clear()
                g = torch.Generator().manual_seed(self.seed * 7919 + rnd)
                cache[rnd] = torch.randperm(len(source), generator=g)
            return next(iter(source.batches(cache[rnd][pos * bs:(pos + 1) * bs], bs)))
        return batch

    def train_supernet(self, trial: Trial) -> tuple[int, str | None]:
        """Train (or finish training) the supernet; returns its epochs, and why the run stops here
        (``max_duration`` reached, ``trial_timeout`` exceeded) or ``None``."""
        cfg, strategy, net = self.cfg, self.strategy, self.net
        epochs = strategy.epochs or cfg.epochs
        weights_data, arch_data = self._split()
        source = BatchSource(weights_data, cfg.device)
        # The lr schedule spans the supernet's own steps (its epochs over the weights' share of the data).
        cfg = dataclasses.replace(cfg, epochs=epochs, train=weights_data)
        total = cfg.total_steps
        net.model.to(cfg.device)
        rng = random.Random(self.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            strategy.begin(net, cfg, total, rng)
        start_epoch, step = 0, 0
        ckpt = self._checkpoint_path(trial)
        if ckpt is not None and ckpt.is_file():
            state = self.db.load_checkpoint(ckpt)
            if state.get("format") != CHECKPOINT_FORMAT:
                raise StoreError(f"{ckpt} is not a tridens supernet checkpoint")
            net.model.load_state_dict(state["model"])
            strategy.load_state_dict(state["strategy"])
            start_epoch, step = int(state["epoch"]), int(state["step"])
            rng.setstate(_as_rng_state(state["py_rng"]))
            torch_rng = state["torch_rng"]
            if start_epoch < epochs:
                self.say("resuming the supernet at epoch %d of %d from %s", start_epoch, epochs, ckpt)
        else:
            torch_rng = torch.Generator().manual_seed(self.seed).get_state()
        if start_epoch >= epochs and trial.status is TrialStatus.COMPLETED:
            return epochs, None
        # A supernet trained again (after a stop, a timeout or a crash) keeps its earlier epochs' rows.
        trial.status, trial.error, trial.finished_at = TrialStatus.PENDING, None, None
        trial.started_at = trial.started_at or time.time()
        life = self.trials.life(trial)
        life.start()
        arch_of = self._arch_batcher(arch_data) if arch_data is not None else None
        current = [step]

        def arch_batch() -> tuple[torch.Tensor, torch.Tensor]:
            if arch_of is None:
                raise TridensError(f"{type(strategy).__name__} asked for architecture data but has no arch_fraction")
            return arch_of(current[0])

        cpu0, wall0 = time.process_time(), time.perf_counter()
        for epoch in range(start_epoch, epochs):
            epoch_wall = time.perf_counter()
            net.model.train()
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(source), generator=g)
            total_loss, count = 0.0, 0
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(torch_rng)
                for b, (x, y) in enumerate(source.batches(order, cfg.batch_size, cfg.loader_seed(self.seed, epoch))):
                    x = cfg.augment(x, self.seed, epoch, b)
                    current[0] = step
                    loss = strategy.step(x, y, arch_batch, step)
                    if not math.isfinite(loss):
                        err = TridensError(f"the supernet's training loss became {loss} at epoch {epoch}, batch {b} "
                                           f"({type(strategy).__name__}); a lower 'lr' usually helps")
                        life.fail(str(err))
                        raise err
                    step += 1
                    total_loss += loss * len(y)
                    count += len(y)
                torch_rng = torch.get_rng_state()
            metrics = {"train_loss": total_loss / max(count, 1)}
            verdict = life.report(epoch, metrics, last=epoch + 1 >= epochs, seconds=time.perf_counter() - epoch_wall)
            state = {"format": CHECKPOINT_FORMAT, "model": net.model.state_dict(), "strategy": strategy.state_dict(),
                     "epoch": epoch + 1, "step": step, "py_rng": _rng_state(rng), "torch_rng": torch_rng}
            trial.checkpoint = str(self.db.save_checkpoint(trial.id, state, kind="supernet"))
            self.say("supernet epoch %d/%d: train_loss %.4f", epoch + 1, epochs, metrics["train_loss"])
            self._note_training(trial, net, epochs, step, cpu0, wall0)
            cpu0, wall0 = time.process_time(), time.perf_counter()
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

    def _note_training(self, trial: Trial, net: Supernet, epochs: int, steps: int, cpu0: float, wall0: float) -> None:
        """Add the supernet's training since ``cpu0``/``wall0`` and its summary to ``trial.info``
        (written with the trial's next row update)."""
        info = dict(trial.info)
        one = dict(info.get("oneshot", {}))
        one.update({"epochs": epochs, "steps": steps, **_jsonable(self.strategy.summary()),
                    "train_cpu_s": one.get("train_cpu_s", 0.0) + time.process_time() - cpu0,
                    "train_wall_s": one.get("train_wall_s", 0.0) + time.perf_counter() - wall0})
        info["oneshot"] = one
        info["params"] = sum(p.numel() for p in net.model.parameters())
        trial.info = info

    # -- search over subnets -------------------------------------------------------------------
    def search(self, supernet: Trial, trials: list[Trial], n: int) -> list[Trial]:
        """Score up to ``n`` subnets with the supernet's weights (those scored before are kept)."""
        cfg, strategy, net = self.cfg, self.strategy, self.net
        space = self.exp.space
        known: dict[str, Trial] = {}
        for t in trials:
            if _role(t) == "subnet" and t.status is TrialStatus.COMPLETED:
                known[sample_key(space.restrict(t.sample))] = t
        val = BatchSource(cfg.val, cfg.device)
        calib_source = BatchSource(cfg.train, cfg.device)
        g = torch.Generator().manual_seed(self.seed)
        calibration = list(itertools.islice(calib_source.batches(torch.randperm(len(calib_source), generator=g),
                                                                 cfg.batch_size, cfg.loader_seed(self.seed, 0)),
                                            strategy.bn_batches))
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
                trial = self._score_subnet(supernet, sample, val, calibration)
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
        best = max(scored, key=lambda t: (*self._rank(t), -t.id)) if scored else None
        if best is not None:
            self.say("searched %d subnets with inherited weights (%.1f CPU-s); best %s = %.4f: %s", len(scored),
                     time.process_time() - cpu0, self.objective.metric, best.metric, space.restrict(best.sample))
        return scored

    def _rank(self, trial: Trial) -> tuple[float, float]:
        """A subnet's rank: the objective, ties broken by the lower validation loss. Accuracy on a
        small validation set is coarse (many subnets tie at one value); the loss separates them."""
        losses = trial.metrics.get("val_loss") if self.objective.metric != "val_loss" else None
        return self.objective.score(trial.metric), (-losses[-1] if losses else 0.0)

    def _score_subnet(self, supernet: Trial, sample: dict[str, Any], val: BatchSource, calibration: list[Any]) -> Trial:
        cpu0 = time.process_time()
        metrics = evaluate_path(self.net, sample, self.cfg, val, calibration)
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
            if all(sample_key(space.restrict(t.sample)) != sample_key(space.restrict(r.sample)) for r in ranked):
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
        trial = next((t for t in mine if not t.status.finished), None)
        if trial is None:
            trial = self.trials.add(Trial(
                id=-1, sample={**sample, **self.hparams}, seed=self.seed, group=2, experiment=self.name,
                info={"oneshot": {"role": "retrain", "strategy": type(self.strategy).__name__, "of": best.label}}))
        else:
            self.db.delete_metrics(trial.id)
            trial.info["oneshot"]["of"] = best.label
        cpu0 = time.process_time()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(trial.seed)
            model = space.freeze(sample)
        trial.fingerprint = _fingerprint(model, space.example_inputs, sample)
        trial.info["params"] = sum(p.numel() for p in model.parameters())
        trial.status, trial.metrics = TrialStatus.PENDING, {}
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


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _as_rng_state(state: Any) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (int(version), tuple(int(v) for v in internal), gauss)
