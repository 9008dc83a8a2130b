"""What the dashboard computes on top of the reader: hyperparameter importance and the Pareto front
(both with Optuna, on the experiment's trials), and a trial's architecture when its space's code
is already imported in this process."""

from __future__ import annotations

import math
import os
import sys
import threading
import warnings
from typing import Any, Mapping, Sequence

from ..trial import Trial, TrialStatus
from ._reader import MAX_POINTS, StoreReader, _finite

__all__ = ["Importance", "pareto", "pareto_front", "architecture", "IMPORTANCE_EVALUATORS", "MAX_IMPORTANCE_TRIALS",
           "MAX_FANOVA_TRIALS"]

IMPORTANCE_EVALUATORS = ("ped-anova", "fanova")


MAX_IMPORTANCE_TRIALS = 10_000
"""Most trials importance is computed on: beyond it, a uniform sample of them. PED-ANOVA compares
the top quantile's distribution with the whole's, and fANOVA fits a random forest: both estimate
distributions, which a sample of this size pins down, while building the Optuna study and the
forest grows with every trial."""

MAX_FANOVA_TRIALS = 1_000
"""Most trials fANOVA fits its random forest on: beyond it, the best tenth of them and a uniform
sample of the others. Optuna's fANOVA (64 trees of depth 64, its tree walks in Python) costs
seconds per hundred trials and grows faster than linearly; its marginals are taken over the search
space, not over where the trials lie, so the best trials sharpen the forest where it matters
without weighting the result towards them."""


def _study(reader: StoreReader, name: str, second: tuple[str, str] | None,
           limit: int | None = None, best: int = 0) -> tuple[Any, list[Any], dict[str, Any]]:
    """An in-memory Optuna study of the experiment's finished trials (at most ``limit``: beyond it
    the ``best`` best and a uniform sample of the others), its frozen trials, and the points they
    came from."""
    import optuna

    from ..loggers import optuna_trials

    objective = reader.objective(reader.config(name))
    points = reader.finished_points(name, second[0] if second else None, limit=limit, best=best)
    trials = []
    for i, (tid, sample, value, status) in enumerate(zip(points["ids"], points["samples"], points["values"],
                                                         points["statuses"])):
        info = {} if second is None else {second[0]: points["second"][i]}
        trials.append(Trial(id=tid, sample=sample, seed=0, status=TrialStatus(status), metric=value, info=info))
    frozen, directions = optuna_trials(trials, (objective["metric"], objective["mode"]), second)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=directions)
    study.add_trials(frozen)
    return study, frozen, points


def _study_at_common_step(reader: StoreReader, name: str, limit: int | None = None,
                          best: int = 0) -> tuple[Any, list[Any], dict[str, Any]]:
    """An in-memory Optuna study of the finished trials (at most ``limit``: beyond it the ``best``
    best and a uniform sample of the others), each COMPLETE with its objective's value at the step
    all of them reached, its frozen trials, and the points (``points["step"]``: that step)."""
    import optuna

    from ..loggers import optuna_trials

    objective = reader.objective(reader.config(name))
    points = reader.values_at_common_step(name, limit=limit, best=best)
    trials = [Trial(id=tid, sample=sample, seed=0, status=TrialStatus.COMPLETED, metric=value)
              for tid, sample, value in zip(points["ids"], points["samples"], points["values"])]
    frozen, directions = optuna_trials(trials, (objective["metric"], objective["mode"]))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=directions)
    study.add_trials(frozen)
    return study, frozen, points


class Importance:
    """Hyperparameter importance with :mod:`optuna.importance` (PED-ANOVA or fANOVA), kept until the
    number of finished trials changes. Computed on the completed trials' final values; where an
    early-stopping strategy stopped trials, on every finished trial's value at one step all of them
    reached (:meth:`StoreReader.values_at_common_step`), so the stopped ones count too. ``basis``
    says which. Beyond ``max_trials`` finished trials, PED-ANOVA ranks a uniform sample of that
    many; beyond ``max_fanova_trials``, fANOVA fits on the best tenth and a uniform sample of the
    others (the same trials while none are added). ``trials`` is how many it was computed on,
    ``total`` how many there were, and ``basis`` says how they were chosen.

    >>> Importance(StoreReader("tridens.db"))("my-search")["importances"]  # doctest: +SKIP
    {'width': 0.93, 'op': 0.06, 'lr': 0.01}
    """

    def __init__(self, reader: StoreReader, max_trials: int = MAX_IMPORTANCE_TRIALS,
                 max_fanova_trials: int = MAX_FANOVA_TRIALS) -> None:
        self.reader = reader
        self.max_trials = max_trials
        self.max_fanova_trials = max_fanova_trials
        self._cache: dict[tuple[str, str], tuple[tuple[int, int], dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str, evaluator: str = "ped-anova") -> dict[str, Any]:
        """``{"evaluator", "trials", "total", "basis", "importances": {label: value}}``, with
        ``"message"`` (why not) when there is nothing to rank."""
        if evaluator not in IMPORTANCE_EVALUATORS:
            raise ValueError(f"unknown importance evaluator {evaluator!r}; known: {', '.join(IMPORTANCE_EVALUATORS)}")
        counts = self.reader.status_counts(name)
        finished = (counts.get("completed", 0), counts.get("stopped", 0))
        key = (name, evaluator)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] == finished:
                return cached[1]
            result = self._compute(name, evaluator, stopped=finished[1])
            self._cache[key] = (finished, result)
            return result

    def _compute(self, name: str, evaluator: str, stopped: int) -> dict[str, Any]:
        import optuna
        from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator

        limit = self.max_trials if evaluator == "ped-anova" else self.max_fanova_trials
        best = 0 if evaluator == "ped-anova" else limit // 10  # PED-ANOVA compares the top with the whole
        if stopped:
            study, frozen, points = _study_at_common_step(self.reader, name, limit, best)
            basis = (f"completed and stopped trials compared at step {points['step']}, the last step every one of "
                     f"them reached (early stopping ended {stopped} trial(s) there or later)")
        else:
            study, frozen, points = _study(self.reader, name, None, limit, best)
            basis = "completed trials, final values"
        complete = [t for t in frozen if t.state == optuna.trial.TrialState.COMPLETE]
        if len(complete) < points["total"]:
            basis += (f"; a uniform sample of {len(complete):,} of the {points['total']:,}" if not best else
                      f"; fitted on {len(complete):,} of the {points['total']:,}: the best {best:,} and a uniform "
                      "sample of the others")
        varied = set(frozen[0].distributions) if frozen else set()
        varied = {p for p in varied if len({repr(t.params.get(p)) for t in complete}) > 1}
        if len(complete) < 4 or not varied:
            return {"evaluator": evaluator, "trials": len(complete), "total": points["total"],
                    "importances": {}, "basis": basis, "message": f"importance needs at least 4 finished trials with a varied label "
                               f"({len(complete)} on this basis: {basis})"}
        chosen = (PedAnovaImportanceEvaluator() if evaluator == "ped-anova"
                  else FanovaImportanceEvaluator(seed=0))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                values = optuna.importance.get_param_importances(study, evaluator=chosen, params=sorted(varied))
        except (ValueError, RuntimeError) as err:
            return {"evaluator": evaluator, "trials": len(complete), "total": points["total"],
                    "importances": {}, "basis": basis, "message": f"optuna.importance could not rank these labels: {err}"}
        return {"evaluator": evaluator, "trials": len(complete), "total": points["total"], "basis": basis,
                "importances": {k: float(v) for k, v in values.items()}}


def pareto_front(first: Sequence[float | None], second: Sequence[float | None],
                 modes: tuple[str, str]) -> list[bool]:
    """Which points no other point dominates (at least as good on both objectives and better on
    one), as Optuna's ``study.best_trials`` decides for two objectives; a point with a missing or
    infinite value takes no part. One sort and one sweep: O(n log n).

    >>> pareto_front([0.9, 0.8, 0.85], [300, 100, 400], ("max", "min"))
    [True, True, False]
    """
    sign = (-1.0 if modes[0] == "max" else 1.0, -1.0 if modes[1] == "max" else 1.0)
    points = sorted((sign[0] * a, sign[1] * b, i) for i, (a, b) in enumerate(zip(first, second))
                    if a is not None and b is not None and math.isfinite(a) and math.isfinite(b))
    front = [False] * len(first)
    best_before = math.inf  # the least second value among points with a smaller first value
    start = 0
    while start < len(points):
        end = start
        while end < len(points) and points[end][0] == points[start][0]:
            end += 1
        least = points[start][1]  # sorted: the group's least second value comes first
        if least < best_before:
            for a, b, i in points[start:end]:
                if b == least:  # equal points do not dominate each other
                    front[i] = True
            best_before = least
        start = end
    return front


def pareto(reader: StoreReader, name: str, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """The objective against the second objective of the finished trials, and which lie on the
    Pareto front of the completed ones (:func:`pareto_front`, on the two objective columns read
    in SQL); ``{"message"}`` without a second objective. Beyond ``max_points`` trials, the front
    and a uniform sample of the others (the same on every call while none are added): ``total``
    says how many there are, ``sampled`` whether some were left out."""
    config = reader.config(name)
    second = config.get("second_objective")
    if not second:
        return {"message": "this experiment has no second objective (td.RunOptions(second_objective=...))"}
    if not (isinstance(second, (list, tuple)) and len(second) == 2 and isinstance(second[0], str)):
        return {"message": f"the experiment's second objective is damaged: {str(second)[:80]!r}"}
    objective = reader.objective(config)
    columns = reader.objective_pairs(name, str(second[0]))
    completed = [s == "completed" for s in columns["statuses"]]
    front = pareto_front([v if c else None for v, c in zip(columns["values"], completed)], columns["second"],
                         (objective["mode"], "max" if second[1] == "max" else "min"))
    total = len(columns["ids"])
    chosen = range(total)
    if total > max_points:
        on = [i for i in range(total) if front[i]][:max_points]
        others = sorted((i for i in range(total) if not front[i]),
                        key=lambda i: (columns["ids"][i] * 2654435761) % 4294967296)  # as the store's samples
        chosen = sorted(on + others[:max_points - len(on)])
    ids = [columns["ids"][i] for i in chosen]
    numbers = reader.numbers(name, ids)
    return {"objective": objective, "second_objective": {"metric": second[0], "mode": second[1]},
            "ids": ids, "numbers": [numbers.get(t) for t in ids],
            "values": [_finite(columns["values"][i]) for i in chosen],
            "second": [_finite(columns["second"][i]) for i in chosen], "front": [front[i] for i in chosen],
            "total": total, "sampled": len(ids) < total}


def _already_imported(ref: Mapping[str, Any]) -> bool:
    """Whether the code a recipe reference names is already loaded in this process."""
    module, _, _ = str(ref.get("path", "")).partition(":")
    file = ref.get("file")
    if file:
        main = sys.modules.get("__main__")
        if main is not None and os.path.abspath(getattr(main, "__file__", "") or "") == os.path.abspath(file):
            return True
        name = "tridens_script_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(file))
        return name in sys.modules
    return module in sys.modules


def _references(recipe: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    refs = [recipe] if "path" in recipe else []
    if isinstance(recipe.get("base"), Mapping):
        refs += _references(recipe["base"])
    mutators = recipe.get("mutators")
    refs += mutators if isinstance(mutators, list) else []
    return refs


def architecture(config: Mapping[str, Any], trial: Mapping[str, Any]) -> dict[str, Any]:
    """The trial's model as readable text: its graph IR (``print(graph)``) when the space's code is
    already imported in this process (the dashboard never imports code a store names), else
    ``{"available": False, "reason"}`` and the fingerprint and sample only."""
    base = {"fingerprint": trial.get("fingerprint"), "sample": trial.get("sample")}
    recipe = config.get("space")
    if not recipe:
        return {**base, "available": False,
                "reason": "the store records no importable space for this experiment; fingerprint and sample only"}
    if not isinstance(recipe, dict) or not all(isinstance(r, dict) for r in _references(recipe)):
        return {**base, "available": False,
                "reason": "the store's space recipe is damaged (not a JSON object of references); fingerprint and sample only"}
    missing = [str(r.get("file") or r.get("path")) for r in _references(recipe) if not _already_imported(r)]
    if missing:
        return {**base, "available": False,
                "reason": f"the space's code ({', '.join(missing)}) is not imported in this process, and the "
                          "dashboard never imports code named in a store; fingerprint and sample only (start the "
                          "dashboard from the search script with tridens.dashboard.serve(...) to see the graph)"}
    try:
        from ..graph import trace
        from ..files import model_bytes_limit
        from ..space import check_frozen, checked_space

        # A store's recipe is measured on the meta device before anything is allocated.
        what = "the store's space recipe"
        space = checked_space(recipe, max_bytes=model_bytes_limit(), what=what)
        labels = space.search_space()
        sample = {k: v for k, v in (trial.get("sample") or {}).items() if k in labels}
        check_frozen(space, sample, what=what, max_bytes=model_bytes_limit())
        model = space.freeze(sample, check=False)
        inputs = getattr(space, "example_inputs", None) or getattr(model, "example_inputs", None)
        text = str(trace(model, example_inputs=inputs)) if inputs is not None else repr(model)
    except Exception as err:  # a space that no longer builds this sample: say why, show what is stored
        return {**base, "available": False,
                "reason": f"the model could not be rebuilt: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    return {**base, "available": True, "text": text}
