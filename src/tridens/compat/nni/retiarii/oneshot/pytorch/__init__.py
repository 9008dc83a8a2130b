"""NNI 2.x's legacy one-shot trainers (``nni.retiarii.oneshot.pytorch``) on ``tridens.oneshot``.

``DartsTrainer(model, loss, metrics, optimizer, num_epochs, dataset, ...)``, ``EnasTrainer`` and
``SinglePathTrainer`` keep NNI's constructor, ``fit()`` and ``export()``; underneath, ``fit()`` runs a
``td.Experiment`` with ``td.oneshot.DARTS`` / ``ENAS`` / ``RandomOneShot`` and a
``td.evaluators.Classification`` built from the arguments (stored in ``$TRIDENS_DB`` or
``tridens.db``, so ``tridens ls / top / export`` show it). What changes:

* ``model`` is a space (``@model_wrapper``, a ``tridens.nn.ModelSpace``, or a plain module built
  from ``nni.retiarii.nn.pytorch``'s ``nn.Module``, rebuilt as a space from its arguments); tridens
  builds the supernet from it. ``optimizer`` gives the optimizer's kind and settings (lr, momentum, weight
  decay); tridens makes its own for the supernet's parameters.
* ``metrics`` is not called: tridens reports ``val_acc`` and ``val_loss`` (classification).
* ``export()`` is DARTS' argmax / ENAS' greedy controller choice (as NNI), and for SPOS the best of
  the subnets scored on ``dataset_valid`` with the supernet's weights (NNI: a random sample).
* ``workers`` and ``log_frequency`` are ignored; ``grad_clip`` clips the weights' gradient norm
  (``td.oneshot.*(grad_clip=)``; 0 or None: no clipping).
``ProxylessTrainer`` raises, naming the alternatives.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

import tridens as td
from tridens import oneshot as _os

from ...._common import NotSupported, only_default, refuse
from ...._oneshot import Proxyless
from ....nas.experiment import unique_name
from ... import as_space

__all__ = ["DartsTrainer", "EnasTrainer", "SinglePathTrainer", "RandomTrainer", "ProxylessTrainer"]

log = logging.getLogger("tridens")

_OPTIMIZERS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw", torch.optim.RMSprop: "rmsprop"}


def _optimizer_settings(owner: str, optimizer: Any) -> dict[str, Any]:
    """The kind and hyperparameters of an optimizer instance (its first parameter group)."""
    kind = _OPTIMIZERS.get(type(optimizer))
    if kind is None:
        raise NotSupported(f"The 'optimizer' parameter of {owner} must be a torch.optim.SGD, Adam, AdamW or RMSprop "
                           f"instance (tridens rebuilds it by kind for the supernet). Got {type(optimizer).__name__} instead.")
    group = optimizer.param_groups[0]
    momentum = group.get("momentum") if kind in ("sgd", "rmsprop") else group.get("betas", (0.9, 0.999))[0]
    return {"optimizer": kind, "lr": float(group["lr"]), "momentum": float(momentum),
            "weight_decay": float(group.get("weight_decay", 0.0))}


def _device(device: Any) -> Any:
    return "auto" if device is None else str(device)


def _grad_clip(owner: str, value: Any) -> float | None:
    """NNI's ``grad_clip`` (the norm the weights' gradient is clipped to; 0 or None: none) for ``td.oneshot``."""
    if value is None or value == 0:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise NotSupported(f"The 'grad_clip' parameter of {owner} must be a number >= 0. Got {value!r} instead.")
    return float(value)


class _Trainer:
    """``fit()`` runs the one-shot experiment; ``export()`` gives the chosen architecture."""

    _kind = "?"

    def _run(self, model: Any, evaluator: td.evaluators.Classification, strategy: Any) -> None:
        model = as_space(type(self).__name__, model)
        self.model = model
        self.experiment = td.Experiment(model, evaluator, strategy, name=unique_name(f"nni-{self._kind}"))
        self.experiment.run()

    def fit(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _supernet_info(self) -> dict[str, Any]:
        if self.experiment is None:
            raise td.TridensError(f"{type(self).__name__}.export() needs fit() first")
        supernet = next(t for t in self.experiment.trials() if t.info.get("oneshot", {}).get("role") == "supernet")
        return supernet.info["oneshot"]

    def export(self) -> dict[str, Any]:
        """The best architecture (the sample: label -> index, key or value)."""
        if self.experiment is None:
            raise td.TridensError(f"{type(self).__name__}.export() needs fit() first")
        return self.model.restrict(self.experiment.best().sample)


class DartsTrainer(_Trainer):
    """``DartsTrainer(model, loss, metrics, optimizer, num_epochs, dataset, grad_clip=5.0,
    learning_rate=2.5e-3, batch_size=64, workers=4, device=None, log_frequency=None,
    arc_learning_rate=3e-4, unrolled=False)``: ``dataset`` is split in halves for the weights and the
    architecture (``td.oneshot.DARTS(arch_fraction=0.5)``, as NNI); ``unrolled`` is ``second_order``.
    ``learning_rate`` is not used (the weights' lr is the optimizer's)."""

    _kind = "darts"

    def __init__(self, model: Any, loss: Any, metrics: Any, optimizer: Any, num_epochs: int, dataset: Any,
                 grad_clip: float = 5.0, learning_rate: float = 2.5e-3, batch_size: int = 64, workers: int = 4,
                 device: Any = None, log_frequency: int | None = None, arc_learning_rate: float = 3.0e-4,
                 unrolled: bool = False) -> None:
        self.model, self.loss, self.metrics, self.optimizer = model, loss, metrics, optimizer
        self.num_epochs, self.dataset, self.grad_clip, self.batch_size = num_epochs, dataset, grad_clip, batch_size
        self.device, self.arc_learning_rate, self.unrolled = device, arc_learning_rate, unrolled
        self.experiment: td.Experiment | None = None

    def fit(self) -> None:
        """Train the supernet; the architecture weights' argmax is scored (on ``dataset``) and stored."""
        evaluator = td.evaluators.Classification(self.dataset, self.dataset, epochs=self.num_epochs,
                                                 batch_size=self.batch_size, loss=self.loss, device=_device(self.device),
                                                 **_optimizer_settings("DartsTrainer", self.optimizer))
        self._run(self.model, evaluator, _os.DARTS(arch_lr=self.arc_learning_rate, second_order=self.unrolled, samples=1,
                                                            warmup=0.0, grad_clip=_grad_clip("DartsTrainer", self.grad_clip)))

    def export(self) -> dict[str, Any]:
        """DARTS' choice: the most probable candidate of every label."""
        return dict(self._supernet_info()["argmax"])


class EnasTrainer(_Trainer):
    """``EnasTrainer(model, loss, metrics, reward_function, optimizer, num_epochs, dataset, ...)``:
    ``ctrl_lr`` is ``controller_lr``; ``entropy_weight`` and ``baseline_decay`` are the same;
    ``ctrl_steps_aggregate`` steps make one controller update. The reward is the sampled path's
    accuracy on a held-out share of ``dataset`` (``reward_function`` is not called)."""

    _kind = "enas"

    def __init__(self, model: Any, loss: Any, metrics: Any, reward_function: Any, optimizer: Any, num_epochs: int,
                 dataset: Any, batch_size: int = 64, workers: int = 4, device: Any = None,
                 log_frequency: int | None = None, grad_clip: float = 5.0, entropy_weight: float = 1e-4,
                 skip_weight: float = 0.8, baseline_decay: float = 0.999, ctrl_lr: float = 3.5e-4,
                 ctrl_steps_aggregate: int = 20, ctrl_kwargs: dict | None = None) -> None:
        self.model, self.loss, self.metrics, self.optimizer = model, loss, metrics, optimizer
        self.reward_function, self.num_epochs, self.dataset, self.batch_size = reward_function, num_epochs, dataset, batch_size
        self.device, self.grad_clip, self.entropy_weight, self.skip_weight = device, grad_clip, entropy_weight, skip_weight
        self.baseline_decay, self.ctrl_lr, self.ctrl_steps_aggregate = baseline_decay, ctrl_lr, ctrl_steps_aggregate
        self.ctrl_kwargs = ctrl_kwargs
        self.experiment: td.Experiment | None = None

    def fit(self) -> None:
        """Train the supernet and its controller; the controller's greedy choice is scored and stored."""
        only_default("EnasTrainer", "skip_weight", self.skip_weight, 0.8,
                     "tridens' controller has no skip-connection penalty (entropy_weight= is its regularizer).")
        hidden = 32
        for key, value in (self.ctrl_kwargs or {}).items():
            if key != "lstm_size":
                raise refuse("EnasTrainer", f"ctrl_kwargs[{key!r}]", value,
                             "tridens' controller is one LSTM cell; ctrl_kwargs may only set 'lstm_size'.")
            hidden = value
        if self.reward_function is not None:
            log.info("EnasTrainer: the controller's reward is the sampled path's accuracy (reward_function is not called)")
        evaluator = td.evaluators.Classification(self.dataset, self.dataset, epochs=self.num_epochs,
                                                 batch_size=self.batch_size, loss=self.loss, device=_device(self.device),
                                                 **_optimizer_settings("EnasTrainer", self.optimizer))
        n = int(self.ctrl_steps_aggregate)
        self._run(self.model, evaluator, _os.ENAS(controller_lr=self.ctrl_lr, controller_hidden=hidden,
                                                  entropy_weight=self.entropy_weight, baseline_decay=self.baseline_decay,
                                                  controller_every=n, controller_samples=n, samples=1,
                                                  grad_clip=_grad_clip("EnasTrainer", self.grad_clip)))

    def export(self) -> dict[str, Any]:
        """The controller's greedy architecture."""
        return dict(self._supernet_info()["greedy"])


class SinglePathTrainer(_Trainer):
    """``SinglePathTrainer(model, loss, metrics, optimizer, num_epochs, dataset_train, dataset_valid,
    batch_size=64, workers=4, device=None, log_frequency=None)`` -> ``td.oneshot.RandomOneShot``
    (SPOS); ``export()`` is the best of the subnets scored on ``dataset_valid``."""

    _kind = "spos"

    def __init__(self, model: Any, loss: Any, metrics: Any, optimizer: Any, num_epochs: int, dataset_train: Any,
                 dataset_valid: Any, batch_size: int = 64, workers: int = 4, device: Any = None,
                 log_frequency: int | None = None) -> None:
        self.model, self.loss, self.metrics, self.optimizer = model, loss, metrics, optimizer
        self.num_epochs, self.dataset_train, self.dataset_valid = num_epochs, dataset_train, dataset_valid
        self.batch_size, self.device = batch_size, device
        self.experiment: td.Experiment | None = None

    def fit(self) -> None:
        """Train the supernet one random path per step, then score subnets with its weights."""
        evaluator = td.evaluators.Classification(self.dataset_train, self.dataset_valid, epochs=self.num_epochs,
                                                 batch_size=self.batch_size, loss=self.loss, device=_device(self.device),
                                                 **_optimizer_settings("SinglePathTrainer", self.optimizer))
        self._run(self.model, evaluator, _os.RandomOneShot())


RandomTrainer = SinglePathTrainer


class ProxylessTrainer:
    """Not provided by tridens: constructing it raises, naming the alternatives."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        Proxyless()
