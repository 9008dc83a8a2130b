"""tridens trials as Optuna trials: an Optuna study of an experiment, for ``optuna-dashboard``,
Optuna's plots and :mod:`optuna.importance`.

Each label's distribution is the domain the space declared, as the experiment stored it
(:func:`declared_distributions`): a choice becomes a ``CategoricalDistribution`` of every candidate,
``td.loguniform`` a ``FloatDistribution(log=True)``, ``td.uniform`` a ``FloatDistribution``,
``td.randint`` an ``IntDistribution``; so Optuna continues the study with the same ``suggest_*``
calls. A label the stored space does not describe (a store written before it kept the space) is
inferred from the values the trials took (:func:`infer_distributions`). Completed trials become ``COMPLETE`` (their objective value, and the second
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
from typing import Any, Literal, Mapping, Sequence

from ..trial import Trial, TrialStatus

__all__ = ["optuna_trials", "declared_distributions", "infer_distributions", "export_optuna"]

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


def declared_distributions(described: Mapping[str, Any] | None) -> dict[str, Any]:
    """Optuna distributions of the labels of a described search space (what
    :meth:`tridens.space.SearchSpace.describe` gives and the store keeps as ``search_space``); a
    label of another kind (a domain Optuna has no distribution for) is left out.

    >>> declared_distributions({"lr": {"type": "loguniform", "low": 1e-4, "high": 0.1}})["lr"]
    FloatDistribution(high=0.1, log=True, low=0.0001, step=None)
    """
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for label, domain in (described or {}).items():
        kind = domain.get("type") if isinstance(domain, Mapping) else None
        if kind == "categorical" and domain.get("values"):
            out[label] = CategoricalDistribution([_param_value(v) for v in domain["values"]])
        elif kind in ("uniform", "loguniform"):
            out[label] = FloatDistribution(float(domain["low"]), float(domain["high"]), log=kind == "loguniform")
        elif kind == "randint":
            out[label] = IntDistribution(int(domain["low"]), int(domain["high"]))
    return out


def _holds(distribution: Any, value: Any) -> bool:
    """Whether the Optuna ``distribution`` contains the sample value ``value``."""
    from optuna.distributions import CategoricalDistribution

    value = _param_value(value)
    if isinstance(distribution, CategoricalDistribution):
        return any(value == c and type(value) is type(c) for c in distribution.choices)
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and distribution.low <= value <= distribution.high)


def _second_value(trial: Trial, name: str) -> float | None:
    key = "latency_ms" if name == "latency" else name
    if trial.info.get(key) is not None:
        return float(trial.info[key])
    values = trial.metrics.get(name)
    return float(values[-1]) if values else None


def _when(timestamp: float | None) -> datetime.datetime | None:
    return None if timestamp is None else datetime.datetime.fromtimestamp(timestamp)


def optuna_trials(trials: Sequence[Trial], objective: tuple[str, str],
                  second_objective: tuple[str, str] | None = None,
                  search_space: Mapping[str, Any] | None = None) -> tuple[list[Any], list[Direction]]:
    """``(frozen trials, directions)``: the finished ``trials`` as :class:`optuna.trial.FrozenTrial`
    objects numbered from 0, and ``"maximize"``/``"minimize"`` per objective. ``search_space``: the
    described space (:func:`declared_distributions`); labels it leaves out are inferred."""
    import optuna
    from optuna.trial import TrialState

    metric, mode = objective
    objectives = [(metric, mode)] + ([tuple(second_objective)] if second_objective else [])
    directions: list[Direction] = ["maximize" if m == "max" else "minimize" for _, m in objectives]
    kept = [t for t in trials if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED, TrialStatus.FAILED)]
    distributions = infer_distributions([t.sample for t in kept])
    declared = declared_distributions(search_space)
    for label, distribution in declared.items():  # the declared domain, where every value seen lies in it
        if all(_holds(distribution, t.sample[label]) for t in kept if label in t.sample):
            distributions[label] = distribution
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
                                       tuple(second) if second else None, config.get("search_space"))
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

