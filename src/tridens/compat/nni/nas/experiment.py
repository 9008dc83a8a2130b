"""``nni.nas.experiment.NasExperiment`` on tridens: the same configuration attributes, a
``td.Experiment`` underneath (results in the tridens store, see ``tridens ls``)."""

from __future__ import annotations

import logging
import time
from typing import Any

import tridens as td

__all__ = ["NasExperiment"]

log = logging.getLogger("tridens")


class _Config:
    """Accepts any NNI configuration attribute; the ones tridens uses are read in ``run``."""

    def __init__(self) -> None:
        self.max_trial_number: int | None = None
        self.max_experiment_duration: str | None = None
        self.trial_concurrency = 1
        self.trial_gpu_number = 0
        self.experiment_name: str | None = None

    def __getattr__(self, name: str) -> Any:  # nested sections such as config.training_service
        value = _Config()
        object.__setattr__(self, name, value)
        return value


class NasExperiment:
    """``NasExperiment(model_space, evaluator, strategy)``; set ``exp.config.*``, then ``exp.run()``."""

    def __init__(self, model_space: Any, evaluator: Any, strategy: Any = None, config: Any = None, id: str | None = None):
        self.model_space, self.evaluator, self.strategy = model_space, evaluator, strategy
        self.config = config if config is not None else _Config()
        self.id = id
        self._experiment: td.Experiment | None = None

    def run(self, config: Any = None, port: int | None = None, debug: bool = False, **_: Any) -> bool:
        """Run the search in this process (no web server: ``port`` is ignored; use ``tridens show``)."""
        config = config if config is not None else self.config
        name = self.id or getattr(config, "experiment_name", None) or time.strftime("nni-%Y%m%d-%H%M%S")
        if (getattr(config, "trial_concurrency", 1) or 1) > 1:
            log.info("trial_concurrency > 1 is run one trial at a time in-process; use td.Experiment(executor='process') for parallel trials")
        self._experiment = td.Experiment(self.model_space, self.evaluator, self.strategy,
                                         max_trials=getattr(config, "max_trial_number", None),
                                         max_duration=getattr(config, "max_experiment_duration", None), name=name)
        self._experiment.run()
        return True

    def export_top_models(self, top_k: int = 1, *, formatter: str = "dict") -> list[Any]:
        """The best models: ``formatter="dict"`` gives samples, ``"instance"`` frozen models."""
        if self._experiment is None:
            raise td.TridensError("export_top_models() needs a finished run()")
        trials = self._experiment.top(top_k)
        samples = [self.model_space.restrict(t.sample) for t in trials]
        if formatter == "dict":
            return samples
        if formatter == "instance":
            return [self.model_space.freeze(s) for s in samples]
        raise td.TridensError(f"formatter {formatter!r} is not supported; use 'dict' or 'instance' "
                              "(or exp.export(dir) / `tridens export` for weights and a self-contained program)")
