"""``Lightning``: a user's PyTorch Lightning module trained by Lightning itself, one trial at a time.

PyTorch Lightning is an optional dependency (``pip install tridens[lightning]``). Each trial gets a
copy of the user's ``LightningModule`` holding the trial's model (``module.set_model(model)`` when
the module has it, else ``module.model = model``) and a fresh ``Trainer`` built from the keyword
arguments given here, with one callback of tridens added: after every validation epoch it reports
the logged metrics (``trainer.callback_metrics``) to the trial, and a stop decision of the strategy
sets ``trainer.should_stop``. ``td.report`` (and NNI's ``report_intermediate_result``) called from the
module's hooks is folded into that epoch's report. The engine owns nothing of the loop, so such
trials are never fused with others; timeouts, the trial's stored weights and resume of finished
trials work as for any evaluator.
"""

from __future__ import annotations

import copy
import importlib
import logging
from typing import Any, Mapping

import torch
import torch.nn as nn

from ..errors import TridensError
from ..trial import Decision, Objective
from ._base import Evaluator, NullReporter, Reporter
from ._errors import InvalidParameter, NothingReported
from ._functional import _SINK, _seeded, _Sink

__all__ = ["Lightning", "lightning_package", "LIGHTNING_MISSING"]

log = logging.getLogger("tridens")

LIGHTNING_MISSING = ("PyTorch Lightning is not installed: install the extra with pip install 'tridens[lightning]' "
                     "(or pip install lightning)")

# Trainer arguments whose Lightning default writes files or draws progress; a trial leaves the
# experiment's store as its only record unless the user asks for them.
_QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}


def lightning_package() -> Any:
    """The installed Lightning package (``lightning.pytorch``, else ``pytorch_lightning``); raises
    :class:`tridens.errors.TridensError` naming the extra when neither is installed."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TridensError(LIGHTNING_MISSING)


def _package_of(module: Any) -> Any:
    """The Lightning package ``module`` is a LightningModule of (a Trainer of the other refuses it)."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            pl = importlib.import_module(name)
        except ImportError:
            continue
        if isinstance(module, pl.LightningModule):
            return pl
    return None


class _Captured(_Sink):
    """Keeps what the module reports with ``td.report`` during an epoch, for the callback to merge."""

    def __init__(self) -> None:
        super().__init__(NullReporter(), None, None)
        self.pending: dict[str, float] = {}

    def report(self, value: Any, step: int | None) -> None:
        metrics = self.metrics_of(value, "tridens.report()")
        self.pending = {**metrics, **{k: v for k, v in self.pending.items() if k not in metrics}}


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[str(name)] = float(value.detach().cpu().item())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[str(name)] = float(value)
    return out


class _Run:
    """One trial's reporting state, shared by the callback and :meth:`Lightning.evaluate`."""

    def __init__(self, reporter: Reporter, objective: Objective, named: bool, max_steps: int | None,
                 captured: _Captured):
        self.reporter, self.objective, self.named, self.max_steps = reporter, objective, named, max_steps
        self.captured = captured
        self.last: float | None = None
        self.reports = 0
        self.stopped = False

    def validated(self, trainer: Any) -> None:
        if getattr(trainer, "sanity_checking", False):
            self.captured.pending = {}
            return
        logged = _scalars(trainer.callback_metrics)
        mine, self.captured.pending = self.captured.pending, {}
        metrics = {**mine, **{k: v for k, v in logged.items() if k not in mine}}
        name = self.objective.metric
        if self.named:
            if name not in metrics:
                raise InvalidParameter(f"The Lightning module logged {sorted(logged)} but not the objective metric "
                                       f"{name!r} (the evaluator's 'metric' parameter): log it with self.log({name!r}, "
                                       f"...) in validation_step, or give metric= one of those names")
        elif not mine:
            raise NothingReported("The Lightning module reported no objective after a validation epoch: give "
                                  "Lightning(..., metric='val_acc') naming a metric it logs, or call td.report(value) "
                                  "(NNI: nni.report_intermediate_result) in on_validation_epoch_end")
        else:
            name = next(iter(mine))
        metrics = {name: metrics[name], **metrics}
        self.last = metrics[name]
        decision = self.reporter.report(int(trainer.current_epoch), metrics)
        self.reports += 1
        if decision is Decision.STOP or (self.max_steps is not None and self.reports >= self.max_steps):
            self.stopped = True
            trainer.should_stop = True


def _callback(pl: Any, run: _Run) -> Any:
    class TridensReport(pl.Callback):  # type: ignore[misc, name-defined]
        """Reports each validation epoch's logged metrics to the trial; obeys the strategy's stop."""

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            run.validated(trainer)

    return TridensReport()


class Lightning(Evaluator):
    """Train each trial's model with a user's ``LightningModule`` under a ``lightning`` ``Trainer``.

    ``module`` is copied for every trial and given the trial's model (``set_model(model)`` if the
    module defines it, else the ``model`` attribute); ``trainer_kwargs`` build a fresh ``Trainer`` per
    trial (``max_epochs``, ``gradient_clip_val``, ``limit_*_batches``, ``fast_dev_run``,
    ``accelerator`` / ``devices``... as Lightning reads them; logger, checkpoint files, progress bar
    and model summary are off unless given). ``train_dataloaders`` / ``val_dataloaders`` /
    ``datamodule`` go to ``trainer.fit``. ``metric`` names the logged metric that is the objective
    (``mode`` "max" or "min"); with ``metric=None`` the objective is what the module reports with
    ``td.report`` in its hooks. Needs ``pip install tridens[lightning]``.

    >>> ev = td.evaluators.Lightning(MyModule(), train_dataloaders=train_dl, val_dataloaders=val_dl,
    ...                              metric="val_acc", max_epochs=3)             # doctest: +SKIP
    >>> td.Experiment(space, ev, strategy=td.strategy.Random(), budget=8).run()   # doctest: +SKIP
    """

    def __init__(self, module: Any, *, train_dataloaders: Any = None, val_dataloaders: Any = None,
                 datamodule: Any = None, metric: str | None = None, mode: str = "max", **trainer_kwargs: Any):
        self.module = module
        self.train_dataloaders = train_dataloaders
        self.val_dataloaders = val_dataloaders
        self.datamodule = datamodule
        self.metric = metric
        self.mode = mode
        self.trainer_kwargs = trainer_kwargs

    def params(self) -> dict[str, Any]:
        # The module, the loaders and the trainer's arguments are opaque to the search: no labels.
        return {"metric": self.metric, "mode": self.mode}

    @property
    def objective(self) -> Objective:
        return Objective(self.metric or "value", self.mode)

    @property
    def fast_dev_run(self) -> bool:
        """The Trainer's ``fast_dev_run`` (``True`` or a number of batches) was given."""
        return bool(self.trainer_kwargs.get("fast_dev_run"))

    @property
    def objective_from_reports(self) -> bool:  # type: ignore[override]
        """With no ``metric`` given, the module's first ``td.report`` names the objective."""
        return self.metric is None

    def check(self) -> Any:
        """Check the parameters and that Lightning is installed; returns the Lightning package."""
        pl = lightning_package()
        owner = type(self).__name__
        if self.mode not in ("max", "min"):
            raise InvalidParameter(f"The 'mode' parameter of {owner} must be one of ['max', 'min']. "
                                   f"Got {self.mode!r} instead.")
        pl = _package_of(self.module) or pl
        if not isinstance(self.module, pl.LightningModule):
            raise InvalidParameter(f"The 'module' parameter of {owner} must be a LightningModule. "
                                   f"Got {type(self.module).__name__} instead.")
        accelerator = self.trainer_kwargs.get("accelerator")
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise InvalidParameter(f"The 'accelerator' parameter of {owner} is {accelerator!r}, but this machine has no "
                                   f"CUDA device (torch.cuda.is_available() is False): give accelerator='auto' or 'cpu'.")
        if self.train_dataloaders is None and self.datamodule is None:
            raise InvalidParameter(f"The 'train_dataloaders' parameter of {owner} is required (or datamodule=). "
                                   f"Got None instead.")
        return pl

    def trainer(self, callbacks: list[Any] | None = None, max_steps: int | None = None) -> Any:
        """A fresh Lightning ``Trainer`` from ``trainer_kwargs`` (quiet unless asked), with ``callbacks``
        added to the user's; ``max_steps`` caps the epochs."""
        pl = _package_of(self.module) or lightning_package()
        kwargs = {**_QUIET, **self.trainer_kwargs}
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), *(callbacks or [])]
        if max_steps is not None:
            epochs = kwargs.get("max_epochs")
            kwargs["max_epochs"] = max_steps if epochs is None or epochs < 0 else min(int(epochs), max_steps)
        return pl.Trainer(**kwargs)

    def fresh_module(self, model: nn.Module) -> Any:
        """A copy of ``module`` (its state as given) holding ``model``."""
        trainer = self.module.__dict__.get("_trainer")
        memo = {id(trainer): None} if trainer is not None else {}
        module = copy.deepcopy(self.module, memo)
        if hasattr(module, "set_model"):
            module.set_model(model)
        else:
            module.model = model
        return module

    def evaluate(self, model: nn.Module | None, sample: Mapping[str, Any], seed: int,
                 reporter: Reporter | None = None, *, max_steps: int | None = None) -> float | None:
        """Fit a copy of the module holding ``model`` with a fresh Trainer; returns the objective's last value."""
        self.check()
        if model is None:
            raise InvalidParameter(f"{type(self).__name__} trains a model: the experiment needs a model space")
        if not self.__dict__.get("_said"):
            self._said = True
            log.info("Lightning trials train one at a time, as Lightning runs them (no fusion with other trials)")
        pl = _package_of(self.module) or lightning_package()
        captured = _Captured()
        run = _Run(reporter if reporter is not None else NullReporter(), self.objective, self.metric is not None,
                   max_steps, captured)
        trainer = self.trainer([_callback(pl, run)], max_steps)
        module = self.fresh_module(model)
        token = _SINK.set(captured)
        try:
            with _seeded(seed):
                self.run_fit(trainer, module)
        finally:
            _SINK.reset(token)
        model.to("cpu")
        status = getattr(getattr(trainer, "state", None), "status", None)
        if str(getattr(status, "value", status)) == "interrupted":
            raise KeyboardInterrupt("Lightning's trainer was interrupted")
        if run.last is None:
            value = _scalars(trainer.callback_metrics).get(self.objective.metric)
            if value is not None and self.metric is not None:
                return value
            if captured.pending:
                return next(iter(captured.pending.values()))
            raise NothingReported("the Lightning run validated no epoch, so it reported nothing: give "
                                  "val_dataloaders (and check limit_val_batches / check_val_every_n_epoch)")
        return run.last

    def validate(self, module: Any, trainer: Any) -> dict[str, float]:
        """Validate ``module`` with ``trainer`` (``trainer.validate``) on the evaluator's validation data
        (``val_dataloaders`` or the datamodule's); returns the logged scalars, what the module reported
        with ``td.report`` in its hooks first, and the objective under its name (with ``metric=None``: the
        first value reported).

        >>> metrics = ev.validate(module, ev.trainer())     # doctest: +SKIP
        """
        captured = _Captured()
        token = _SINK.set(captured)
        try:
            if self.datamodule is not None:
                trainer.validate(module, datamodule=self.datamodule, verbose=False)
            else:
                trainer.validate(module, dataloaders=self.val_dataloaders, verbose=False)
        finally:
            _SINK.reset(token)
        logged = _scalars(trainer.callback_metrics)
        mine = captured.pending
        metrics = {**mine, **{k: v for k, v in logged.items() if k not in mine}}
        if self.metric is None and mine:
            metrics = {self.objective.metric: next(iter(mine.values())), **metrics}
        return metrics

    def run_fit(self, trainer: Any, module: Any) -> Any:
        """``trainer.fit(module, ...)`` with the evaluator's loaders (or datamodule)."""
        if self.datamodule is not None:
            return trainer.fit(module, datamodule=self.datamodule)
        return trainer.fit(module, self.train_dataloaders, self.val_dataloaders)
