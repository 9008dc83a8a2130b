"""``nni.retiarii.experiment.pytorch``: ``RetiariiExperiment`` and ``RetiariiExeConfig`` on tridens.

``RetiariiExperiment(base_model, evaluator, applied_mutators, strategy)`` runs like NNI 3's
``NasExperiment`` (a ``td.Experiment`` underneath, in this process): a multi-trial strategy trains
a trial per sample, a one-shot one (``DARTS``, ``ENAS``...) one supernet, whatever
``execution_engine`` says.
"""

from __future__ import annotations

import math
from typing import Any

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
        if applied_mutators:
            raise NotSupported("The 'applied_mutators' parameter of RetiariiExperiment must be empty: NNI's graph "
                               "Mutator API has no tridens equivalent. Write the mutation as a td.Mutator (mutate(graph)) "
                               "and pass td.ModelSpace.from_base(model, mutators=[...]) as the base model instead.")
        if trainer is not None:
            raise NotSupported("The 'trainer' parameter of RetiariiExperiment (NNI < 2.0) is not supported: pass the "
                               "evaluator (Classification / FunctionalEvaluator) instead, or call a one-shot trainer's "
                               "fit() directly.")
        from .. import as_space

        super().__init__(as_space("RetiariiExperiment", base_model), evaluator, strategy, config=RetiariiExeConfig())

    def run(self, config: Any = None, port: int = 8080, debug: bool = False) -> bool:  # type: ignore[override]
        return super().run(config, port=port, debug=debug)

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


def debug_mutated_model(base_model: Any, evaluator: Any, applied_mutators: Any = None) -> None:
    """NNI 2.x's check of a space: one random model of ``base_model`` is built and evaluated
    (a one-trial random search in this process)."""
    from tridens import strategy as _strategy

    config = RetiariiExeConfig("local")
    config.max_trial_number = 1
    RetiariiExperiment(base_model, evaluator, applied_mutators, _strategy.Random()).run(config)
