"""``nni.nas.experiment.NasExperiment`` on tridens: the same configuration attributes, a
``td.Experiment`` underneath (results in the tridens store, see ``tridens ls``)."""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import tridens as td
from tridens.evaluators._supervised import SupervisedEvaluator
from tridens.store import Store

from .._common import NotSupported

__all__ = ["NasExperiment", "unique_name"]

log = logging.getLogger("tridens")


def unique_name(kind: str) -> str:
    """A new experiment's name when NNI's script gives none: the time and a random suffix, so two
    experiments started in the same second do not resume each other."""
    return time.strftime(f"{kind}-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


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

    @property
    def experiment(self) -> td.Experiment:
        """The ``td.Experiment`` underneath (after ``run()``): ``trials()``, ``top(k)``, ``export(dir)``."""
        if self._experiment is None:
            raise td.TridensError("NasExperiment.experiment needs a run() first")
        return self._experiment

    def run(self, config: Any = None, port: int | None = None, debug: bool = False, **_: Any) -> bool:
        """Run the search in this process (no web server: ``port`` is ignored; use ``tridens show``).
        A one-shot strategy (DARTS, GumbelDARTS, ENAS, RandomOneShot) trains one supernet; it
        needs a ``Classification`` / ``Regression`` evaluator, or ``Lightning(module, trainer)`` with a custom
        module (its ``training_step`` drives the supernet's weights)."""
        config = config if config is not None else self.config
        name = self.id or getattr(config, "experiment_name", None) or unique_name("nni")
        if getattr(self.strategy, "one_shot", False) and not isinstance(self.evaluator, (SupervisedEvaluator, td.evaluators.Lightning)):
            raise NotSupported(f"The one-shot strategy {type(self.strategy).__name__} needs the evaluator "
                               "nni.nas.evaluator.pytorch.Classification, Regression or Lightning (tridens.compat.nni.nas"
                               f".evaluator.pytorch). Got {type(self.evaluator).__name__} instead.")
        if (getattr(config, "trial_concurrency", 1) or 1) > 1:
            log.info("trial_concurrency > 1 is run one trial at a time in-process; use td.Experiment(executor=td.executors.Process(workers=N)) for parallel trials")
        objective = None
        mode = getattr(self.strategy, "mode", None)  # NNI 2.x's optimize_mode, on its strategy
        if mode is not None and self.evaluator is not None and mode != self.evaluator.objective.mode:
            objective = td.Objective(self.evaluator.objective.metric, mode)
        self._experiment = td.Experiment(self.model_space, self.evaluator, self.strategy, objective=objective,
                                         budget=td.Budget(max_trials=getattr(config, "max_trial_number", None),
                                                          max_duration=getattr(config, "max_experiment_duration", None)),
                                         name=name)
        self._experiment.run()
        return True

    def export_top_models(self, top_k: int = 1, *, formatter: str | None = None, **_: Any) -> list[Any]:
        """The ``top_k`` best models, best first: ``formatter="dict"`` gives samples, ``"instance"``
        (or ``None``) the models, with the weights their trial ended with (for a one-shot search,
        the supernet's weights of that subnet, or its retrained weights).

        >>> exp.export_top_models(formatter="dict")       # doctest: +SKIP
        [{'conv2': 1, 'dropout': 0.25, 'feature': 128}]
        """
        if self._experiment is None:
            raise td.TridensError("export_top_models() needs a finished run()")
        self._check_formatter(formatter)
        return self._formatted(self._experiment.top(top_k), formatter)

    @staticmethod
    def _check_formatter(formatter: str | None) -> None:
        if formatter not in (None, "dict", "instance"):
            raise NotSupported(f"The 'formatter' parameter of export_top_models must be 'dict', 'instance' or None "
                               f"(tridens has no generated code: use exp.experiment.export(dir) or `tridens export` for "
                               f"the weights and a self-contained torch.export program). Got {formatter!r} instead.")

    def _formatted(self, trials: list[Any], formatter: str | None) -> list[Any]:
        samples = [self.model_space.restrict(t.sample) for t in trials]
        if formatter == "dict":
            return samples
        models = []
        with Store(self.experiment._store_path(), readonly=True) as db:
            for trial, sample in zip(trials, samples):
                model = self.model_space.freeze(sample)
                if trial.checkpoint is not None:
                    model.load_state_dict(db.load_checkpoint(trial.checkpoint))
                models.append(model)
        return models
