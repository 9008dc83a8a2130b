"""NNI's Lightning evaluators (``nni.nas.evaluator.pytorch``) on tridens.

``Classification(criterion, learning_rate, weight_decay, optimizer, train_dataloaders,
val_dataloaders, ..., max_epochs=...)`` becomes ``td.evaluators.Classification(train, val,
epochs, batch_size, optimizer, lr, weight_decay, loss)``: the datasets and batch size are read
from the DataLoaders, the optimizer class becomes its name, the criterion class its loss. Being
declarative, it serves both the multi-trial strategies (the engine owns the loop, so it can fuse
trials) and the one-shot ones (which need it), and needs no PyTorch Lightning. So does
``Lightning(ClassificationModule(...), Trainer(...))``. A custom LightningModule (a subclass of
``LightningModule``, ``ClassificationModule`` or ``RegressionModule``) is run by PyTorch Lightning
itself (``td.evaluators.Lightning``, the extra ``tridens[lightning]``), one trial at a time.

The Lightning ``Trainer`` arguments the declarative evaluators honour: ``max_epochs`` (Lightning's default: 1000),
``accelerator`` / ``devices`` (one device), ``fast_dev_run``, ``limit_train_batches`` /
``limit_val_batches`` (a fixed subset: the first ``n`` batches' worth of examples, or the first
fraction); logging and progress arguments are accepted and ignored; anything else is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, Subset, SubsetRandomSampler, default_collate

from tridens import evaluators as _ev

from tridens.errors import TridensError

from ._common import NotSupported, only_default, refuse

__all__ = ["Classification", "Regression", "DataLoader", "Lightning", "LightningModule", "Trainer",
           "ClassificationModule", "RegressionModule", "LightningEvaluator"]

_OPTIMIZERS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw", torch.optim.RMSprop: "rmsprop"}
_LOSSES = {nn.CrossEntropyLoss: "cross_entropy", nn.NLLLoss: "nll", nn.MSELoss: "mse", nn.L1Loss: "l1",
           nn.HuberLoss: "huber"}
# Trainer arguments that only change logging, checkpoint files or progress display.
_IGNORED = {"logger", "enable_progress_bar", "enable_model_summary", "enable_checkpointing", "log_every_n_steps",
            "num_sanity_val_steps", "default_root_dir", "deterministic", "benchmark", "check_val_every_n_epoch",
            "profiler", "detect_anomaly", "barebones", "inference_mode", "use_distributed_sampler", "num_nodes"}
_DEFAULTS: dict[str, Any] = {"max_steps": -1, "min_epochs": None, "min_steps": None, "gradient_clip_val": None,
                             "gradient_clip_algorithm": None, "accumulate_grad_batches": 1, "callbacks": None,
                             "strategy": "auto", "plugins": None, "max_time": None, "val_check_interval": None,
                             "reload_dataloaders_every_n_epochs": 0, "sync_batchnorm": False}
_HANDLED = {"max_epochs", "accelerator", "devices", "gpus", "fast_dev_run", "limit_train_batches", "limit_val_batches",
            "precision"}


def _optimizer(owner: str, optimizer: Any) -> tuple[str, float | None]:
    """The tridens optimizer name, and the momentum NNI's ``optimizer(params, lr, weight_decay)`` gets."""
    if optimizer in _OPTIMIZERS:
        # NNI builds the optimizer with lr and weight_decay only: SGD then has no momentum
        # (tridens' "sgd" defaults to 0.9); Adam/AdamW/RMSprop keep torch's defaults, as tridens does.
        return _OPTIMIZERS[optimizer], (0.0 if optimizer is torch.optim.SGD else None)
    raise NotSupported(f"The 'optimizer' parameter of {owner} must be one of the classes "
                       f"{', '.join('torch.optim.' + c.__name__ for c in _OPTIMIZERS)} (tridens builds it by name). "
                       f"Got {optimizer!r} instead.")


def _loss(owner: str, criterion: Any) -> Any:
    if criterion in _LOSSES:
        return _LOSSES[criterion]
    if isinstance(criterion, type) and issubclass(criterion, nn.Module):
        return criterion()  # any loss module class: its instance is a callable (output, target) -> loss
    if callable(criterion):
        return criterion
    raise NotSupported(f"The 'criterion' parameter of {owner} must be a loss class such as nn.CrossEntropyLoss. "
                       f"Got {criterion!r} instead.")


def _dataset(owner: str, name: str, loader: Any) -> tuple[Any, int | None]:
    """A DataLoader's dataset and batch size (a single-element list of loaders is accepted)."""
    if isinstance(loader, (list, tuple)):
        if len(loader) != 1:
            raise NotSupported(f"The {name!r} parameter of {owner} must be one DataLoader (tridens validates on one "
                               f"set). Got {len(loader)} of them instead.")
        loader = loader[0]
    if isinstance(loader, DataLoader):
        if loader.batch_size is None:
            raise NotSupported(f"The {name!r} parameter of {owner} uses a batch_sampler; tridens batches the dataset "
                               f"itself: give DataLoader(dataset, batch_size=...) instead.")
        if loader.collate_fn is not default_collate:
            raise NotSupported(f"The {name!r} parameter of {owner} has a custom collate_fn; tridens batches "
                               f"(input, target) pairs itself: collate in the dataset instead.")
        sampler = loader.sampler
        if isinstance(sampler, SubsetRandomSampler):  # a split of one dataset (NNI's DARTS tutorial)
            return Subset(loader.dataset, [int(i) for i in sampler.indices]), loader.batch_size
        if not isinstance(sampler, (SequentialSampler, RandomSampler)):
            raise NotSupported(f"The {name!r} parameter of {owner} uses a {type(sampler).__name__}; tridens draws the "
                               f"batches itself: give a Subset of the dataset, or a SubsetRandomSampler, instead.")
        return loader.dataset, loader.batch_size
    if hasattr(loader, "__getitem__") and hasattr(loader, "__len__"):
        return loader, None
    raise NotSupported(f"The {name!r} parameter of {owner} must be a torch DataLoader of (input, target) batches. "
                       f"Got {type(loader).__name__} instead.")


def _limit(dataset: Any, limit: Any, batch_size: int, owner: str, name: str) -> Any:
    """Lightning's ``limit_*_batches``: an int is that many batches, a float that fraction. tridens
    draws its batches from the dataset, so the limit keeps a fixed subset (the first examples)."""
    if limit is None or (isinstance(limit, float) and limit == 1.0):
        return dataset
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        raise NotSupported(f"The {name!r} parameter of {owner} must be a positive int (batches) or a float in (0, 1]. "
                           f"Got {limit!r} instead.")
    n = limit * batch_size if isinstance(limit, int) else math.ceil(limit * len(dataset))
    return Subset(dataset, range(min(len(dataset), max(1, int(n)))))


def _device(owner: str, accelerator: Any, devices: Any) -> str:
    if devices not in (None, 1, "1", "auto", -1) and not (isinstance(devices, (list, tuple)) and len(devices) == 1):
        raise refuse(owner, "devices", devices, "A tridens trial trains on one device; run trials in parallel with "
                     "td.Experiment(executor=td.executors.Process(workers=N) or Ray(workers=N)) instead.")
    kind = {None: "auto", "auto": "auto", "cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "mps": "mps"}.get(accelerator)
    if kind is None:
        raise NotSupported(f"The 'accelerator' parameter of {owner} must be one of 'auto', 'cpu', 'gpu', 'cuda', 'mps'. "
                           f"Got {accelerator!r} instead.")
    if kind == "cuda" and not torch.cuda.is_available():
        raise NotSupported(_no_gpu(owner, "accelerator", accelerator))
    if kind == "cuda" and isinstance(devices, (list, tuple)):
        return f"cuda:{int(devices[0])}"
    return kind


def _no_gpu(owner: str, name: str, value: Any) -> str:
    return (f"The {name!r} parameter of {owner} asks for a GPU ({name}={value!r}), but this machine has no CUDA device "
            f"(torch.cuda.is_available() is False): give gpus=0 or accelerator='cpu' (or 'auto').")


def _gpus(owner: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Lightning 1.x's ``gpus`` (gone in 2.x) as ``accelerator`` / ``devices``: 0 (or []) is the CPU,
    ``n`` or ``[i, ...]`` that many GPUs or those GPUs; on a machine without CUDA a GPU request is an error."""
    kwargs = dict(kwargs)
    gpus = kwargs.pop("gpus", None)
    if gpus is None:
        return kwargs
    if gpus in (0, "0") or (isinstance(gpus, (list, tuple)) and not gpus):
        kwargs["accelerator"] = "cpu"
        return kwargs
    if not torch.cuda.is_available():
        raise NotSupported(_no_gpu(owner, "gpus", gpus))
    kwargs["accelerator"], kwargs["devices"] = "gpu", (list(gpus) if isinstance(gpus, (list, tuple)) else gpus)
    return kwargs


def _training(owner: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The tridens training arguments from Lightning Trainer keyword arguments."""
    for key, value in kwargs.items():
        if key in _IGNORED or key in _HANDLED:
            continue
        if key in ("callbacks", "plugins") and not value:  # [] is the same as None
            continue
        if key in _DEFAULTS:
            only_default(owner, key, value, _DEFAULTS[key],
                         "tridens' declarative evaluators train max_epochs epochs with the optimizer as given.")
            continue
        raise NotSupported(f"{owner} got the Lightning Trainer argument {key!r}, which tridens does not honour. "
                           f"Supported: {', '.join(sorted(_HANDLED))} (and, ignored, {', '.join(sorted(_IGNORED))}).")
    precision = kwargs.get("precision", 32)
    if str(precision) not in ("32", "32-true"):
        raise refuse(owner, "precision", precision, "tridens trains in float32.")
    epochs = kwargs.get("max_epochs")
    epochs = 1000 if epochs is None else epochs  # Lightning's default when neither max_epochs nor max_steps is set
    fast = kwargs.get("fast_dev_run", False)
    limits = (kwargs.get("limit_train_batches"), kwargs.get("limit_val_batches"))
    if fast:
        n = 1 if fast is True else int(fast)
        epochs, limits = 1, (n, n)
    accelerator, devices = kwargs.get("accelerator", "auto"), kwargs.get("devices")
    gpus = kwargs.get("gpus")
    if gpus is not None:  # Lightning 1.x: gpus=0 is the CPU, gpus=1 (or [i]) one GPU
        if gpus in (0, "0") or (isinstance(gpus, (list, tuple)) and not gpus):
            accelerator = "cpu"
        elif not torch.cuda.is_available():
            raise NotSupported(_no_gpu(owner, "gpus", gpus))
        else:
            accelerator, devices = "gpu", ([int(gpus[0])] if isinstance(gpus, (list, tuple)) and len(gpus) == 1 else gpus)
            if devices not in (1, "1", -1) and not isinstance(devices, list):
                raise refuse(owner, "gpus", gpus, "A tridens trial trains on one device; run trials in parallel with "
                             "td.Experiment(executor=td.executors.Process(workers=N) or Ray(workers=N)) instead.")
    return {"epochs": epochs, "limits": limits, "device": _device(owner, accelerator, devices)}


def _translate(owner: str, criterion: Any, learning_rate: Any, weight_decay: Any, optimizer: Any, train_dataloaders: Any,
               val_dataloaders: Any, train_dataloader: Any, datamodule: Any, trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
    if datamodule is not None:
        raise refuse(owner, "datamodule", datamodule, "Give train_dataloaders= and val_dataloaders= instead.")
    if train_dataloader is not None:  # NNI's deprecated spelling
        train_dataloaders = train_dataloaders if train_dataloaders is not None else train_dataloader
    if train_dataloaders is None or val_dataloaders is None:
        missing = "train_dataloaders" if train_dataloaders is None else "val_dataloaders"
        raise NotSupported(f"The {missing!r} parameter of {owner} is required by tridens (it trains and validates "
                           f"every model itself). Got None instead.")
    train, batch_size = _dataset(owner, "train_dataloaders", train_dataloaders)
    val, val_batch_size = _dataset(owner, "val_dataloaders", val_dataloaders)
    batch_size = batch_size or 64
    training = _training(owner, trainer_kwargs)
    name, momentum = _optimizer(owner, optimizer)
    return {"train": _limit(train, training["limits"][0], batch_size, owner, "limit_train_batches"),
            "val": _limit(val, training["limits"][1], val_batch_size or batch_size, owner, "limit_val_batches"),
            "epochs": training["epochs"], "batch_size": batch_size, "optimizer": name, "lr": learning_rate,
            "momentum": momentum, "weight_decay": weight_decay, "loss": _loss(owner, criterion),
            "device": training["device"]}


class _Fit:
    """NNI's ``evaluator.fit(model)``: train ``model`` in place with the evaluator's settings (the
    trainer tridens runs in a trial, seed 0), validating after every epoch; and Lightning's
    ``fast_dev_run``, which the translation turns into one epoch of one batch."""

    _fast_dev_run = False

    @property
    def fast_dev_run(self) -> bool:
        """The Trainer argument ``fast_dev_run`` was given (one epoch, one batch of training and of
        validation): a one-shot search scores only its strategy's export."""
        return self._fast_dev_run

    def fit(self, model: nn.Module) -> dict[str, float]:
        """Train ``model`` for ``max_epochs``; returns the last epoch's training and validation metrics.

        >>> evaluator.fit(final_model)               # doctest: +SKIP
        {'train_loss': 0.41, 'val_acc': 0.87, 'val_loss': 0.39}
        """
        trainer = self.trainer(model, {}, seed=0)  # type: ignore[attr-defined]
        metrics: dict[str, float] = {}
        while not trainer.done:
            metrics = {**trainer.train_epoch(), **trainer.validate()}
        return metrics


class Classification(_Fit, _ev.Classification):
    """``nni.nas.evaluator.pytorch.Classification`` -> ``td.evaluators.Classification``; reports
    ``val_acc`` (the objective) and ``val_loss``. ``learning_rate`` may be a ``nni.choice``.

    >>> evaluator = Classification(learning_rate=1e-3, train_dataloaders=DataLoader(train, batch_size=64),
    ...                            val_dataloaders=DataLoader(val, batch_size=64), max_epochs=2)  # doctest: +SKIP
    """

    def __init__(self, criterion: Any = nn.CrossEntropyLoss, learning_rate: float = 0.001, weight_decay: float = 0.0,
                 optimizer: Any = torch.optim.Adam, train_dataloaders: Any = None, val_dataloaders: Any = None,
                 export_onnx: bool = True, train_dataloader: Any = None, num_classes: int | None = None,
                 datamodule: Any = None, **trainer_kwargs: Any) -> None:
        # export_onnx and num_classes have no effect here: `tridens export` writes a torch.export
        # program, and accuracy needs no class count.
        super().__init__(**_translate("Classification", criterion, learning_rate, weight_decay, optimizer,
                                      train_dataloaders, val_dataloaders, train_dataloader, datamodule, trainer_kwargs))
        self._fast_dev_run = bool(trainer_kwargs.get("fast_dev_run"))


class Regression(_Fit, _ev.Regression):
    """``nni.nas.evaluator.pytorch.Regression`` -> ``td.evaluators.Regression``; reports ``val_mse``
    (the objective, minimized) and ``val_mae``.

    >>> evaluator = Regression(train_dataloaders=DataLoader(train, batch_size=32), val_dataloaders=DataLoader(val),
    ...                        max_epochs=5)                                           # doctest: +SKIP
    """

    def __init__(self, criterion: Any = nn.MSELoss, learning_rate: float = 0.001, weight_decay: float = 0.0,
                 optimizer: Any = torch.optim.Adam, train_dataloaders: Any = None, val_dataloaders: Any = None,
                 export_onnx: bool = True, train_dataloader: Any = None, datamodule: Any = None,
                 **trainer_kwargs: Any) -> None:
        super().__init__(**_translate("Regression", criterion, learning_rate, weight_decay, optimizer,
                                      train_dataloaders, val_dataloaders, train_dataloader, datamodule, trainer_kwargs))
        self._fast_dev_run = bool(trainer_kwargs.get("fast_dev_run"))


def _lightning_base() -> type:
    """``LightningModule``'s base: Lightning's own when installed, else a stand-in whose subclasses
    (other than the plain ``ClassificationModule`` / ``RegressionModule``) refuse to be built."""
    try:
        return _ev.lightning_package().LightningModule  # type: ignore[no-any-return]
    except TridensError:
        return nn.Module


_Base: Any = _lightning_base()


class LightningModule(_Base):
    """``nni.nas.evaluator.pytorch.LightningModule``: a ``LightningModule`` (PyTorch Lightning's, from
    ``pip install tridens[lightning]``) whose ``model`` is the trial's model, set by ``set_model``.

    >>> class Module(LightningModule):                       # doctest: +SKIP
    ...     def training_step(self, batch, batch_idx):
    ...         x, y = batch
    ...         return nn.functional.cross_entropy(self.model(x), y)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _Base is nn.Module and type(self) not in (ClassificationModule, RegressionModule):
            raise NotSupported(f"{type(self).__name__} is a custom LightningModule, which tridens runs with PyTorch "
                               f"Lightning: {_ev.LIGHTNING_MISSING}")
        super().__init__(*args, **kwargs)

    @property
    def model(self) -> nn.Module:
        """The trial's model (after :meth:`set_model`)."""
        model = self.__dict__.get("_modules", {}).get("_model")
        if model is None:
            raise NotSupported("The LightningModule has no model yet: call set_model(model) first (the evaluator "
                               "does so for every trial).")
        return model  # type: ignore[no-any-return]

    def set_model(self, model: nn.Module) -> None:
        """Make ``model`` the module's ``model`` (a submodule, so its parameters are trained)."""
        if not isinstance(model, nn.Module):
            raise NotSupported(f"set_model needs an nn.Module. Got {type(model).__name__} instead.")
        self._model = model


class _Accuracy(nn.Module):
    """The fraction of a batch whose highest logit is the target (Lightning averages it over the epoch,
    weighted by batch size): NNI's ``acc`` metric, without torchmetrics' ``num_classes``."""

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.argmax(dim=-1) == target).float().mean()


class _MeanSquaredError(nn.Module):
    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((output.reshape(target.shape) - target) ** 2).mean()


class _SupervisedModule(LightningModule):
    """NNI's ``SupervisedLearningModule``: ``criterion``, ``metrics``, ``hparams.learning_rate`` /
    ``weight_decay``, the optimizer class; logs ``train_loss``, ``val_loss`` and ``{train,val}_{metric}``."""

    _METRICS: dict[str, type[nn.Module]] = {}

    def __init__(self, criterion: Any, learning_rate: float, weight_decay: float, optimizer: Any) -> None:
        super().__init__()
        self.settings = {"criterion": criterion, "learning_rate": learning_rate, "weight_decay": weight_decay,
                         "optimizer": optimizer}
        self.criterion = criterion() if isinstance(criterion, type) else criterion
        self.optimizer = optimizer
        self.metrics = nn.ModuleDict({name: cls() for name, cls in self._METRICS.items()})
        if _Base is not nn.Module:
            self.save_hyperparameters({"learning_rate": learning_rate, "weight_decay": weight_decay})

    def forward(self, x: Any) -> Any:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        y_hat = self(x)
        loss = self.criterion(y_hat, y)
        self.log("train_loss", loss, prog_bar=True)
        for name, metric in self.metrics.items():
            self.log("train_" + name, metric(y_hat, y), prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        y_hat = self(x)
        self.log("val_loss", self.criterion(y_hat, y), prog_bar=True)
        for name, metric in self.metrics.items():
            self.log("val_" + name, metric(y_hat, y), prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        y_hat = self(x)
        self.log("test_loss", self.criterion(y_hat, y), prog_bar=True)
        for name, metric in self.metrics.items():
            self.log("test_" + name, metric(y_hat, y), prog_bar=True)

    def configure_optimizers(self) -> Any:
        return self.optimizer(self.parameters(), lr=self.hparams.learning_rate,  # type: ignore[attr-defined]
                              weight_decay=self.hparams.weight_decay)  # type: ignore[attr-defined]


class ClassificationModule(_SupervisedModule):
    """``ClassificationModule(criterion, learning_rate, weight_decay, optimizer, ...)``. As given to
    ``Lightning(module, trainer, ...)`` it becomes a :class:`Classification` (tridens' declarative trainer,
    fusable, no Lightning needed); a subclass of it (overriding ``training_step``,
    ``configure_optimizers``...) is a LightningModule run by Lightning, reporting ``val_acc``."""

    _METRICS = {"acc": _Accuracy}

    def __init__(self, criterion: Any = nn.CrossEntropyLoss, learning_rate: float = 0.001, weight_decay: float = 0.0,
                 optimizer: Any = torch.optim.Adam, export_onnx: bool = True, num_classes: int | None = None) -> None:
        super().__init__(criterion, learning_rate, weight_decay, optimizer)


class RegressionModule(_SupervisedModule):
    """``RegressionModule(criterion, learning_rate, weight_decay, optimizer, ...)``: see ``ClassificationModule``;
    a subclass reports ``val_mse`` (minimized)."""

    _METRICS = {"mse": _MeanSquaredError}

    def __init__(self, criterion: Any = nn.MSELoss, learning_rate: float = 0.001, weight_decay: float = 0.0,
                 optimizer: Any = torch.optim.Adam, export_onnx: bool = True) -> None:
        super().__init__(criterion, learning_rate, weight_decay, optimizer)


class Trainer:
    """``Trainer(max_epochs=..., accelerator=..., ...)``: Lightning's Trainer arguments. With a plain
    ``ClassificationModule`` / ``RegressionModule`` they are checked as ``Classification``'s are; with a
    custom LightningModule every trial gets a fresh Lightning ``Trainer`` built from them (1.x's ``gpus``
    becomes ``accelerator`` / ``devices``)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def fit(self, model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None, **kwargs: Any) -> Any:
        """Lightning's ``trainer.fit(module, ...)`` with these arguments."""
        trainer = _ev.lightning_package().Trainer(**{**_QUIET_FIT, **_gpus("Trainer", self.kwargs)})
        return trainer.fit(model, train_dataloaders, val_dataloaders, **kwargs)


_QUIET_FIT = {"logger": False, "enable_checkpointing": False}


class LightningEvaluator(_ev.Lightning):
    """NNI's ``Lightning(module, trainer, ...)`` over a custom LightningModule: ``td.evaluators.Lightning``,
    with ``nni.report_final_result`` (from the module's hooks) taken as the trial's final value and
    ``fit(model)`` / ``evaluate(model)`` training ``model`` in place."""

    def evaluate(self, model: Any, sample: Any = None, seed: int = 0, reporter: Any = None, *,
                 max_steps: int | None = None) -> Any:
        if sample is None and reporter is None:  # NNI's evaluator.evaluate(model)
            return self.fit(model)
        from . import _FINAL

        final: list[float] = []
        token = _FINAL.set(final)
        try:
            value = super().evaluate(model, sample, seed, reporter, max_steps=max_steps)
        finally:
            _FINAL.reset(token)
        return final[-1] if final else value

    def fit(self, model: Any) -> Any:
        """Train ``model`` in place with the module and a fresh Trainer (NNI's ``evaluator.fit(model)``);
        returns the logged metrics of the last epoch."""
        self.check()
        self.module.set_model(model) if hasattr(self.module, "set_model") else setattr(self.module, "model", model)
        trainer = self.trainer()
        self.run_fit(trainer, self.module)
        return {k: float(v) for k, v in trainer.callback_metrics.items()
                if isinstance(v, torch.Tensor) and v.numel() == 1}


def Lightning(lightning_module: Any, trainer: Any, train_dataloaders: Any = None, val_dataloaders: Any = None,
              datamodule: Any = None, fit_kwargs: Any = None, train_dataloader: Any = None,
              detect_interrupt: bool = True) -> Any:
    """``Lightning(ClassificationModule(...) | RegressionModule(...), Trainer(...), train_dataloaders, val_dataloaders)``
    = ``Classification`` / ``Regression`` with those settings; a custom LightningModule (a subclass of
    ``LightningModule``, ``ClassificationModule`` or ``RegressionModule``) is run by PyTorch Lightning,
    one trial at a time (``td.evaluators.Lightning``).

    >>> evaluator = Lightning(ClassificationModule(learning_rate=1e-3), Trainer(max_epochs=2),
    ...                       train_dataloaders=DataLoader(train, batch_size=64), val_dataloaders=DataLoader(val))  # doctest: +SKIP
    """
    if not isinstance(trainer, Trainer):
        raise NotSupported(f"The 'trainer' parameter of Lightning must be this module's Trainer(...). "
                           f"Got {type(trainer).__name__} instead.")
    if fit_kwargs:
        raise refuse("Lightning", "fit_kwargs", fit_kwargs, "Give the dataloaders as train_dataloaders= / val_dataloaders=.")
    if train_dataloader is not None:  # NNI's deprecated spelling
        train_dataloaders = train_dataloaders if train_dataloaders is not None else train_dataloader
    kind = {ClassificationModule: Classification, RegressionModule: Regression}.get(type(lightning_module))
    if kind is not None:
        return kind(**lightning_module.settings, train_dataloaders=train_dataloaders, val_dataloaders=val_dataloaders,
                    datamodule=datamodule, **trainer.kwargs)
    if _Base is nn.Module or not isinstance(lightning_module, _Base):
        if _Base is nn.Module:
            raise NotSupported(f"Lightning(module, trainer) with a custom LightningModule runs PyTorch Lightning: "
                               f"{_ev.LIGHTNING_MISSING}")
        raise NotSupported(f"The 'lightning_module' parameter of Lightning must be a LightningModule (derive it from "
                           f"tridens.compat.nni.nas.evaluator.pytorch.LightningModule). Got "
                           f"{type(lightning_module).__name__} instead.")
    metric, mode = None, "max"
    if isinstance(lightning_module, ClassificationModule):
        metric = "val_acc"
    elif isinstance(lightning_module, RegressionModule):
        metric, mode = "val_mse", "min"
    return LightningEvaluator(lightning_module, train_dataloaders=train_dataloaders, val_dataloaders=val_dataloaders,
                              datamodule=datamodule, metric=metric, mode=mode, **_gpus("Lightning", trainer.kwargs))
