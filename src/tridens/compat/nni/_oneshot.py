"""NNI's one-shot strategies on :mod:`tridens.oneshot`, with NNI's argument names.

``nni.nas.strategy`` (NNI 3.x) and ``nni.retiarii.strategy`` (NNI 2.8-2.10) both export
``DARTS``, ``GumbelDARTS``, ``ENAS``, ``RandomOneShot`` and ``Proxyless``; the two versions name
some arguments differently, so each has its factory here. Each returns the tridens strategy, so
``td.Experiment`` and ``NasExperiment`` run it like any other. tridens options (``samples``,
``retrain``, ``epochs``, ``second_order``...) may be passed too.

What differs from NNI, by design: the architecture steps of DARTS/GumbelDARTS/ENAS use a held-out
share of the *training* set (``arch_fraction``), and the validation set scores the subnets.
DARTS and GumbelDARTS export their argmax, as NNI's do: it is the one subnet scored (``samples=1``;
``samples=k`` searches ``k`` subnets with the supernet's weights, the argmax first). ENAS and
RandomOneShot score ``samples`` subnets (tridens' default 64) and export the best, where NNI
exports one sampled path; ``export_top_models(k)`` then ranks ``k`` of them.
"""

from __future__ import annotations

from typing import Any

from tridens import oneshot as _os

from ._common import NotSupported, only_default, refuse, tridens_kwargs

__all__ = ["DARTS", "GumbelDARTS", "ENAS", "RandomOneShot", "Proxyless",
           "DARTS_v2", "GumbelDARTS_v2", "ENAS_v2", "RandomOneShot_v2", "Proxyless_v2"]

_HOOKS = ("tridens builds the supernet from the space itself: LayerChoice/InputChoice/Repeat, and an int "
          "choice in a Conv/Linear/BatchNorm constructor argument (sliced from the largest weight); a space it "
          "cannot make one-shot is refused with the label named, and td.strategy.* searches it multi-trial.")
_CLIP = "tridens' ENAS controller does not clip its gradient; lower ctrl_lr (controller_lr) instead."
_WARMUP = ("tridens' ENAS updates its controller from the first step; to pre-train the shared weights, "
           "run RandomOneShot first or give more epochs (epochs= on the strategy).")
_PENALTY = ("tridens' one-shot search has no cost penalty; search with a multi-trial strategy and "
            "td.Experiment(..., options=td.RunOptions(constraints=[td.strategy.Constraint('params', max=...)])) instead.")
_FILTER = ("tridens' RandomOneShot samples every path uniformly; bound model size with a multi-trial strategy "
           "and td.Experiment(..., options=td.RunOptions(constraints=[td.strategy.Constraint('params', max=...)])) instead.")
_DARTS_NAMES = ("arc_learning_rate", "gradient_clip_val", "log_prob_every_n_step", "warmup_epochs", "penalty",
                "mutation_hooks")


class _EpochWarmup:
    """NNI's ``warmup_epochs``: the first ``k`` epochs of the supernet train the weights only.
    tridens' DARTS counts its warm-up as a share of the steps (``warmup``); the epochs are known
    when training starts, so the steps are counted then."""

    _warmup_epochs = 0
    total_steps: int
    steps_per_epoch: int

    def warmup_steps(self) -> int:
        return min(self.total_steps, self._warmup_epochs * self.steps_per_epoch)


# Named as the tridens strategies they extend (the experiment records the strategy by class name).
_WarmupDARTS = type("DARTS", (_EpochWarmup, _os.DARTS), {"__module__": __name__, "__qualname__": "_WarmupDARTS"})
_WarmupGumbelDARTS = type("GumbelDARTS", (_EpochWarmup, _os.GumbelDARTS),
                          {"__module__": __name__, "__qualname__": "_WarmupGumbelDARTS"})


def _darts(owner: str, arc_learning_rate: float, gradient_clip_val: Any, warmup_epochs: Any, penalty: Any,
           mutation_hooks: Any, kwargs: dict[str, Any], target: type, extra_names: tuple[str, ...] = (),
           **defaults: Any) -> Any:
    """The tridens DARTS/GumbelDARTS for NNI's arguments (``defaults``: mapped NNI values that an
    explicit tridens option overrides)."""
    if gradient_clip_val is not None and (isinstance(gradient_clip_val, bool) or
                                          not isinstance(gradient_clip_val, (int, float)) or gradient_clip_val < 0):
        raise NotSupported(f"The 'gradient_clip_val' parameter of {owner} must be None or a number >= 0. "
                           f"Got {gradient_clip_val!r} instead.")
    if gradient_clip_val:  # NNI clips the weights' gradient norm before each weight step
        defaults = {"grad_clip": float(gradient_clip_val), **defaults}
    only_default(owner, "penalty", penalty, None, _PENALTY)
    only_default(owner, "mutation_hooks", mutation_hooks, None, _HOOKS)
    if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, int) or warmup_epochs < 0:
        raise NotSupported(f"The 'warmup_epochs' parameter of {owner} must be an int >= 0. Got {warmup_epochs!r} instead.")
    kw = tridens_kwargs(owner, target, kwargs, _DARTS_NAMES + extra_names, f"td.oneshot.{target.__name__}")
    # NNI's DARTS exports the argmax of alpha without scoring other subnets: the argmax alone is scored
    kw = {"arch_lr": arc_learning_rate, "samples": 1, **defaults, **kw}
    if "warmup" in kw or warmup_epochs == 0:
        kw.setdefault("warmup", 0.0)  # NNI's default: architecture steps from the first step (tridens': half the steps)
        return target(**kw)
    strategy = (_WarmupDARTS if target is _os.DARTS else _WarmupGumbelDARTS)(warmup=0.0, **kw)
    strategy._warmup_epochs = warmup_epochs
    return strategy


# -- NNI 3.x: nni.nas.strategy ---------------------------------------------------------------------
def DARTS(*, arc_learning_rate: float = 3.0e-4, gradient_clip_val: float | None = None, log_prob_every_n_step: int = 10,
          warmup_epochs: int = 0, penalty: Any = None, mutation_hooks: Any = None, **kwargs: Any) -> _os.DARTS:
    """``nni.nas.strategy.DARTS`` -> ``td.oneshot.DARTS(arch_lr=arc_learning_rate, samples=1)`` (first
    order, as NNI; ``second_order=True`` is tridens' unrolled gradient). The export is the argmax, as
    NNI's, scored with the supernet's weights (``samples=k``: a search of ``k`` subnets, the argmax
    first, exports the best of them). ``warmup_epochs`` epochs train the
    weights only (NNI's default 0: tridens' ``warmup=0``; pass ``warmup=0.5`` for tridens' own
    default). ``log_prob_every_n_step`` is ignored: the learned probabilities are stored in the
    supernet trial's ``info["oneshot"]``.

    >>> strategy = DARTS(arc_learning_rate=3e-3)      # doctest: +SKIP
    """
    return _darts("DARTS", arc_learning_rate, gradient_clip_val, warmup_epochs, penalty, mutation_hooks, kwargs, _os.DARTS)


def _temperature(owner: str, value: Any) -> tuple[float, float]:
    """NNI's ``temperature``: a float (fixed), ``(init, min)``, ``{"init":, "min":}`` or a scheduler
    object with ``init`` and ``min`` attributes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), float(value)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return float(value[0]), float(value[1])
    if isinstance(value, dict) and "init" in value and "min" in value:
        return float(value["init"]), float(value["min"])
    if hasattr(value, "init") and hasattr(value, "min"):
        return float(value.init), float(value.min)
    raise NotSupported(f"The 'temperature' parameter of {owner} must be a float, a pair (init, min) or a dict "
                       f"{{'init': ..., 'min': ...}}. Got {value!r} instead.")


def GumbelDARTS(*, temperature: Any = (1.0, 0.33), arc_learning_rate: float = 3.0e-4,
                gradient_clip_val: float | None = None, log_prob_every_n_step: int = 10, warmup_epochs: int = 0,
                penalty: Any = None, mutation_hooks: Any = None, **kwargs: Any) -> _os.GumbelDARTS:
    """``nni.nas.strategy.GumbelDARTS`` -> ``td.oneshot.GumbelDARTS(tau_max=init, tau_min=min, samples=1)``:
    the argmax exported, as DARTS. NNI anneals the temperature linearly per epoch, tridens
    exponentially per step (same ends).

    >>> strategy = GumbelDARTS(temperature=(1.0, 0.33))     # doctest: +SKIP
    """
    tau_max, tau_min = _temperature("GumbelDARTS", temperature)
    return _darts("GumbelDARTS", arc_learning_rate, gradient_clip_val, warmup_epochs, penalty, mutation_hooks, kwargs,
                  _os.GumbelDARTS, ("temperature",), tau_max=tau_max, tau_min=tau_min)


def _controller_every(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or value != int(value):
        raise NotSupported(f"The {name!r} parameter of {owner} must be a whole number >= 1. Got {value!r} instead.")
    return int(value)


# NNI's metric names (as its Classification/Regression evaluators log them) -> tridens' reward_metric
_REWARD_METRICS = {"default": None, "acc": "val_acc", "val_acc": "val_acc", "accuracy": "val_acc", "loss": "val_loss",
                   "val_loss": "val_loss", "mse": "val_mse", "val_mse": "val_mse", "mae": "val_mae", "val_mae": "val_mae"}


def _reward(owner: str, reward_metric_name: Any) -> str | None:
    """``reward_metric_name`` as ``td.oneshot.ENAS(reward_metric=)``: the metric scored on the held-out
    batch (a loss or an error negated); ``None`` / ``"default"``: the evaluator's objective."""
    if reward_metric_name is None:
        return None
    if reward_metric_name not in _REWARD_METRICS:
        raise NotSupported(f"The 'reward_metric_name' parameter of {owner} must name a validation metric of the "
                           f"evaluator, one of {sorted(_REWARD_METRICS)}. Got {reward_metric_name!r} instead.")
    return _REWARD_METRICS[reward_metric_name]


def ENAS(*, batches_per_update: float = 20, log_prob_every_n_step: int = 10, replay_buffer_size: int | None = None,
         reward_metric_name: str | None = None, policy_fn: Any = None, update_kwargs: dict | None = None,
         warmup_epochs: int = 0, penalty: Any = None, filter: Any = None, mutation_hooks: Any = None,
         **kwargs: Any) -> _os.ENAS:
    """``nni.nas.strategy.ENAS`` -> ``td.oneshot.ENAS``. NNI's controller collects ``batches_per_update``
    rewarded samples, then updates (PPO); tridens' does the same with REINFORCE:
    ``controller_every = controller_samples = batches_per_update``. ``policy_fn``,
    ``update_kwargs`` and ``replay_buffer_size`` configure PPO and have no tridens meaning; the
    controller is tuned with ``controller_lr``, ``controller_hidden``, ``entropy_weight``,
    ``baseline_decay`` instead. ``reward_metric_name`` (``"val_acc"``, ``"val_loss"``, ``"val_mse"``,
    ``"val_mae"``; ``"default"``: the evaluator's objective) is ``reward_metric``, scored on a held-out
    training batch; a loss or an error is negated, so the controller prefers low ones.

    >>> strategy = ENAS(batches_per_update=10)      # doctest: +SKIP
    """
    owner = "ENAS"
    ppo = ("tridens' ENAS trains its LSTM controller by REINFORCE with a moving-average baseline; tune it with "
           "controller_lr=, controller_hidden=, entropy_weight=, baseline_decay= instead.")
    only_default(owner, "policy_fn", policy_fn, None, ppo)
    only_default(owner, "update_kwargs", update_kwargs, None, ppo)
    only_default(owner, "replay_buffer_size", replay_buffer_size, None, ppo)
    only_default(owner, "warmup_epochs", warmup_epochs, 0, _WARMUP)
    only_default(owner, "penalty", penalty, None, _PENALTY)
    only_default(owner, "filter", filter, None, "NNI's ENAS refuses a filter too.")
    only_default(owner, "mutation_hooks", mutation_hooks, None, _HOOKS)
    reward = _reward(owner, reward_metric_name)
    n = _controller_every(owner, "batches_per_update", batches_per_update)
    kw = tridens_kwargs(owner, _os.ENAS, kwargs, ("batches_per_update", "log_prob_every_n_step", "replay_buffer_size",
                        "reward_metric_name", "policy_fn", "update_kwargs", "warmup_epochs", "penalty", "filter",
                        "mutation_hooks"), "td.oneshot.ENAS")
    kw.setdefault("controller_every", n)
    kw.setdefault("controller_samples", n)
    kw.setdefault("reward_metric", reward)
    return _os.ENAS(**kw)


def RandomOneShot(filter: Any = None, mutation_hooks: Any = None, **kwargs: Any) -> _os.RandomOneShot:
    """``nni.nas.strategy.RandomOneShot`` -> ``td.oneshot.RandomOneShot`` (SPOS: a uniformly random
    path per step). Unlike NNI, whose export is a random sample, the result is the best of
    ``samples`` subnets scored with the supernet's weights (``fair=True``: FairNAS sampling).

    >>> strategy = RandomOneShot(samples=32)      # doctest: +SKIP
    """
    only_default("RandomOneShot", "filter", filter, None, _FILTER)
    only_default("RandomOneShot", "mutation_hooks", mutation_hooks, None, _HOOKS)
    return _os.RandomOneShot(**tridens_kwargs("RandomOneShot", _os.RandomOneShot, kwargs, ("filter", "mutation_hooks"),
                                              "td.oneshot.RandomOneShot"))


def Proxyless(**kwargs: Any) -> Any:
    """``Proxyless`` is not provided by tridens: this raises, suggesting the alternatives."""
    raise NotSupported("Proxyless (ProxylessNAS' binary gates, trained with a hardware-latency loss) is not provided "
                       "by tridens. Use DARTS (softmax-mixed candidates) or GumbelDARTS (sampled, nearly one-hot "
                       "paths, the closest in memory and behaviour), i.e. td.oneshot.DARTS / td.oneshot.GumbelDARTS; "
                       "for a size bound, a multi-trial strategy with td.strategy.Constraint('params', max=...).")


# -- NNI 2.8-2.10: nni.retiarii.strategy -------------------------------------------------------------
def DARTS_v2(*, arc_learning_rate: float = 3.0e-4, gradient_clip_val: float | None = None,
             log_prob_every_n_step: int = 10, warmup_epochs: int = 0, penalty: Any = None,
             mutation_hooks: Any = None, **kwargs: Any) -> _os.DARTS:
    """``nni.retiarii.strategy.DARTS``: the same arguments as NNI 3's."""
    return DARTS(arc_learning_rate=arc_learning_rate, gradient_clip_val=gradient_clip_val,
                 log_prob_every_n_step=log_prob_every_n_step, warmup_epochs=warmup_epochs, penalty=penalty,
                 mutation_hooks=mutation_hooks, **kwargs)


def GumbelDARTS_v2(*, gumbel_temperature: float = 1.0, use_temp_anneal: bool = False, min_temp: float = 0.33,
                   arc_learning_rate: float = 3.0e-4, gradient_clip_val: float | None = None,
                   log_prob_every_n_step: int = 10, warmup_epochs: int = 0, penalty: Any = None,
                   mutation_hooks: Any = None, **kwargs: Any) -> _os.GumbelDARTS:
    """``nni.retiarii.strategy.GumbelDARTS``: a fixed ``gumbel_temperature``, or annealed to
    ``min_temp`` with ``use_temp_anneal=True``."""
    temperature = (gumbel_temperature, min_temp) if use_temp_anneal else gumbel_temperature
    return GumbelDARTS(temperature=temperature, arc_learning_rate=arc_learning_rate,
                       gradient_clip_val=gradient_clip_val, log_prob_every_n_step=log_prob_every_n_step,
                       warmup_epochs=warmup_epochs, penalty=penalty, mutation_hooks=mutation_hooks, **kwargs)


def ENAS_v2(*, ctrl_kwargs: dict | None = None, entropy_weight: float = 1e-4, skip_weight: float = 0.8,
            baseline_decay: float = 0.999, ctrl_steps_aggregate: float = 20, ctrl_grad_clip: float = 0,
            log_prob_every_n_step: int = 10, warmup_epochs: int = 0, reward_metric_name: str | None = None,
            mutation_hooks: Any = None, **kwargs: Any) -> _os.ENAS:
    """``nni.retiarii.strategy.ENAS`` -> ``td.oneshot.ENAS``: ``entropy_weight`` and ``baseline_decay``
    are the same; ``ctrl_steps_aggregate`` steps are aggregated into one controller update
    (``controller_every = controller_samples``); ``ctrl_kwargs={"lstm_size": n}`` is ``controller_hidden``."""
    owner = "ENAS"
    only_default(owner, "skip_weight", skip_weight, 0.8,
                 "tridens' controller has no skip-connection penalty (entropy_weight= is its regularizer).")
    only_default(owner, "ctrl_grad_clip", ctrl_grad_clip, 0, _CLIP)
    only_default(owner, "warmup_epochs", warmup_epochs, 0, _WARMUP)
    only_default(owner, "mutation_hooks", mutation_hooks, None, _HOOKS)
    reward = _reward(owner, reward_metric_name)
    n = _controller_every(owner, "ctrl_steps_aggregate", ctrl_steps_aggregate)
    kw = tridens_kwargs(owner, _os.ENAS, kwargs, ("ctrl_kwargs", "entropy_weight", "skip_weight", "baseline_decay",
                        "ctrl_steps_aggregate", "ctrl_grad_clip", "log_prob_every_n_step", "warmup_epochs",
                        "reward_metric_name", "mutation_hooks"), "td.oneshot.ENAS")
    for key, value in (ctrl_kwargs or {}).items():
        if key == "lstm_size":
            kw.setdefault("controller_hidden", value)
        else:
            raise refuse(owner, f"ctrl_kwargs[{key!r}]", value,
                         "tridens' controller is one LSTM cell; ctrl_kwargs may only set 'lstm_size' (controller_hidden).")
    kw.setdefault("entropy_weight", entropy_weight)
    kw.setdefault("baseline_decay", baseline_decay)
    kw.setdefault("controller_every", n)
    kw.setdefault("controller_samples", n)
    kw.setdefault("reward_metric", reward)
    return _os.ENAS(**kw)


def RandomOneShot_v2(mutation_hooks: Any = None, **kwargs: Any) -> _os.RandomOneShot:
    """``nni.retiarii.strategy.RandomOneShot``."""
    return RandomOneShot(mutation_hooks=mutation_hooks, **kwargs)


Proxyless_v2 = Proxyless
