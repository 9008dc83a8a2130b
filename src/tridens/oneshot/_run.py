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
from typing import Any, Callable

import torch
from torch.utils.data import Subset

from ..errors import TridensError
from ..evaluators import SupervisedEvaluator, BatchSource
from ..store import Store, StoreError
from ..trial import Objective, Trial, TrialStatus
from ._search import evaluate_path, evolution, random_search, sample_key
from ._strategies import OneShotStrategy
from ._supernet import Supernet, build_supernet

__all__ = ["run_oneshot"]

log = logging.getLogger("tridens")
CHECKPOINT_FORMAT = 1


def _role(trial: Trial) -> str | None:
    info = trial.info.get("oneshot")
    return info.get("role") if isinstance(info, dict) else None


# Experiment options a one-shot search does not apply (it trains one supernet in this process), with
# the value that means "not set"; a user who set one is told rather than ignored silently.
_IGNORED = {
    "max_duration": (None, "its budget is the strategy's epochs and samples"),
    "constraints": ((), "subnets are not filtered by them"),
    "warm_start": (False, "the supernet starts from its own initialization"),
    "executor": (None, "the supernet trains in this process"),
    "workers": (2, "the supernet trains in this process"),
    "allocation": (None, "the supernet trains in this process"),
    "trial_timeout": (None, "there are no separate trials to time out"),
}


def _warn_ignored(exp: Any) -> None:
    for option, (unset, why) in _IGNORED.items():
        value = getattr(exp, option)
        if value != unset and not (option == "constraints" and not value):
            log.warning("one-shot: %s=%r is not applied to a one-shot search (%s)", option, value, why)


def run_oneshot(exp: Any, strategy: OneShotStrategy) -> str:
    """Run (or resume) ``exp`` with a one-shot ``strategy``; returns why it stopped (what it did),
    the line the experiment ends with."""
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
            reason = _OneShotRun(exp, db, name, strategy, net, cfg, hparams, objective).run()
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
                 hparams: dict[str, Any], objective: Objective):
        self.exp, self.db, self.name, self.strategy, self.net = exp, db, name, strategy, net
        self.cfg, self.hparams, self.objective = cfg, hparams, objective
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
        supernet = next((t for t in trials if _role(t) == "supernet"), None)
        if supernet is None:
            supernet = self.db.add_trial(self.name, Trial(
                id=-1, sample={}, seed=self.seed, fingerprint=f"supernet:{type(self.strategy).__name__}", group=0,
                info={"oneshot": {"role": "supernet", "strategy": type(self.strategy).__name__}}, experiment=self.name))
        epochs = self.train_supernet(supernet)
        subnets = self.search(supernet, trials)
        retrained = self.retrain(subnets, trials) if self.strategy.retrain else 0
        return (f"{type(self.strategy).__name__} is done: the supernet trained {epochs} epoch{'s' if epochs != 1 else ''}, "
                f"{len({t.id for t in subnets})} subnets scored with its weights"
                + (f", {retrained} retrained from scratch" if retrained else ""))

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

    def train_supernet(self, trial: Trial) -> int:
        """Train (or finish training) the supernet; returns its epochs."""
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
            return epochs
        trial.status = TrialStatus.RUNNING
        trial.started_at = trial.started_at or time.time()
        self.db.update_trial(trial)
        arch_of = self._arch_batcher(arch_data) if arch_data is not None else None
        current = [step]

        def arch_batch() -> tuple[torch.Tensor, torch.Tensor]:
            if arch_of is None:
                raise TridensError(f"{type(strategy).__name__} asked for architecture data but has no arch_fraction")
            return arch_of(current[0])

        cpu0, wall0 = time.process_time(), time.perf_counter()
        for epoch in range(start_epoch, epochs):
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
                        raise TridensError(f"the supernet's training loss became {loss} at epoch {epoch}, batch {b} "
                                           f"({type(strategy).__name__}); a lower 'lr' usually helps")
                    step += 1
                    total_loss += loss * len(y)
                    count += len(y)
                torch_rng = torch.get_rng_state()
            metrics = {"train_loss": total_loss / max(count, 1)}
            self.db.add_metrics(trial.id, epoch, metrics)
            state = {"format": CHECKPOINT_FORMAT, "model": net.model.state_dict(), "strategy": strategy.state_dict(),
                     "epoch": epoch + 1, "step": step, "py_rng": _rng_state(rng), "torch_rng": torch_rng}
            trial.checkpoint = str(self.db.save_checkpoint(trial.id, state, kind="supernet"))
            self.say("supernet epoch %d/%d: train_loss %.4f", epoch + 1, epochs, metrics["train_loss"])
        info = dict(trial.info)
        one = dict(info.get("oneshot", {}))
        one.update({"epochs": epochs, "steps": step, **_jsonable(strategy.summary()),
                    "train_cpu_s": one.get("train_cpu_s", 0.0) + time.process_time() - cpu0,
                    "train_wall_s": one.get("train_wall_s", 0.0) + time.perf_counter() - wall0})
        info["oneshot"] = one
        info["params"] = sum(p.numel() for p in net.model.parameters())
        trial.info = info
        trial.status = TrialStatus.COMPLETED
        trial.finished_at = time.time()
        self.db.update_trial(trial)
        return epochs

    # -- search over subnets -------------------------------------------------------------------
    def search(self, supernet: Trial, trials: list[Trial]) -> list[Trial]:
        cfg, strategy, net = self.cfg, self.strategy, self.net
        space = self.exp.space
        known: dict[str, Trial] = {}
        for t in trials:
            if _role(t) == "subnet" and t.status is TrialStatus.COMPLETED:
                known[sample_key(space.restrict(t.sample))] = t
        n = strategy.samples if self.exp.max_trials is None else min(strategy.samples, self.exp.max_trials)
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
                trial = self._score_subnet(supernet, sample, val, calibration)
                known[key] = trial
            scored.append(trial)
            return self._rank(trial)

        rng = random.Random(f"{self.seed}:search")
        start = []
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
        trial = self.db.add_trial(self.name, trial)
        trial.started_at = time.time()
        self.db.add_metrics(trial.id, 0, metrics)
        trial.metrics = {k: [v] for k, v in metrics.items()}
        trial.metric = metrics.get(self.objective.metric)
        trial.checkpoint = str(self.db.save_checkpoint(trial.id, model.state_dict()))
        trial.status = TrialStatus.COMPLETED
        trial.finished_at = time.time()
        self.db.update_trial(trial)
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
            trial = self.db.add_trial(self.name, Trial(
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
        trial.status, trial.started_at = TrialStatus.RUNNING, time.time()
        trial.metrics = {}
        self.db.update_trial(trial)
        trainer = evaluator.trainer(model, self.hparams, trial.seed)
        while not trainer.done:
            epoch = trainer.epoch
            values = {**trainer.train_epoch(), **trainer.validate()}
            self.db.add_metrics(trial.id, epoch, values)
            for k, v in values.items():
                trial.metrics.setdefault(k, []).append(v)
        trial.metric = trial.metrics.get(self.objective.metric, [None])[-1]
        trial.info["oneshot"]["retrain_cpu_s"] = time.process_time() - cpu0
        trial.checkpoint = str(self.db.save_checkpoint(trial.id, trainer.model.state_dict()))
        trial.status, trial.finished_at = TrialStatus.COMPLETED, time.time()
        self.db.update_trial(trial)
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
