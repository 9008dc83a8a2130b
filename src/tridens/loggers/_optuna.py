"""tridens trials as Optuna trials: an Optuna study of an experiment, for ``optuna-dashboard``,
Optuna's plots and :mod:`optuna.importance`.

The store keeps samples, not the search space's domains, so each label's distribution is inferred
from the values the trials took: numbers become an ``IntDistribution``/``FloatDistribution`` over
their range, anything else a ``CategoricalDistribution`` of the values seen (lists and dicts as
their JSON text). Completed trials become ``COMPLETE`` (their objective value, and the second
objective's when the experiment has one), trials stopped early ``PRUNED`` with their per-step
objective values as intermediate values, failed trials ``FAIL``; pending, running and duplicate
trials are left out.

>>> from tridens.trial import Trial, TrialStatus
>>> t = Trial(0, {"width": 32, "op": "conv"}, seed=1, status=TrialStatus.COMPLETED, metric=0.9,
...           metrics={"val_acc": [0.8, 0.9]})
>>> frozen, directions = optuna_trials([t], ("val_acc", "max"))
>>> frozen[0].params, frozen[0].value, directions
({'width': 32, 'op': 'conv'}, 0.9, ['maximize'])
"""

from __future__ import annotations

import datetime
import json
import math
import warnings
from typing import Any, Literal, Sequence

from ..trial import Trial, TrialStatus

__all__ = ["optuna_trials", "infer_distributions", "export_optuna"]

Direction = Literal["maximize", "minimize"]


def _param_value(value: Any) -> Any:
    """A sample value as an Optuna parameter: numbers, strings, bools and None stay; the rest is JSON text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True)


def infer_distributions(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each label's Optuna distribution, from the values ``samples`` hold (see the module docstring).

    >>> infer_distributions([{"lr": 0.1, "depth": 2}, {"lr": 0.01, "depth": 3}])["depth"]
    IntDistribution(high=3, log=False, low=2, step=1)
    """
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    values: dict[str, list[Any]] = {}
    for sample in samples:
        for label, value in sample.items():
            values.setdefault(label, []).append(_param_value(value))
    out: dict[str, Any] = {}
    for label, seen in values.items():
        numbers = [v for v in seen if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) == len(seen) and all(math.isfinite(v) for v in numbers):
            if all(isinstance(v, int) for v in numbers):
                out[label] = IntDistribution(int(min(numbers)), int(max(numbers)))
            else:
                out[label] = FloatDistribution(float(min(numbers)), float(max(numbers)))
        else:
            distinct: list[Any] = []
            for v in seen:
                if not any(v == d and type(v) is type(d) for d in distinct):
                    distinct.append(v)
            out[label] = CategoricalDistribution(distinct)
    return out


def _second_value(trial: Trial, name: str) -> float | None:
    key = "latency_ms" if name == "latency" else name
    if trial.info.get(key) is not None:
        return float(trial.info[key])
    values = trial.metrics.get(name)
    return float(values[-1]) if values else None


def _when(timestamp: float | None) -> datetime.datetime | None:
    return None if timestamp is None else datetime.datetime.fromtimestamp(timestamp)


def optuna_trials(trials: Sequence[Trial], objective: tuple[str, str],
                  second_objective: tuple[str, str] | None = None) -> tuple[list[Any], list[Direction]]:
    """``(frozen trials, directions)``: the finished ``trials`` as :class:`optuna.trial.FrozenTrial`
    objects numbered from 0, and ``"maximize"``/``"minimize"`` per objective."""
    import optuna
    from optuna.trial import TrialState

    metric, mode = objective
    objectives = [(metric, mode)] + ([tuple(second_objective)] if second_objective else [])
    directions: list[Direction] = ["maximize" if m == "max" else "minimize" for _, m in objectives]
    kept = [t for t in trials if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED, TrialStatus.FAILED)]
    distributions = infer_distributions([t.sample for t in kept])
    frozen = []
    for number, t in enumerate(kept):
        params = {k: _param_value(v) for k, v in t.sample.items()}
        values: list[float] | None = None
        state = TrialState.FAIL
        if t.status is TrialStatus.COMPLETED and t.metric is not None and not math.isnan(t.metric):
            candidates = [float(t.metric)] + [_second_value(t, name) for name, _ in objectives[1:]]
            if all(v is not None and math.isfinite(v) for v in candidates):
                values, state = [float(v) for v in candidates], TrialState.COMPLETE  # type: ignore[arg-type]
        elif t.status is TrialStatus.STOPPED:
            state = TrialState.PRUNED
        intermediate = {}
        if len(objectives) == 1:
            intermediate = {step: float(v) for step, v in enumerate(t.metrics.get(metric, []))
                            if v is not None and math.isfinite(v)}
        attrs = {"tridens_trial_id": t.id, "tridens_status": t.status.value, "seed": t.seed,
                 "fingerprint": t.fingerprint}
        if t.info.get("params") is not None:
            attrs["params"] = t.info["params"]
        if t.error:
            attrs["error"] = t.error.strip().splitlines()[-1][:500]
        # Optuna needs both times of a finished trial; a trial the store has no time for gets the
        # other one, or the export's time.
        start = _when(t.started_at) or _when(t.finished_at) or datetime.datetime.now()
        end = _when(t.finished_at) or start
        frozen.append(optuna.trial.FrozenTrial(
            number=number, state=state, value=None, values=values, datetime_start=start, datetime_complete=end,
            params=params, distributions={k: distributions[k] for k in params}, user_attrs=attrs,
            system_attrs={}, intermediate_values=intermediate, trial_id=number))
    return frozen, directions


def export_optuna(store: str, name: str, storage: str, study_name: str | None = None) -> Any:
    """Write experiment ``name`` of the tridens store at ``store`` to the Optuna ``storage`` (an
    RDB URL such as ``sqlite:///optuna.db``) as the study ``study_name`` (default: ``name``);
    returns the :class:`optuna.Study`. An existing study of that name is an error, never changed.

    >>> study = export_optuna("tridens.db", "my-search", "sqlite:///optuna.db")   # doctest: +SKIP
    >>> study.best_trial.params                                                  # doctest: +SKIP
    """
    import optuna

    from ..store import Store, StoreError

    with Store(store, readonly=True) as db:
        record = db.get_experiment(name)
        trials = db.trials(name)
    config = record.config
    objective = config.get("objective") or {"metric": "val_acc", "mode": "max"}
    second = config.get("second_objective")
    frozen, directions = optuna_trials(trials, (objective["metric"], objective["mode"]),
                                       tuple(second) if second else None)
    target = study_name or name
    if target in optuna.study.get_all_study_names(storage=storage):
        raise StoreError(f"the Optuna storage {storage} already holds a study {target!r}; pass another study name "
                         f"or storage")
    study = optuna.create_study(storage=storage, study_name=target, directions=directions)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([objective["metric"]] + ([second[0]] if second else []))
    study.set_user_attr("tridens_store", str(store))
    study.set_user_attr("tridens_experiment", name)
    study.add_trials(frozen)
    return study

