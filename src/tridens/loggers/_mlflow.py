"""MLflow logging: one MLflow run per trial in an MLflow experiment named after the tridens one."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from typing import Any, Mapping, Sequence

from ..trial import Trial, TrialStatus
from ._base import Callback, trial_name

__all__ = ["MLflow"]

_PARAM_LIMIT = 6000  # characters MLflow keeps in a parameter value
_KEY_RE = re.compile(r"[^A-Za-z0-9_\-. /]")  # characters MLflow refuses in parameter and metric names


_KEY_LIMIT = 250  # characters MLflow keeps in a parameter or metric name


def _key(name: str) -> str:
    """An MLflow name for a label or metric: the name itself when MLflow takes it; else cleaned,
    cut to 250 characters and marked with a digest of the original, so that two labels never
    share a key (``a:b`` and ``a/b`` both clean to ``a_b`` otherwise; MLflow refuses the whole
    batch of a run whose keys collide or run long).

    >>> _key("lr"), _key("a:b") != _key("a?b")
    ('lr', True)
    """
    clean = _KEY_RE.sub("_", name)
    if clean == name and len(name) <= _KEY_LIMIT:
        return name
    digest = hashlib.blake2b(name.encode(), digest_size=4).hexdigest()
    return f"{clean[:_KEY_LIMIT - 10]}--{digest}"


def _param(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= _PARAM_LIMIT else text[:_PARAM_LIMIT - 3] + "..."


class MLflow(Callback):
    """Log each trial as an MLflow run: its sample as parameters, each step's metrics with
    ``step=``, tags ``tridens.trial``, ``tridens.fingerprint``, ``tridens.seed``,
    ``tridens.status``; the experiment's best run gets the tag ``tridens.best = "true"``.

    ``tracking_uri`` is any MLflow tracking URI (``sqlite:///mlflow.db``, a server's
    ``http://...``, a folder); ``experiment_name`` defaults to the tridens experiment's name.
    Uses :class:`mlflow.MlflowClient` (no global active run). Needs ``pip install 'tridens[mlflow]'``.

    >>> exp = td.Experiment(space, evaluator, callbacks=[td.loggers.MLflow("sqlite:///mlflow.db")])  # doctest: +SKIP
    """

    def __init__(self, tracking_uri: str, experiment_name: str | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self._client: Any = None
        self._experiment_id: str | None = None
        self._runs: dict[int, str] = {}
        self._ended: dict[int, str] = {}

    def on_experiment_start(self, name: str, config: Mapping[str, Any]) -> None:
        try:
            from mlflow import MlflowClient
        except ImportError as err:
            raise ImportError("td.loggers.MLflow needs MLflow: pip install 'tridens[mlflow]'") from err
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        target = self.experiment_name or name
        found = self._client.get_experiment_by_name(target)
        self._experiment_id = found.experiment_id if found is not None else self._client.create_experiment(target)
        objective = config.get("objective") or {}
        if objective:
            self._client.set_experiment_tag(self._experiment_id, "tridens.objective",
                                            f"{objective.get('metric')} ({objective.get('mode')})")

    def _run(self, trial: Trial) -> str:
        from mlflow.entities import Param

        run_id = self._runs.get(trial.id)
        if run_id is None:
            run = self._client.create_run(
                self._experiment_id, run_name=f"trial-{trial_name(trial)}", start_time=int(
                    (trial.started_at or time.time()) * 1000),
                tags={"tridens.trial": trial_name(trial), "tridens.trial_id": str(trial.id),
                      "tridens.seed": str(trial.seed), "tridens.fingerprint": trial.fingerprint or ""})
            run_id = run.info.run_id
            self._runs[trial.id] = run_id
            params = [Param(_key(k), _param(v)) for k, v in trial.sample.items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
                self._client.log_batch(run_id, params=params[i:i + 100])
        return run_id

    def on_trial_step(self, trial: Trial, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        run_id = self._run(trial)
        now = int(time.time() * 1000)
        values = [Metric(_key(k), float(v), now, step) for k, v in metrics.items() if math.isfinite(float(v))]
        if values:
            self._client.log_batch(run_id, metrics=values)

    def on_trial_end(self, trial: Trial) -> None:
        run_id = self._run(trial)
        self._client.set_tag(run_id, "tridens.status", trial.status.value)
        if trial.fingerprint:
            self._client.set_tag(run_id, "tridens.fingerprint", trial.fingerprint)
        if trial.checkpoint:
            self._client.set_tag(run_id, "tridens.checkpoint", str(trial.checkpoint))
        if trial.info.get("params") is not None:
            self._client.set_tag(run_id, "tridens.params", str(trial.info["params"]))
        if trial.error:
            self._client.set_tag(run_id, "tridens.error", trial.error[-5000:])
        status = {TrialStatus.COMPLETED: "FINISHED", TrialStatus.STOPPED: "KILLED"}.get(trial.status, "FAILED")
        end = int((trial.finished_at or time.time()) * 1000)
        self._client.set_terminated(run_id, status=status, end_time=end)
        self._ended[trial.id] = self._runs.pop(trial.id)

    def on_experiment_end(self, name: str, best: Trial | None, trials: Sequence[Trial]) -> None:
        if best is None or self._client is None:
            return
        run_id = self._ended.get(best.id) or self._runs.get(best.id)
        if run_id is None:  # the best trial finished in an earlier run: find its MLflow run by tag
            found = self._client.search_runs([self._experiment_id], f"tags.`tridens.trial_id` = '{best.id}'",
                                             max_results=1)
            run_id = found[0].info.run_id if found else None
        if run_id is not None:
            self._client.set_tag(run_id, "tridens.best", "true")
            self._client.set_experiment_tag(self._experiment_id, "tridens.best_run", run_id)

    def close(self) -> None:
        for run_id in self._runs.values():  # runs a failed experiment left open
            self._client.set_terminated(run_id, status="FAILED")
        self._runs.clear()
