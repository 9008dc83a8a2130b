"""``nni.retiarii.experiment.pytorch``: ``RetiariiExperiment`` and ``RetiariiExeConfig`` on tridens.

``RetiariiExperiment(base_model, evaluator, applied_mutators, strategy)`` runs like NNI 3's
``NasExperiment`` (a ``td.Experiment`` underneath, in this process): a multi-trial strategy trains
a trial per sample, a one-shot one (``DARTS``, ``ENAS``...) one supernet, whatever
``execution_engine`` says. ``applied_mutators`` (``nni.retiarii.Mutator`` or ``td.Mutator``
instances) make the space ``td.ModelSpace.from_base(base_model, applied_mutators, example_inputs)``,
its example inputs of NNI's ``exp_config.dummy_input`` shape, else two examples of the evaluator's
training data.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import tridens as td
from tridens.space import Mutator as _TdMutator
from tridens.trial import TrialStatus

from ..._common import NotSupported
from ...nas.experiment import NasExperiment, _Config

__all__ = ["RetiariiExperiment", "RetiariiExeConfig", "debug_mutated_model"]


class RetiariiExeConfig(_Config):
    """``RetiariiExeConfig("local")``: the NNI configuration attributes (``max_trial_number``,
    ``max_experiment_duration``, ``trial_concurrency``, ``execution_engine``...) are stored; the
    training service and execution engine are tridens' own (``td.Experiment(executor=...)``)."""

    def __init__(self, training_service_platform: str | None = None, execution_engine: str = "py", **kwargs: Any) -> None:
        super().__init__()
        self.training_service_platform = training_service_platform
        self.execution_engine = execution_engine
        for key, value in kwargs.items():
            setattr(self, key, value)


class RetiariiExperiment(NasExperiment):
    """``RetiariiExperiment(base_model, evaluator, applied_mutators=None, strategy=None)``; then
    ``exp.run(config)`` and ``exp.export_top_models(...)``.

    >>> exp = RetiariiExperiment(Net(), evaluator, [], strategy.DARTS())     # doctest: +SKIP
    >>> exp.run(RetiariiExeConfig("local"))                                   # doctest: +SKIP
    """

    def __init__(self, base_model: Any, evaluator: Any = None, applied_mutators: Any = None, strategy: Any = None,
                 trainer: Any = None) -> None:
        mutators = list(applied_mutators or [])
        for mutator in mutators:
            if not isinstance(mutator, _TdMutator):
                raise NotSupported(f"The 'applied_mutators' parameter of RetiariiExperiment must hold nni.retiarii.Mutator "
                                   f"(or td.Mutator) instances. Got {type(mutator).__name__} instead.")
        if trainer is not None:
            raise NotSupported("The 'trainer' parameter of RetiariiExperiment (NNI < 2.0) is not supported: pass the "
                               "evaluator (Classification / FunctionalEvaluator) instead, or call a one-shot trainer's "
                               "fit() directly.")
        from .. import as_space

        self._mutators = mutators
        self._engine = "py"  # the execution_engine of the last run's configuration
        base = _base_of(base_model) if mutators else as_space("RetiariiExperiment", base_model)
        super().__init__(base, evaluator, strategy, config=RetiariiExeConfig())
        self._base = base

    def run(self, config: Any = None, port: int = 8080, debug: bool = False) -> bool:  # type: ignore[override]
        if self._mutators:  # the example inputs may come from the configuration given here
            inputs = _example_inputs(config if config is not None else self.config, self.evaluator)
            self.model_space = td.ModelSpace.from_base(self._base, self._mutators, example_inputs=inputs)
        self._engine = getattr(config if config is not None else self.config, "execution_engine", "py")
        return super().run(config, port=port, debug=debug)

    def _formatted(self, trials: list[Any], formatter: str | None) -> list[Any]:
        """As NNI 2.x: with ``execution_engine='base'`` (its graph engine) a ``LayerChoice``'s value in a
        ``"dict"`` export is the candidate's name, ``layerchoice_{label}_{index or key}``
        (``fixed_arch`` reads it back)."""
        out = super()._formatted(trials, formatter)
        if formatter != "dict" or self._engine != "base":
            return out
        layer_choices = {label for label, spec in self.model_space.search_space().items() if spec.source == "layer_choice"}
        return [{k: (f"layerchoice_{k}_{v}" if k in layer_choices else v) for k, v in sample.items()} for sample in out]

    def export_top_models(self, top_k: int = 1, optimize_mode: str | None = None,  # type: ignore[override]
                          formatter: str = "dict") -> list[Any]:
        """The ``top_k`` best models, best first (``optimize_mode`` says which way the metric is
        better, as in NNI 2.x; by default the run's objective decides: the evaluator's, or the
        strategy's ``optimize_mode``)."""
        if optimize_mode not in (None, "maximize", "minimize"):
            raise NotSupported(f"The 'optimize_mode' parameter of export_top_models must be 'maximize' or 'minimize'. "
                               f"Got {optimize_mode!r} instead.")
        exp = self.experiment
        self._check_formatter(formatter)
        run_mode = exp._objective().mode
        mode = run_mode if optimize_mode is None else ("max" if optimize_mode == "maximize" else "min")
        if mode == run_mode:
            return super().export_top_models(top_k, formatter=formatter)
        # The reported value is better the other way than the run's objective says.
        trials = [t for t in exp.trials() if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED)
                  and t.metric is not None and not math.isnan(t.metric)]
        trials.sort(key=lambda t: (t.metric if mode == "min" else -t.metric, t.id))
        return self._formatted(trials[:top_k], formatter)


def _base_of(base_model: Any) -> Any:
    """The base of a mutator space: a space as itself (its inline choices combine with the mutators), a
    module built from the compat ``nn.Module`` or holding choices as a space, any other module as it is."""
    from .. import as_space

    if not isinstance(base_model, nn.Module):
        raise NotSupported(f"The 'base_model' parameter of RetiariiExperiment must be an nn.Module. "
                           f"Got {type(base_model).__name__} instead.")
    try:
        return as_space("RetiariiExperiment", base_model)
    except NotSupported:
        return base_model  # a plain module: the mutators make the space


def _example_inputs(config: Any, evaluator: Any) -> tuple[torch.Tensor, ...]:
    """Inputs to trace the base model on: zeros of ``config.dummy_input``'s shape (NNI 2.x's graph
    engine setting), else the first two examples of the evaluator's training (or validation) data."""
    shape = vars(config).get("dummy_input") if hasattr(config, "__dict__") else None
    if isinstance(shape, (list, tuple)) and shape and all(isinstance(d, int) and d > 0 for d in shape):
        return (torch.zeros(*shape),)
    for name in ("train", "val"):
        data = getattr(evaluator, name, None)
        if data is not None and hasattr(data, "__getitem__") and hasattr(data, "__len__") and len(data) > 0:
            examples = [data[i][0] for i in range(min(2, len(data)))]
            if all(isinstance(x, torch.Tensor) for x in examples):
                return (torch.stack(examples),)
    raise NotSupported("RetiariiExperiment with applied_mutators traces the base model on example inputs: set "
                       "exp_config.dummy_input = [batch, channels, height, width] (NNI's graph engine setting), or "
                       "use an evaluator with training data (Classification / Regression).")


def debug_mutated_model(base_model: Any, evaluator: Any, applied_mutators: Any = None) -> None:
    """NNI 2.x's check of a space: one random model of ``base_model`` is built and evaluated
    (a one-trial random search in this process)."""
    from tridens import strategy as _strategy

    config = RetiariiExeConfig("local")
    config.max_trial_number = 1
    RetiariiExperiment(base_model, evaluator, applied_mutators, _strategy.Random()).run(config)
