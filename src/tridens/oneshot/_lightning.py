"""One-shot training driven by a user's Lightning module (``td.evaluators.Lightning``).

The supernet is trained under a real Lightning ``Trainer`` built from the evaluator's arguments,
by a wrapper module in manual optimization around the user's module (as NNI's one-shot modules
wrap theirs). Each training batch:

1. the strategy prepares the step (:meth:`~._strategies.OneShotStrategy.before_weight_step`):
   RandomOneShot puts a random path in place; DARTS and GumbelDARTS first update their
   architecture parameters with their own optimizer on the loss of the user's ``training_step``
   over a held-out batch (from the evaluator's ``val_dataloaders``, as NNI's DARTS reads it), then
   mix the candidates by them;
2. the user's ``training_step`` on the training batch gives the loss; the weights step as
   Lightning would step them: ``optimizer_zero_grad``, ``manual_backward``,
   ``configure_gradient_clipping`` (the strategy's ``grad_clip``, else the Trainer's
   ``gradient_clip_val``: Lightning refuses that argument in manual optimization, so the wrapper
   takes it over), ``optimizer_step``, and the module's lr schedulers at their interval.

The module's hooks (epoch and batch starts and ends, ``setup``, backward hooks...) are forwarded to
it, and its ``self.log`` logs through the wrapper. After every training epoch the logged scalars
(with ``train_loss``: the mean of the epoch's weight-step losses) are reported to the supernet's
trial and a checkpoint (Lightning's own, with the strategy's state) goes to the store; a resumed
run continues from it with ``trainer.fit(ckpt_path=...)``. Subnets are then scored by the module's
``validation_step`` under a quiet ``Trainer.validate``.
"""

from __future__ import annotations

import copy
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from ..errors import TridensError
from ..evaluators import Lightning
from ._search import recalibrate
from ._strategies import OneShotStrategy
from ._supernet import Supernet
from ._training import CHECKPOINT_FORMAT, _as_rng_state, _rng_state, jsonable

__all__ = ["LightningSupernet", "LightningScorer", "lightning_inputs", "refuse_lightning"]

# Hooks Lightning calls on the wrapper that are the user's module's to run.
_FORWARDED = ("on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
              "on_train_batch_start", "on_train_batch_end", "on_validation_start", "on_validation_end",
              "on_validation_epoch_start", "on_validation_epoch_end", "on_validation_batch_start",
              "on_validation_batch_end", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_before_zero_grad", "teardown")
_CLIP_ARGS = ("gradient_clip_val", "gradient_clip_algorithm")


def refuse_lightning(strategy: OneShotStrategy, evaluator: Lightning) -> None:
    """Raise ``ValueError`` in one line when ``strategy`` cannot train a supernet with ``evaluator``'s module."""
    why = strategy.external_weights()
    if why is not None:
        raise ValueError(f"The one-shot strategy {type(strategy).__name__} cannot train the supernet with the Lightning "
                         f"module {type(evaluator.module).__name__}: {why}. Use DARTS (first order), GumbelDARTS or "
                         f"RandomOneShot with it, or td.evaluators.Classification / Regression with this strategy.")
    if strategy.uses_arch_data() and evaluator.datamodule is None and evaluator.val_dataloaders is None:
        raise ValueError(f"The 'val_dataloaders' parameter of {type(evaluator).__name__} is required by the one-shot "
                         f"strategy {type(strategy).__name__}: its architecture steps read the validation batches "
                         f"(and the subnets are scored on them). Got None instead.")
    if evaluator.datamodule is None and evaluator.val_dataloaders is None:
        raise ValueError(f"The 'val_dataloaders' parameter of {type(evaluator).__name__} is required by a one-shot "
                         f"strategy: the subnets are scored on them. Got None instead.")


def _inputs_of(batch: Any) -> Any:
    """The model's input in a batch of the usual forms (``(x, y)``, ``[x, y]``, ``x``), else None."""
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    return batch if isinstance(batch, torch.Tensor) else None


def _loaders(evaluator: Lightning, which: str) -> Any:
    if evaluator.datamodule is not None:
        return getattr(evaluator.datamodule, f"{which}_dataloader")()
    return evaluator.train_dataloaders if which == "train" else evaluator.val_dataloaders


def lightning_inputs(evaluator: Lightning) -> tuple[torch.Tensor, ...] | None:
    """A few validation inputs (the first batch's), for a supernet that needs inputs the space does not give."""
    loader = _loaders(evaluator, "val")
    try:
        x = _inputs_of(next(iter(loader))) if loader is not None else None
    except (StopIteration, TypeError):
        return None
    return (x[:4],) if x is not None else None


def _loss_of(out: Any) -> torch.Tensor | None:
    if isinstance(out, Mapping):
        return out.get("loss")
    return out  # type: ignore[no-any-return]


def _plain(obj: Any) -> Any:
    """``obj`` with only tensors, numbers, strings and containers of them (what the store's
    checkpoint loader reads back): Lightning's checkpoint less its hyperparameter objects."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if isinstance(k, (str, int)) and not str(k).endswith("hyper_parameters")}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj) if type(obj) in (list, tuple) else [_plain(v) for v in obj]
    if isinstance(obj, (torch.Tensor, str, int, float, bool, torch.Size)) or obj is None:
        return obj
    return repr(obj)


def _with_model(state: Mapping[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint of a stored supernet checkpoint ``state``, the model's weights put back
    into its ``state_dict`` from ``state["model"]`` (stored once)."""
    lightning = dict(state["lightning"])
    keys = state.get("lightning_model_keys", {})
    lightning["state_dict"] = {**lightning.get("state_dict", {}), **{k: state["model"][m] for k, m in keys.items()}}
    return lightning


def _wrapper(pl: Any, run: LightningSupernet, validates: bool) -> Any:
    """The LightningModule that trains ``run``'s supernet with the user's module (a class per package);
    with a ``validation_step`` only where the training ``validates`` (DARTS reads the validation
    batches for its architecture steps instead: no validation loop, and no step Lightning would
    warn about)."""

    class OneShotSupernet(pl.LightningModule):  # type: ignore[misc, name-defined]
        """The user's module in manual optimization, with the one-shot strategy's steps around its own."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.inner = inner

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.inner(*args, **kwargs)

        def setup(self, stage: str) -> None:
            self.inner.log = self.log   # the module logs through the wrapper: Lightning calls the wrapper's hooks
            self.inner.log_dict = self.log_dict
            self.inner.setup(stage)

        def configure_optimizers(self) -> Any:
            return self.inner.configure_optimizers()

        def configure_callbacks(self) -> Any:
            return self.inner.configure_callbacks()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return run.training_step(self, batch, batch_idx)

        if validates:
            def validation_step(self, batch: Any, batch_idx: int) -> Any:
                run.validation_path(int(self.trainer.global_step), batch_idx)
                return self.inner.validation_step(batch, batch_idx)

        def on_train_epoch_end(self) -> None:
            self.inner.on_train_epoch_end()
            run.epoch_end(self)

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.inner.on_save_checkpoint(checkpoint)
            checkpoint["tridens_oneshot"] = run.own_state()

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.inner.on_load_checkpoint(checkpoint)
            run.load_own_state(checkpoint["tridens_oneshot"])

    def forward_to_inner(name: str) -> Callable[..., Any]:
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.inner, name)(*args, **kwargs)
        hook.__name__ = name
        return hook

    for name in _FORWARDED:
        setattr(OneShotSupernet, name, forward_to_inner(name))
    return OneShotSupernet


class LightningSupernet:
    """The training of ``net`` by ``strategy`` with ``evaluator``'s Lightning module and Trainer
    arguments (seeded by ``seed``): :meth:`fit` trains, calling ``report(epoch, metrics, last,
    seconds)`` after each epoch (it returns the trial protocol's verdict's value); :meth:`state` is
    the checkpoint the store keeps; :meth:`load_trained` puts a finished checkpoint's weights and
    strategy state in place.

    >>> run = LightningSupernet(net, td.oneshot.DARTS(), ev, seed=0)   # doctest: +SKIP
    >>> run.fit(report, None, save)                                     # doctest: +SKIP
    """

    def __init__(self, net: Supernet, strategy: OneShotStrategy, evaluator: Lightning, seed: int):
        self.net, self.strategy, self.evaluator, self.seed = net, strategy, evaluator, int(seed)
        self.pl = evaluator.check()
        kwargs = dict(evaluator.trainer_kwargs)
        clip = kwargs.get("gradient_clip_val")
        self.clip_val = strategy.grad_clip if strategy.grad_clip is not None else clip
        self.clip_algorithm = kwargs.get("gradient_clip_algorithm")
        if strategy.epochs is not None:
            kwargs["max_epochs"] = strategy.epochs
        epochs = kwargs.get("max_epochs")
        # Lightning's defaults: fast_dev_run is one epoch; neither max_epochs nor max_steps, 1000 epochs
        self.epochs = 1 if kwargs.get("fast_dev_run") else int(epochs) if epochs is not None and epochs >= 0 else 1000
        self.trainer_evaluator = copy.copy(evaluator)
        self.trainer_evaluator.trainer_kwargs = {k: v for k, v in kwargs.items() if k not in _CLIP_ARGS}
        self.rng = random.Random(self.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            strategy.begin_architecture(net, 1, self.rng)  # the steps are known once Lightning has the loaders
        self.module = evaluator.fresh_module(net.model)
        self.losses: list[float] = []
        self.report: Callable[..., str] = lambda *a, **k: "continue"
        self.save: Callable[[dict[str, Any]], None] = lambda state: None
        self.epoch_wall = time.perf_counter()
        self.cpu_s = self.wall_s = 0.0
        self.steps = 0

    # -- checkpoints -----------------------------------------------------------------------------
    def own_state(self) -> dict[str, Any]:
        """The strategy's state and the random states (in Lightning's checkpoint)."""
        return {"strategy": self.strategy.state_dict(), "py_rng": _rng_state(self.rng), "torch_rng": torch.get_rng_state()}

    def load_own_state(self, state: Mapping[str, Any]) -> None:
        self.strategy.load_state_dict(state["strategy"])
        self.rng.setstate(_as_rng_state(state["py_rng"]))
        torch.set_rng_state(state["torch_rng"])

    def load_trained(self, state: Mapping[str, Any], where: Any) -> int:
        """Put the supernet's weights and the strategy's state of a stored checkpoint in place;
        returns its epochs done."""
        if state.get("format") != CHECKPOINT_FORMAT or "lightning" not in state:
            raise TridensError(f"{where} is not a tridens supernet checkpoint of a Lightning module")
        self.net.model.load_state_dict(state["model"])
        self.strategy.load_state_dict(state["strategy"])
        return int(state["epoch"])

    # -- training --------------------------------------------------------------------------------
    def fit(self, report: Callable[..., str], start: Mapping[str, Any] | None,
            save: Callable[[dict[str, Any]], None]) -> Any:
        """Train from ``start`` (a stored checkpoint, or None); ``report(epoch, metrics, last=, seconds=)``
        after each epoch, then ``save(state)``. Returns the Lightning trainer."""
        self.report, self.save = report, save
        trainer = self.trainer_evaluator.trainer()
        train = _loaders(self.evaluator, "train")
        if self.strategy.uses_arch_data():  # NNI's DARTS: the validation batches feed the architecture steps
            train, val = {"train": train, "val": _loaders(self.evaluator, "val")}, None
        else:
            val = _loaders(self.evaluator, "val")
        wrapper = _wrapper(self.pl, self, validates=val is not None)(self.module)
        with tempfile.TemporaryDirectory(prefix="tridens-oneshot-") as tmp:
            ckpt = None
            if start is not None:
                ckpt = Path(tmp) / "start.ckpt"
                torch.save(_with_model(start), ckpt)
            self.tmp = Path(tmp)
            self.epoch_wall = time.perf_counter()
            self.cpu0 = time.process_time()
            try:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.seed)  # a resumed run's random state comes from its checkpoint
                    trainer.fit(wrapper, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt,
                                weights_only=False)
            finally:
                for name in ("log", "log_dict"):
                    self.module.__dict__.pop(name, None)
        self.net.model.to("cpu")
        status = getattr(getattr(trainer, "state", None), "status", None)
        if str(getattr(status, "value", status)) == "interrupted":
            raise KeyboardInterrupt("Lightning's trainer was interrupted")
        return trainer

    def training_step(self, wrapper: Any, batch: Any, batch_idx: int) -> Any:
        """One batch: the strategy's architecture side, then the user's weight step."""
        trainer, inner = wrapper.trainer, wrapper.inner
        if self.strategy.total_steps <= 1:
            total = trainer.estimated_stepping_batches
            self.strategy.total_steps = int(total) if math.isfinite(total) else 1
            batches = trainer.num_training_batches
            self.strategy.steps_per_epoch = int(batches) if math.isfinite(batches) else 0
        if isinstance(batch, Mapping) and set(batch) == {"train", "val"}:
            batch, arch_batch = batch["train"], batch["val"]
        else:
            arch_batch = None

        def arch_loss() -> torch.Tensor:
            loss = _loss_of(inner.training_step(arch_batch, batch_idx))
            if loss is None:
                raise TridensError(f"{type(inner).__name__}.training_step returned no loss for an architecture step")
            return loss

        self.strategy.before_weight_step(int(trainer.global_step), arch_loss)
        optimizers = wrapper.optimizers()
        if isinstance(optimizers, list):
            if len(optimizers) != 1:
                raise TridensError(f"{type(inner).__name__}.configure_optimizers returned {len(optimizers)} optimizers; "
                                   f"a one-shot search steps the supernet's weights with one")
            optimizers = optimizers[0]
        out = inner.training_step(batch, batch_idx)
        loss = _loss_of(out)
        if loss is None:  # Lightning's convention: no loss, no step
            return out
        if not math.isfinite(float(loss.detach())):
            raise TridensError(f"the supernet's training loss became {float(loss.detach())} at epoch "
                               f"{trainer.current_epoch}, batch {batch_idx} ({type(self.strategy).__name__}); "
                               f"a lower learning rate usually helps")
        epoch = trainer.current_epoch
        inner.optimizer_zero_grad(epoch, batch_idx, optimizers)
        wrapper.manual_backward(loss)
        if self.clip_val:
            inner.configure_gradient_clipping(optimizers, gradient_clip_val=float(self.clip_val),
                                              gradient_clip_algorithm=self.clip_algorithm)
        inner.optimizer_step(epoch, batch_idx, optimizers)
        self.losses.append(float(loss.detach()))
        self._schedule(wrapper, "step", batch_idx + 1)
        return out

    def _schedule(self, wrapper: Any, interval: str, count: int) -> None:
        """Step the module's lr schedulers of ``interval`` whose frequency divides ``count``."""
        for config in wrapper.trainer.lr_scheduler_configs:
            if config.interval != interval or count % max(int(config.frequency), 1):
                continue
            metric = None
            if config.reduce_on_plateau:
                metric = wrapper.trainer.callback_metrics.get(config.monitor)
                if metric is None:
                    if config.strict:
                        raise TridensError(f"the lr scheduler monitors {config.monitor!r}, which the module did not "
                                           f"log (logged: {sorted(wrapper.trainer.callback_metrics)})")
                    continue
            wrapper.inner.lr_scheduler_step(config.scheduler, metric)

    def validation_path(self, step: int, batch_idx: int) -> None:
        """The path a validation batch of the training runs: RandomOneShot's, a random one (DARTS validates none)."""
        if not self.strategy.uses_arch_data():  # drawn apart from the training's paths
            rng = random.Random(f"{self.seed}:validation:{step}:{batch_idx}")
            self.net.set_path(self.net.search_space.random_sample(rng))

    def epoch_end(self, wrapper: Any) -> None:
        """After the module's epoch end: epoch-interval lr schedulers, the report, the checkpoint."""
        trainer = wrapper.trainer
        epoch = int(trainer.current_epoch)
        self._schedule(wrapper, "epoch", epoch + 1)
        metrics = {k: float(v.detach().cpu()) if isinstance(v, torch.Tensor) else float(v)
                   for k, v in trainer.callback_metrics.items()
                   if (isinstance(v, torch.Tensor) and v.numel() == 1) or isinstance(v, (int, float))}
        if self.losses:
            metrics["train_loss"] = sum(self.losses) / len(self.losses)
        self.losses = []
        last = epoch + 1 >= self.epochs or bool(getattr(trainer, "fast_dev_run", False))
        now = time.perf_counter()
        seconds, self.epoch_wall = now - self.epoch_wall, now
        self.wall_s += seconds
        cpu = time.process_time()
        self.cpu_s += cpu - self.cpu0
        self.cpu0 = cpu
        self.steps = int(trainer.global_step)
        verdict = self.report(epoch, metrics, last=last, seconds=seconds)
        path = self.tmp / f"epoch-{epoch}.ckpt"
        trainer.save_checkpoint(path)
        lightning = _plain(torch.load(path, map_location="cpu", weights_only=False))
        path.unlink()
        # The supernet's weights are kept once, as "model": Lightning's copy of them (its module's
        # state_dict holds the model) is left out, with the names to put them back under on resume.
        names = {id(t): k for k, t in self.net.model.state_dict(keep_vars=True).items()}
        model_keys = {k: names[id(t)] for k, t in wrapper.state_dict(keep_vars=True).items() if id(t) in names}
        lightning["state_dict"] = {k: v for k, v in lightning.get("state_dict", {}).items() if k not in model_keys}
        self.save({"format": CHECKPOINT_FORMAT, "lightning": lightning, "lightning_model_keys": model_keys,
                   "model": self.net.model.state_dict(), "strategy": self.strategy.state_dict(), "epoch": epoch + 1,
                   "step": int(trainer.global_step), "metrics": metrics})
        if verdict != "continue":
            trainer.should_stop = True

    def info(self) -> dict[str, Any]:
        """What the supernet trial's ``info["oneshot"]`` gains from the training since the last call."""
        out = {"epochs": self.epochs, "steps": self.steps, "lightning": type(self.evaluator.module).__name__,
               **jsonable(self.strategy.summary()), "train_cpu_s": self.cpu_s, "train_wall_s": self.wall_s,
               "params": sum(p.numel() for p in self.net.model.parameters())}
        self.cpu_s = self.wall_s = 0.0
        return out


class LightningScorer:
    """Scores a subnet with the supernet's weights: its path set, BatchNorm statistics recalibrated on
    ``bn_batches`` training batches, then the user's ``validation_step`` under one quiet
    ``Trainer.validate`` (the evaluator's ``limit_val_batches``, ``fast_dev_run``, accelerator...)."""

    def __init__(self, net: Supernet, evaluator: Lightning, bn_batches: int):
        self.net, self.evaluator = net, evaluator
        self.module = evaluator.fresh_module(net.model)
        validating = copy.copy(evaluator)
        validating.trainer_kwargs = {k: v for k, v in evaluator.trainer_kwargs.items() if k not in _CLIP_ARGS}
        self.trainer = validating.trainer()
        self.calibration = list(self._calibration(bn_batches))

    def _calibration(self, n: int) -> Iterator[tuple[torch.Tensor, None]]:
        if n <= 0:
            return
        loader = _loaders(self.evaluator, "train")
        if loader is None or isinstance(loader, Mapping):
            return
        for i, batch in enumerate(loader):
            if i >= n:
                return
            x = _inputs_of(batch)
            if x is None:  # a batch of another form: the statistics stay the supernet's
                return
            yield x, None

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, float]:
        self.net.set_path(dict(sample))
        if self.calibration:
            with torch.no_grad():
                recalibrate(self.net, self.calibration)  # type: ignore[arg-type]
        return self.evaluator.validate(self.module, self.trainer)
