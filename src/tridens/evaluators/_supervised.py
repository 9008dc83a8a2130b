"""Declarative supervised training: ``Classification`` and ``Regression``.

The engine owns the loop of these evaluators, so it is exposed step-wise: ``evaluator.trainer(model,
sample, seed)`` gives a :class:`SupervisedTrainer` whose ``train_epoch()`` / ``validate()`` the
engine calls, and whose ``state_dict()`` is a complete checkpoint. ``evaluator.config(sample)``
gives the resolved, validated :class:`TrainConfig` a fused executor can read instead.

Determinism (CPU): with the same model initialization, sample and seed, every epoch's metrics are
bit-identical. Three things make that so:

* the order of training examples in epoch ``e`` is a permutation drawn from a
  ``torch.Generator`` seeded from ``(data_seed, e)`` alone, and the randomness of ``transforms``
  (augmentation) in batch ``b`` from ``(data_seed, e, b)``: by default (``data_seed=0``) every
  trial sees the same batches, so trials can share one data pipeline (tridens.xopt), and a
  resumed trial sees the batches it would have seen. ``data_seed=None`` uses the trial's seed.
  A map-style dataset's own randomness (random transforms in ``__getitem__``, torchvision style)
  is drawn likewise: torch's, Python's and NumPy's global generators are seeded from ``(data_seed,
  e, b)`` while batch ``b`` is read, and restored afterwards (validation batches from
  ``(data_seed, b)``), so such a dataset neither depends on nor disturbs the caller's random state;
* dropout draws from the trainer's own torch random stream, started with
  ``torch.manual_seed(seed)`` when the trainer is created and swapped in around its own work
  only, so trainers interleaved in one process don't disturb one another (nor the caller's
  global random state);
* the learning rate is a pure function of the optimizer step (see ``lr_factor``).

Precision (``precision=``, Lightning's names, off by default): ``"32-true"`` trains as the model
is; ``"bf16-mixed"`` runs every forward (training and validation, separate and fused alike) under
``torch.autocast`` in bfloat16 on the trial's device (matmuls and convolutions in bfloat16, weights,
optimizer state and the loss in float32); ``"16-mixed"`` is float16 autocast with a gradient scaler,
CUDA only. The precision is recorded in each trial's ``info["precision"]``.

Memory format (``memory_format=``, a policy like the precision, applied to separate and fused
training alike): ``"channels_last"`` runs a model with 2-d convolutions, its weights and its
4-d inputs channels-last; ``"contiguous"`` as torch lays them out; ``"auto"`` (default)
channels-last under a mixed precision and contiguous in float32. Within one format a fused model
trains bit for bit as it would alone (CPU); the two formats round differently from each other.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset

from ..trial import Objective
from ._base import StepwiseEvaluator
from ._errors import InvalidParameter, NonFiniteLoss
from ._params import Constraint, Interval, Options, Satisfies, check, labels_of
from ._schedules import SCHEDULES, scheduled_lr

__all__ = ["Classification", "Regression", "TrainConfig", "SupervisedTrainer", "OPTIMIZERS", "SupervisedEvaluator",
           "BatchSource", "CHECKPOINT_FORMAT", "correct_count", "align_output", "PRECISIONS",
           "MEMORY_FORMATS"]

OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
MEMORY_FORMATS = ("auto", "contiguous", "channels_last")
_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
CHECKPOINT_FORMAT = 1
"""Version of a trainer checkpoint's layout (``SupervisedTrainer.state_dict``), checked on load."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _is_dataset(value: Any) -> bool:
    return isinstance(value, Dataset) or (hasattr(value, "__getitem__") and hasattr(value, "__len__"))


def _is_device(value: Any) -> bool:
    if value == "auto":
        return True
    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        return False
    return True


def _is_milestones(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, int) and not isinstance(m, bool) for m in value):
        return False
    return all(m >= 1 for m in value) and all(a < b for a, b in zip(value, value[1:]))


def _is_batch_schedule(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in p)
            for p in value):
        return False
    return all(e >= 1 and b >= 1 for e, b in value) and all(a[0] < b[0] for a, b in zip(value, value[1:]))


def _epoch_seed(seed: int, *path: int) -> int:
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, *path]).generate_state(1)[0])


def _global_states() -> tuple[torch.Tensor, Any, Any]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _same_states(a: tuple[torch.Tensor, Any, Any], b: tuple[torch.Tensor, Any, Any]) -> bool:
    (ta, pa, na), (tb, pb, nb) = a, b
    return torch.equal(ta, tb) and pa == pb and all(
        np.array_equal(u, v) if isinstance(u, np.ndarray) else u == v for u, v in zip(na, nb))


@contextlib.contextmanager
def _seeded_globals(seed: int, check: bool = False) -> Iterator[list[bool]]:
    """torch's CPU, Python's and NumPy's global generators seeded with ``seed``, then restored:
    what a dataset's ``__getitem__`` (torchvision's random transforms, ``random``, ``np.random``)
    draws from while one batch is read. With ``check``, the list it gives holds afterwards whether
    anything drew from them."""
    py_state, np_state = random.getstate(), np.random.get_state()
    drew: list[bool] = []
    # one seed each, derived apart: torch's and NumPy's MT19937 seeded with the same integer give
    # the same words (a flip drawn from one would follow a crop drawn from the other)
    torch_seed, py_seed, np_seed = (int(w) for w in np.random.SeedSequence(seed).generate_state(3))
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(torch_seed)  # (torch.manual_seed would reseed CUDA's too)
        random.seed(py_seed)
        np.random.seed(np_seed)
        fresh = _global_states() if check else None
        try:
            yield drew
            if fresh is not None:
                drew.append(not _same_states(fresh, _global_states()))
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


@dataclass
class TrainConfig:
    """The resolved, validated training setup of one trial.

    ``loss`` is a callable ``(output, target) -> scalar``; ``metrics`` the validation metric names
    produced (``val_acc``, ``val_loss``, ``val_mse``, ``val_mae``).
    """

    train: Any
    val: Any
    epochs: int
    batch_size: int
    optimizer: str
    lr: float
    momentum: float | None
    weight_decay: float
    schedule: str
    loss: LossFn
    metrics: tuple[str, ...]
    device: torch.device
    transforms: Callable[[torch.Tensor], torch.Tensor] | None
    task: str = "classification"
    data_seed: int | None = 0
    milestones: tuple[int, ...] | None = None
    gamma: float = 0.1
    warmup_epochs: int = 0
    batch_schedule: tuple[tuple[int, int], ...] = ()
    precision: str = "32-true"
    memory_format: str = "contiguous"

    @property
    def channels_last(self) -> bool:
        """Whether models with 2-d convolutions train channels-last (``memory_format``)."""
        return self.memory_format == "channels_last"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context a forward runs in: ``torch.autocast`` on the device for a mixed precision.

        >>> import torch, tridens as td
        >>> ds = torch.utils.data.TensorDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))
        >>> cfg = td.evaluators.Classification(ds, ds, precision="bf16-mixed", device="cpu").config()
        >>> with cfg.autocast():
        ...     torch.nn.Linear(3, 2)(ds.tensors[0]).dtype
        torch.bfloat16
        """
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def loss_of(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of a batch's outputs, computed in float32 when autocast gave half-precision outputs."""
        if out.dtype in (torch.bfloat16, torch.float16):
            out = out.float()
        return self.loss(out, y)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of the first epoch (of every epoch without a ``batch_schedule``)."""
        return math.ceil(len(self.train) / self.batch_size)

    def batch_size_at(self, epoch: int) -> int:
        """The batch size of ``epoch``: ``batch_size``, then each ``(first epoch, size)`` of
        ``batch_schedule`` from its epoch on."""
        size = self.batch_size
        for first, later in self.batch_schedule:
            if epoch >= first:
                size = later
        return size

    def _epoch_starts(self) -> list[int]:
        starts = self.__dict__.get("_starts")
        if starts is None or len(starts) != self.epochs + 1:
            n, starts = len(self.train), [0]
            for epoch in range(self.epochs):
                starts.append(starts[-1] + math.ceil(n / self.batch_size_at(epoch)))
            self.__dict__["_starts"] = starts
        return starts

    def epoch_steps(self, epoch: int) -> tuple[int, int]:
        """The optimizer steps ``[first, last)`` of ``epoch``."""
        if not self.batch_schedule:
            spe = self.steps_per_epoch
            return epoch * spe, (epoch + 1) * spe
        starts = self._epoch_starts()
        if epoch < self.epochs:
            return starts[epoch], starts[epoch + 1]
        extra = math.ceil(len(self.train) / self.batch_size_at(epoch))   # past the budget: as the last size
        return starts[-1] + (epoch - self.epochs) * extra, starts[-1] + (epoch - self.epochs + 1) * extra

    @property
    def total_steps(self) -> int:
        return self.epoch_steps(self.epochs)[0]

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based, counted over the whole training)."""
        if self.schedule == "constant" and not self.warmup_epochs:  # every step of a fused unit asks
            return self.lr
        first = (lambda e: self.epoch_steps(e)[0]) if self.batch_schedule else (lambda e: e * self.steps_per_epoch)
        milestones = None if self.milestones is None else [first(m) for m in self.milestones]
        return scheduled_lr(self.schedule, self.lr, step, self.total_steps, milestones=milestones,
                            gamma=self.gamma, warmup=first(self.warmup_epochs))

    def stage_key(self, epoch: int) -> tuple[Any, ...]:
        """What training epoch ``epoch`` depends on besides the state it starts from: two trials
        whose keys agree for epochs ``0..e`` (same model, seed and initial weights) train those
        epochs identically, so a stage tree trains them once (:mod:`tridens.xopt`).

        >>> import torch, tridens as td
        >>> ds = torch.utils.data.TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))
        >>> ev = td.evaluators.Classification(ds, ds, epochs=td.choice("epochs", [2, 4]), batch_size=4)
        >>> ev.config({"epochs": 2}).stage_key(1) == ev.config({"epochs": 4}).stage_key(1)
        True
        """
        first, last = self.epoch_steps(epoch)
        lrs = tuple(self.lr_at(step) for step in range(first, last))
        return (self.optimizer, self.momentum, self.weight_decay, self.batch_size_at(epoch), self.data_seed, lrs,
                id(self.train), id(self.val), self.loss, self.transforms, self.task, self.metrics, str(self.device),
                self.precision, self.memory_format)


    def data_seed_of(self, seed: int) -> int:
        """The seed of the data order and augmentation of a trial with ``seed``."""
        return seed if self.data_seed is None else self.data_seed

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        """The permutation of training examples used in ``epoch`` by a trial with ``seed``."""
        g = torch.Generator().manual_seed(_epoch_seed(self.data_seed_of(seed), epoch))
        return torch.randperm(len(self.train), generator=g)

    def loader_seed(self, seed: int, epoch: int | None = None) -> int:
        """The seed of a map-style dataset's own randomness in training ``epoch`` (``None``:
        validation) of a trial with ``seed``; :meth:`BatchSource.batches` derives each batch's from it."""
        data_seed = self.data_seed_of(seed)
        return _epoch_seed(data_seed, 2) if epoch is None else _epoch_seed(data_seed, 1, epoch)

    def augment(self, x: torch.Tensor, seed: int, epoch: int, batch: int) -> torch.Tensor:
        """``transforms(x)`` with its randomness drawn from ``(data seed, epoch, batch)``, so the
        same batch is augmented the same way for every trial that shares the data seed."""
        if self.transforms is None:
            return x
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_epoch_seed(self.data_seed_of(seed), epoch * 1_000_003 + batch))
            return self.transforms(x)

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """A fresh optimizer of the configured kind. ``momentum`` means SGD's and RMSprop's
        momentum and Adam's/AdamW's first beta; ``None`` keeps the default (0.9 for SGD)."""
        wd, m = self.weight_decay, self.momentum
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9 if m is None else m, weight_decay=wd)
        if self.optimizer == "rmsprop":
            return torch.optim.RMSprop(params, lr=self.lr, momentum=0.0 if m is None else m, weight_decay=wd)
        betas = (0.9 if m is None else m, 0.999)
        cls = torch.optim.Adam if self.optimizer == "adam" else torch.optim.AdamW
        return cls(params, lr=self.lr, betas=betas, weight_decay=wd)


class SupervisedEvaluator(StepwiseEvaluator):
    """Shared machinery of Classification and Regression: their parameters, validation and trainer;
    the evaluator type a fused unit can drive itself (operator batching, CSE, super-graph)."""

    task = "?"
    _LOSSES: dict[str, LossFn] = {}
    _METRICS: dict[str, str] = {}          # accepted name -> reported name
    _DEFAULT_METRICS: tuple[str, ...] = ()
    _MODES: dict[str, str] = {}

    def __init__(self, train: Any, val: Any, *, epochs: int = 10, batch_size: int = 64, optimizer: str = "sgd",
                 lr: float = 0.01, momentum: float | None = None, weight_decay: float = 0.0,
                 schedule: str = "constant", loss: str | LossFn | None = None,
                 metrics: Sequence[str] | None = None, metric: str | None = None,
                 device: str | torch.device = "auto",
                 transforms: Callable[[torch.Tensor], torch.Tensor] | None = None, data_seed: int | None = 0,
                 milestones: Sequence[int] | None = None, gamma: float = 0.1, warmup_epochs: int = 0,
                 batch_schedule: Sequence[Sequence[int]] | None = None, precision: str = "32-true",
                 memory_format: str = "auto"):
        self.train = train
        self.val = val
        self.epochs = epochs
        self.batch_size = batch_size
        self.optimizer = optimizer
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.schedule = schedule
        self.loss = loss
        self.metrics = metrics
        self.metric = metric
        self.device = device
        self.transforms = transforms
        self.data_seed = data_seed
        self.milestones = milestones
        self.gamma = gamma
        self.warmup_epochs = warmup_epochs
        self.batch_schedule = batch_schedule
        self.precision = precision
        self.memory_format = memory_format

    # -- what is reported -------------------------------------------------------------------
    def _metric_names(self, metrics: Sequence[str] | None) -> tuple[str, ...]:
        names = self._DEFAULT_METRICS if metrics is None else tuple(metrics)
        return tuple(dict.fromkeys(self._METRICS[m] for m in names))

    @property
    def objective(self) -> Objective:
        """``metric=`` if given, else the first reported validation metric: ``val_acc`` (max) for
        Classification and ``val_mse`` (min) for Regression by default. Accuracy is maximized,
        losses and errors minimized."""
        if isinstance(self.metric, str):
            metric = self.metric
        else:
            chosen = self.metrics if isinstance(self.metrics, (list, tuple)) and self.metrics and all(
                m in self._METRICS for m in self.metrics) else None
            metric = self._metric_names(chosen)[0]
        return Objective(metric, self._MODES.get(metric, "min"))

    # -- validation -------------------------------------------------------------------------
    def _constraints(self) -> dict[str, list[Constraint]]:
        return {
            "train": [Satisfies(_is_dataset, "a torch Dataset")],
            "val": [Satisfies(_is_dataset, "a torch Dataset")],
            "epochs": [Interval("int", 1, None)],
            "batch_size": [Interval("int", 1, None)],
            "optimizer": [Options(OPTIMIZERS)],
            "lr": [Interval("float", 0, None, closed="neither")],
            "momentum": [Interval("float", 0, 1, closed="left"), Satisfies(lambda v: v is None, "None")],
            "weight_decay": [Interval("float", 0, None)],
            "schedule": [Options(SCHEDULES)],
            "loss": [Options(list(self._LOSSES)), Satisfies(callable, "a callable (output, target) -> loss"),
                     Satisfies(lambda v: v is None, "None")],
            "device": [Satisfies(_is_device, "'auto' or a torch device ('cpu', 'cuda', 'cuda:1')")],
            "transforms": [Satisfies(lambda v: v is None or callable(v), "None or a callable batch -> batch")],
            "data_seed": [Interval("int", 0, None), Satisfies(lambda v: v is None, "None")],
            "milestones": [Satisfies(_is_milestones, "None or an increasing list of epochs >= 1"),],
            "gamma": [Interval("float", 0, None, closed="neither")],
            "warmup_epochs": [Interval("int", 0, None)],
            "batch_schedule": [Satisfies(_is_batch_schedule, "None or a list of [first epoch >= 1, batch size >= 1] "
                                                             "pairs in increasing epochs")],
            "precision": [Options(PRECISIONS)],
            "memory_format": [Options(MEMORY_FORMATS)],
        }

    def config(self, sample: Mapping[str, Any] | None = None) -> TrainConfig:
        """Resolve the parameters from ``sample`` and validate them.

        >>> import torch, tridens as td
        >>> ds = torch.utils.data.TensorDataset(torch.zeros(10, 4), torch.zeros(10, dtype=torch.long))
        >>> ev = td.evaluators.Classification(ds, ds, lr=td.choice("lr", [0.1, 0.5]), epochs=2, batch_size=4)
        >>> ev.config({"lr": 0.5}).lr, ev.config({"lr": 0.5}).total_steps
        (0.5, 6)
        """
        sample = {} if sample is None else sample
        owner = type(self).__name__
        given = self.params()
        values = self.resolved(sample)
        labels = labels_of(given)
        check(owner, values, self._constraints(), labels)
        metrics = values["metrics"]
        if metrics is not None and (isinstance(metrics, str) or not all(m in self._METRICS for m in metrics) or not metrics):
            raise InvalidParameter(f"The 'metrics' parameter of {owner} must be None or a non-empty list of names "
                                   f"from {sorted(self._METRICS)!r}. Got {metrics!r} instead.")
        names = self._metric_names(metrics)
        allowed = [*names, "train_loss"]
        if values["metric"] is not None and values["metric"] not in allowed:
            raise InvalidParameter(f"The 'metric' parameter of {owner} must be None or one of {allowed!r} "
                                   f"(the metrics it reports). Got {values['metric']!r} instead.")
        for name in ("train", "val"):
            if len(values[name]) == 0:
                raise InvalidParameter(f"The {name!r} parameter of {owner} must be a non-empty dataset. Got an empty one.")
        loss = values["loss"]
        loss_fn = self._LOSSES[loss] if isinstance(loss, str) else (loss or next(iter(self._LOSSES.values())))
        device = values["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise InvalidParameter(f"The 'device' parameter of {owner} is {str(device)!r}, but this machine has no "
                                   f"CUDA device (torch.cuda.is_available() is False): give device='auto' or 'cpu'.")
        if values["precision"] == "16-mixed" and torch.device(device).type != "cuda":
            raise InvalidParameter(f"The 'precision' parameter of {owner} is '16-mixed' (float16 with a gradient "
                                   f"scaler), which needs CUDA; on {device} use 'bf16-mixed'.")
        return TrainConfig(
            train=values["train"], val=values["val"], epochs=values["epochs"], batch_size=values["batch_size"],
            optimizer=values["optimizer"], lr=float(values["lr"]),
            momentum=None if values["momentum"] is None else float(values["momentum"]),
            weight_decay=float(values["weight_decay"]), schedule=values["schedule"], loss=loss_fn,
            metrics=names, device=torch.device(device), transforms=values["transforms"], task=self.task,
            data_seed=values["data_seed"],
            milestones=None if values["milestones"] is None else tuple(int(m) for m in values["milestones"]),
            gamma=float(values["gamma"]), warmup_epochs=values["warmup_epochs"],
            batch_schedule=tuple((int(e), int(b)) for e, b in values["batch_schedule"] or ()),
            precision=values["precision"],
            memory_format=_resolved_memory_format(values["memory_format"], values["precision"]))

    # -- training ---------------------------------------------------------------------------
    def trial_info(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """``{"precision": ..., "memory_format": ...}``: the trial's training precision
        (``"32-true"`` unless set) and memory format (resolved: ``"channels_last"`` or ``"contiguous"``)."""
        values = self.resolved(sample)
        precision = values.get("precision", "32-true")
        precision = precision if isinstance(precision, str) else "32-true"
        memory_format = values.get("memory_format", "auto")
        memory_format = memory_format if memory_format in MEMORY_FORMATS else "auto"
        return {"precision": precision, "memory_format": _resolved_memory_format(memory_format, precision)}

    def trainer(self, model: nn.Module | None, sample: Mapping[str, Any], seed: int) -> "SupervisedTrainer":
        """A trainer at epoch 0 for ``model`` under ``sample``'s hyperparameters.

        >>> trainer = evaluator.trainer(model, {"lr": 0.1}, seed=0)       # doctest: +SKIP
        >>> trainer.train_epoch(), trainer.validate()                     # doctest: +SKIP
        ({'train_loss': 1.93}, {'val_acc': 0.71, 'val_loss': 1.12})
        """
        if not isinstance(model, nn.Module):
            raise InvalidParameter(f"{type(self).__name__} trains an nn.Module; got {type(model).__name__} as the model")
        return SupervisedTrainer(self.config(sample), model, seed, owner=type(self).__name__)


def _resolved_memory_format(memory_format: str, precision: str) -> str:
    """``"channels_last"`` or ``"contiguous"``: ``"auto"`` is channels-last under a mixed precision
    (bfloat16 convolutions pay so on CPU), contiguous in float32."""
    if memory_format == "auto":
        return "contiguous" if precision == "32-true" else "channels_last"
    return memory_format


def correct_count(out: torch.Tensor, y: torch.Tensor) -> float:
    """Correct predictions of a batch: ``out`` logits (N, classes) against class indices ``y``."""
    return float((out.argmax(dim=1) == y).sum().item())


class Classification(SupervisedEvaluator):
    """Train a classifier with a standard loop; report ``val_acc`` and ``val_loss`` per epoch.

    ``train`` and ``val`` are torch datasets of ``(input, class index)`` pairs (a
    ``TensorDataset``, or a ``Subset`` of one, is indexed directly, without a DataLoader).
    Every parameter may be a ``td.choice`` placeholder. ``optimizer`` is one of ``sgd, adam,
    adamw, rmsprop``; ``schedule`` one of ``constant, step, cosine, linear, rex``, set every
    optimizer step, after a linear warmup of ``warmup_epochs``; ``step`` multiplies the lr by
    ``gamma`` at each of ``milestones`` (epochs; default: at 50% and 75% of training);
    ``batch_schedule`` changes the batch size per stage: ``[[first epoch, size], ...]`` after
    ``batch_size`` (e.g. ``batch_size=32, batch_schedule=[[4, 128]]``; may be a ``td.choice``);
    ``momentum`` is SGD/RMSprop momentum or Adam's first beta (``None``: the
    default, 0.9 for SGD); ``loss`` defaults to cross entropy (or a name, or any callable);
    ``metrics`` chooses among ``"acc"`` and ``"loss"``; ``metric`` the objective (default
    ``val_acc``); ``transforms`` is applied to each training input batch (augmentation).
    ``data_seed`` fixes the data order and augmentation shared by every trial (``None``: each
    trial's own seed); a trial's seed decides its initialization and dropout. ``precision``:
    ``"32-true"`` (default), ``"bf16-mixed"`` (bfloat16 autocast, loss in float32) or
    ``"16-mixed"`` (float16 autocast with a gradient scaler, CUDA only). ``memory_format``:
    ``"auto"`` (default: channels-last under a mixed precision), ``"channels_last"`` or
    ``"contiguous"``, for separate and fused training alike (see the module docstring).

    >>> import tridens as td
    >>> ev = td.evaluators.Classification(train=train_ds, val=val_ds, epochs=3, batch_size=64,  # doctest: +SKIP
    ...                                   optimizer="sgd", lr=td.choice("lr", [0.01, 0.05, 0.1]))
    >>> ev.evaluate(model, {"lr": 0.05}, seed=0)                                                 # doctest: +SKIP
    0.93
    """

    def check_data(self, sample: Mapping[str, Any] | None = None) -> None:
        """Before the first trial: the labels of ``train`` and ``val`` are class indices, where the
        loss is a built-in one (a loss of the user's own takes what it takes)."""
        values = self.resolved(sample or {})
        if values["loss"] is not None and not isinstance(values["loss"], str):
            return
        for name in ("train", "val"):
            check_class_labels(values[name], name, type(self).__name__)

    task = "classification"
    _LOSSES = {"cross_entropy": F.cross_entropy, "nll": F.nll_loss}
    _METRICS = {"acc": "val_acc", "accuracy": "val_acc", "loss": "val_loss"}
    _DEFAULT_METRICS = ("acc", "loss")
    _MODES = {"val_acc": "max"}


def align_output(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``out`` shaped to compare with targets ``y``: (N, 1) outputs against (N,) targets are
    compared element-wise, not by broadcasting to (N, N)."""
    if out.dim() == 2 and out.shape[1] == 1 and y.dim() == 1:
        return out.squeeze(1)
    return out


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(align_output(out, y), y.to(out.dtype))


def _l1(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(align_output(out, y), y.to(out.dtype))


def _huber(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.huber_loss(align_output(out, y), y.to(out.dtype))


class Regression(SupervisedEvaluator):
    """Train a regressor; report ``val_mse`` and ``val_mae`` per epoch (``metrics`` may add ``"loss"``).

    Same parameters as :class:`Classification`; ``loss`` defaults to mean squared error
    (``"mse"``, ``"l1"``, ``"huber"`` or any callable). A model output of shape ``(N, 1)`` is
    compared with targets of shape ``(N,)`` element by element.

    >>> ev = td.evaluators.Regression(train_ds, val_ds, epochs=5, optimizer="adam", lr=1e-3)  # doctest: +SKIP
    """

    task = "regression"
    _LOSSES = {"mse": _mse, "l1": _l1, "huber": _huber}
    _METRICS = {"mse": "val_mse", "mae": "val_mae", "loss": "val_loss"}
    _DEFAULT_METRICS = ("mse", "mae")
    _MODES: dict[str, str] = {}


def _to_device(x: Any, device: torch.device) -> Any:
    """A collated input on ``device``: a tensor, or the tuple/list/dict of tensors a model taking
    several inputs receives."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    return x


def _index_dtype(y: torch.Tensor) -> torch.Tensor:
    """Integer labels (int32 from numpy, int16, uint8) as int64, the dtype losses take class
    indices in: a lossless cast. Other labels as they are."""
    if y.dtype in (torch.int8, torch.int16, torch.int32, torch.uint8):
        return y.long()
    return y


def _labels_of(dataset: Any) -> tuple[torch.Tensor, bool] | None:
    """The labels of a dataset: every one for a ``TensorDataset`` (or a ``Subset`` of one), else
    the first item's, with a batch dimension added; and whether they are every label. ``None``
    when they cannot be read as a tensor."""
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    tensors = getattr(base, "tensors", None)
    if isinstance(tensors, (tuple, list)) and len(tensors) >= 2 and isinstance(tensors[1], torch.Tensor):
        return tensors[1], True
    try:
        item = dataset[0]
        return torch.as_tensor(item[1]).unsqueeze(0), False
    except Exception:  # an item that is no (input, label) pair of numbers: the trial's error says it
        return None


def check_class_labels(dataset: Any, name: str, owner: str) -> None:
    """The labels of ``dataset`` (the ``name`` parameter of ``owner``) are class indices, one per
    example, as a classification loss takes them: integer labels of any width pass (they are cast
    to int64 losslessly when read), float labels, one-hot rows and other shapes are refused with
    one line saying what to pass instead.

    >>> import torch
    >>> ds = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.tensor([0.0, 1.0, 2.0, 1.0]))
    >>> check_class_labels(ds, "train", "Classification")
    Traceback (most recent call last):
    ...
    tridens.evaluators._errors.InvalidParameter: The 'train' data of Classification has float32 labels holding class indices, and a classification loss takes int64 class indices: pass y.long() as the labels (TensorDataset(x, y.long())).
    """
    found = _labels_of(dataset)
    if found is None:
        return
    y, every = found
    where = f"The {name!r} data of {owner} has"
    dtype = str(y.dtype).replace("torch.", "")
    one_hot = (y.dim() == 2 and y.shape[1] > 1 and bool(((y == 0) | (y == 1)).all())
               and bool((y.sum(dim=1) == 1).all()))
    if one_hot:
        raise InvalidParameter(f"{where} one-hot labels ({dtype} rows of {y.shape[1]}), and a classification "
                               "loss takes class indices: pass y.argmax(dim=1) as the labels.")
    if y.dtype == torch.bool or y.is_complex():
        raise InvalidParameter(f"{where} {dtype} labels, and a classification loss takes int64 class indices: "
                               "pass y.long() as the labels.")
    if y.dim() != 1:
        shape = tuple(y.shape) if every else tuple(y.shape[1:])
        raise InvalidParameter(f"{where} labels of shape {shape}{'' if every else ' per example'}, and a "
                               "classification loss takes one class index per example (labels of shape (N,)); "
                               "pass loss= a function of your own for other targets.")
    if y.is_floating_point():
        if bool((y == y.round()).all()) and bool((y >= 0).all()):
            raise InvalidParameter(f"{where} {dtype} labels holding class indices, and a classification loss "
                                   "takes int64 class indices: pass y.long() as the labels (TensorDataset(x, y.long())).")
        raise InvalidParameter(f"{where} {dtype} labels that are not class indices (e.g. {float(y.flatten()[0])!r}), "
                               "and a classification loss takes int64 class indices: use Regression for real-valued "
                               "targets, or pass loss= a function of your own.")


class BatchSource:
    """Batches of ``(input, target)`` from a dataset, on a device, in a given order.

    A dataset exposing ``.tensors`` (``TensorDataset``), or a ``Subset`` of one, is indexed
    directly on the device; anything else goes through a single-process DataLoader that
    collates the same examples in the same order.
    """

    def __init__(self, dataset: Any, device: torch.device):
        self.dataset, self.device = dataset, device
        self.tensors: tuple[torch.Tensor, ...] | None = None
        base, index = dataset, None
        if isinstance(dataset, Subset) and hasattr(dataset.dataset, "tensors"):
            base, index = dataset.dataset, torch.as_tensor(list(dataset.indices), dtype=torch.long)
        tensors = getattr(base, "tensors", None)
        if isinstance(tensors, (tuple, list)) and len(tensors) >= 2 and all(isinstance(t, torch.Tensor) for t in tensors):
            x, y = ((t if index is None else t[index]).to(device) for t in tensors[:2])
            self.tensors = (x, _index_dtype(y))
        # whether reading a batch draws from the global generators: found on the first seeded
        # batch; a dataset that does not is then read without seeding them (a cost on every batch)
        self.random: bool | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def batches(self, order: torch.Tensor | None, batch_size: int,
                seed: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of ``batch_size`` in ``order`` (``None``: as stored). A dataset read through the
        DataLoader reads batch ``b`` with the global generators seeded from ``(seed, b)`` (see
        :func:`_seeded_globals`; ``None``: from the caller's generators as they are), so random
        transforms in its ``__getitem__`` give the same batch to every trial sharing the seed."""
        n = len(self)
        if self.tensors is not None:
            x, y = self.tensors
            if order is None:
                for start in range(0, n, batch_size):
                    yield x[start:start + batch_size], y[start:start + batch_size]
            else:
                for idx in order.to(self.device).split(batch_size):
                    yield x[idx], y[idx]
            return
        indices = order.tolist() if order is not None else list(range(n))
        chunks = [indices[i:i + batch_size] for i in range(0, n, batch_size)]
        # A generator of its own: iterating a DataLoader draws a base seed from it, which would
        # otherwise come from (and advance) the trainer's random stream.
        loader = iter(DataLoader(self.dataset, batch_sampler=chunks, num_workers=0, generator=torch.Generator()))
        for b in range(len(chunks)):
            if seed is None or self.random is False:
                batch = self._next(loader, chunks[b])
            else:
                with _seeded_globals(_epoch_seed(seed, b), check=self.random is None) as drew:
                    batch = self._next(loader, chunks[b])
                self.random = drew[0] if drew else self.random
            x, y = batch[0], batch[1]
            yield _to_device(x, self.device), _index_dtype(y.to(self.device))

    def _next(self, loader: Any, chunk: Sequence[int]) -> Any:
        """The next batch; items that do not batch together (tuples of different lengths or
        shapes) are :class:`InvalidParameter` naming the dataset and the items, in one line."""
        try:
            batch = next(loader)
        except (RuntimeError, TypeError, ValueError) as err:
            frames = []
            tb = err.__traceback__
            while tb is not None:
                frames.append(tb.tb_frame.f_code.co_filename)
                tb = tb.tb_next
            if not frames or "collate" not in frames[-1]:
                raise  # the dataset's own error
            shown = ", ".join(map(str, chunk[:3])) + (", ..." if len(chunk) > 3 else "")
            raise InvalidParameter(
                f"the items [{shown}] of the dataset {type(self.dataset).__name__} do not batch together "
                f"({' '.join(str(err).split())}): every item must be an (input, label) pair of the same structure and "
                "shapes") from None
        if not isinstance(batch, (list, tuple)) or len(batch) < 2:
            raise InvalidParameter(f"the items of the dataset {type(self.dataset).__name__} are not (input, label) "
                                   f"pairs (a batch of them is a {type(batch).__name__})")
        return batch

    def epoch_batches(self, cfg: TrainConfig, seed: int, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The training batches of ``epoch`` for a trial with ``seed``: in the epoch's order, a
        map-style dataset's own randomness drawn from the data seed (before ``cfg.augment``)."""
        return self.batches(cfg.epoch_order(seed, epoch), cfg.batch_size_at(epoch), cfg.loader_seed(seed, epoch))

    def validation_batches(self, cfg: TrainConfig, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The validation batches (as stored, at least 256 examples each) for a trial with ``seed``."""
        return self.batches(None, max(cfg.batch_size, 256), cfg.loader_seed(seed))


class ValidationSums:
    """Validation metrics accumulated batch by batch: the one definition of their arithmetic,
    used by :meth:`SupervisedTrainer.validate` and by drivers that validate many models at once."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.sums = {name: 0.0 for name in cfg.metrics}
        self.n = 0
        self.elements = 0

    def add(self, out: torch.Tensor, y: torch.Tensor) -> None:
        cfg, sums = self.cfg, self.sums
        size = len(y)
        self.n += size
        if "val_loss" in sums:
            sums["val_loss"] += float(cfg.loss_of(out, y).item()) * size
        if "val_acc" in sums:
            sums["val_acc"] += correct_count(out, y)
        if "val_mse" in sums or "val_mae" in sums:
            out = out.float() if out.dtype in (torch.bfloat16, torch.float16) else out
            diff = align_output(out, y) - y.to(out.dtype)
            self.elements += diff.numel()
            if "val_mse" in sums:
                sums["val_mse"] += float((diff * diff).sum().item())
            if "val_mae" in sums:
                sums["val_mae"] += float(diff.abs().sum().item())

    def result(self) -> dict[str, float]:
        return {name: value / (self.elements if name in ("val_mse", "val_mae") else self.n)
                for name, value in self.sums.items()}


class SupervisedTrainer:
    """The step-wise training of one model (see the module docstring for determinism).

    ``epoch`` counts finished epochs and ``step`` optimizer steps; ``optimizer`` and ``config``
    are public for drivers that want to look (the lr of the next step is ``config.lr_at(step)``).
    """

    def __init__(self, config: TrainConfig, model: nn.Module, seed: int, *, owner: str = "Classification"):
        self.config, self.seed, self.owner = config, int(seed), owner
        self.model = model.to(config.device)
        # the memory-format policy: 2-d convolution models channels-last where it says so
        self._channels_last = config.channels_last and any(
            isinstance(m, nn.Conv2d) for m in self.model.modules())
        if self._channels_last:
            # Module.to takes memory_format at run time; torch's overloads for it leave the keyword out
            self.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.optimizer = config.make_optimizer(self.model.parameters())
        self.epoch = 0
        self.step = 0
        self._train = BatchSource(config.train, config.device)
        self._val = BatchSource(config.val, config.device)
        self._cuda = config.device.type == "cuda"
        # float16 gradients underflow without scaling the loss ("16-mixed", CUDA only)
        self.scaler = torch.amp.GradScaler("cuda") if config.precision == "16-mixed" else None
        g = torch.Generator().manual_seed(self.seed)   # the state torch.manual_seed(seed) gives
        self._rng: torch.Tensor = g.get_state()
        self._cuda_rng: torch.Tensor | None = None
        if self._cuda:
            with torch.random.fork_rng(devices=[self._cuda_index()]):
                torch.cuda.manual_seed(self.seed)
                self._cuda_rng = torch.cuda.get_rng_state(self._cuda_index())

    @property
    def epochs(self) -> int:
        return self.config.epochs

    @property
    def done(self) -> bool:
        return self.epoch >= self.config.epochs

    def _cuda_index(self) -> int:
        index = self.config.device.index
        return torch.cuda.current_device() if index is None else index

    @contextlib.contextmanager
    def _random_stream(self) -> Iterator[None]:
        """Run with this trainer's own torch random state; leave the caller's untouched."""
        devices = [self._cuda_index()] if self._cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self._rng)
            if self._cuda and self._cuda_rng is not None:
                torch.cuda.set_rng_state(self._cuda_rng, devices[0])
            try:
                yield
            finally:
                self._rng = torch.get_rng_state()
                if self._cuda:
                    self._cuda_rng = torch.cuda.get_rng_state(devices[0])

    def train_epoch(self) -> dict[str, float]:
        """Train one epoch; return ``{"train_loss": mean training loss over its examples}``.

        Raises :class:`NonFiniteLoss` naming the epoch and batch where the loss became NaN/inf.
        Built from :meth:`begin_epoch`, :meth:`epoch_batches`, :meth:`train_batch` and
        :meth:`end_epoch`, which a driver sharing one data pipeline among trials calls itself.
        """
        self.begin_epoch()
        total, count = 0.0, 0
        for batch, x, y in self.epoch_batches():
            total += self.train_batch(x, y, batch) * len(y)
            count += len(y)
        return self.end_epoch(total / count)

    def begin_epoch(self) -> None:
        """Check there is an epoch left and put the model in training mode."""
        if self.done:
            raise InvalidParameter(f"this {self.owner} trainer already trained its {self.config.epochs} epochs "
                                   f"(the 'epochs' parameter); build a new trainer to train more")
        self.model.train()

    def epoch_batches(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(batch index, augmented input, target)`` of the current epoch, in training order."""
        cfg = self.config
        for batch, (x, y) in enumerate(self._train.epoch_batches(cfg, self.seed, self.epoch)):
            yield batch, cfg.augment(x, self.seed, self.epoch, batch), y

    def train_batch(self, x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
        """One optimizer step on an (already augmented) batch; returns its training loss."""
        cfg = self.config
        lr = cfg.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self._random_stream():
            self.optimizer.zero_grad(set_to_none=True)
            with cfg.autocast():
                out = self.model(self._laid_out(x))
            loss = cfg.loss_of(out, y)
            value = float(loss.item())
            if not math.isfinite(value):
                raise NonFiniteLoss.at(self.owner, value, epoch=self.epoch, batch=batch, step=self.step, lr=lr)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                self.optimizer.step()
        self.step += 1
        return value

    def _laid_out(self, x: Any) -> Any:
        """A 4-d input channels-last where the trainer runs so (``memory_format``)."""
        if self._channels_last and isinstance(x, torch.Tensor) and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def end_epoch(self, train_loss: float) -> dict[str, float]:
        """Count the epoch as done; returns ``{"train_loss": train_loss}``."""
        self.epoch += 1
        return {"train_loss": train_loss}

    def validate(self) -> dict[str, float]:
        """Score the model on the validation set: ``val_acc``/``val_loss`` or ``val_mse``/``val_mae``."""
        return self.validation_sums().result()

    @torch.no_grad()
    def validation_sums(self, rank: int = 0, world: int = 1) -> ValidationSums:
        """The validation sums of batches ``rank``, ``rank + world``, ... (all of them by default;
        data-parallel ranks each score their share and all-reduce the sums)."""
        cfg = self.config
        was_training = self.model.training
        self.model.eval()
        sums = ValidationSums(cfg)
        try:
            batches = self._val.validation_batches(cfg, self.seed)
            with self._random_stream():
                for i, (x, y) in enumerate(batches):
                    if i % world == rank:
                        with cfg.autocast():
                            out = self.model(self._laid_out(x))
                        sums.add(out, y)
        finally:
            self.model.train(was_training)
        return sums

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint (a copy, safe to keep while training goes on; ``torch.save`` writes it).

        Holds the model and optimizer states, ``epoch``, ``step`` (which fixes the lr schedule's
        position), ``seed`` and the trainer's random state.
        """
        state: dict[str, Any] = {
            "format": CHECKPOINT_FORMAT,
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "rng": self._rng.clone(),
        }
        if self._cuda_rng is not None:
            state["cuda_rng"] = self._cuda_rng.clone()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint made by a trainer of the same evaluator, sample and seed."""
        if state.get("format") != CHECKPOINT_FORMAT:
            raise InvalidParameter(f"not a {self.owner} trainer checkpoint (format {state.get('format')!r}, "
                                   f"expected {CHECKPOINT_FORMAT})")
        if int(state["seed"]) != self.seed:
            raise InvalidParameter(f"the checkpoint was made with seed {state['seed']}, but this trainer has "
                                   f"seed {self.seed}; resume with the trial's own seed")
        self.model.load_state_dict(state["model"])
        # The checkpoint brings the optimizer's moments; its hyperparameters (momentum, weight
        # decay, betas) stay this trainer's config's, so a fork may train on with other ones (PBT).
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, own in zip(self.optimizer.param_groups, settings):
            group.update(own)
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._rng = state["rng"].clone().cpu()
        if self._cuda and "cuda_rng" in state:
            self._cuda_rng = state["cuda_rng"].clone().cpu()
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def __repr__(self) -> str:
        return f"SupervisedTrainer({self.owner}, epoch={self.epoch}/{self.epochs}, step={self.step}, seed={self.seed})"
