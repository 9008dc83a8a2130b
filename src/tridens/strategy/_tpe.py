"""TPE: Optuna's ``TPESampler`` behind the strategy protocol (Bergstra et al., NeurIPS 2011).

We do not reimplement TPE. Every :meth:`TPE.ask` builds an in-memory Optuna study from the
trials told so far (the history of a resumed search included), in trial-id order, and asks it
define-by-run: only labels active under the values drawn so far are suggested, so conditional
labels reach Optuna exactly as Optuna's own conditional spaces do. Rebuilding the study for
each ask (rather than keeping one study alive) is what makes the search deterministic given the
seed and resumable: the study an ask sees depends only on the finished trials and the seed,
not on the order in which the engine happened to report them.

Mapping of domains: ``Categorical`` -> ``CategoricalDistribution`` over the sample values when
they are distinct JSON scalars (over their indices otherwise, e.g. InputChoice picks, which are
lists), ``Uniform``/``LogUniform`` -> ``FloatDistribution`` (``log=True``), ``RandInt`` ->
``IntDistribution``. Trial states: completed -> ``COMPLETE``, stopped early -> ``PRUNED`` with
its per-step values (TPE ranks pruned trials below completed ones, deeper ones first), failed
(including constraint violations) -> ``PRUNED`` without values (ranked worst, so TPE learns to
avoid the region), duplicate -> left out (its sample is still never proposed again). A suggestion
that breaks one of the space's :class:`~tridens.space.SampleRule` s (NAS-Bench-101's edge budget)
has that rule's labels drawn again by the rule (:meth:`SearchSpace.repaired`), so no trial is
spent on a sample the space refuses; BOHB's proposals go through the same bridge. Samples
proposed in the same group and not finished yet are ``RUNNING`` trials, and the sampler runs
with ``constant_liar=True``, so a group's samples spread out instead of piling on one point.
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

from ..space import Categorical, Domain, LogUniform, RandInt, SearchSpace, Uniform
from ..trial import Objective, Trial, TrialGroup, TrialStatus
from ._base import Strategy
from ._common import SearchBase, cap, check_bool, check_int, curve_of, derive_seed, final_value, sample_key

__all__ = ["TPE"]

_ATTEMPTS = 8  # asks per slot before a repeated sample is replaced by a random one


@dataclass
class _Observation:
    """One finished trial as Optuna will see it."""

    sample: dict[str, Any]
    state: str                      # "complete" | "pruned" | "failed"
    value: float | None = None
    steps: dict[int, float] | None = None


class _Encoding:
    def __init__(self, domain: Domain):
        import optuna.distributions as od

        self.values: list[Any] | None = None
        if isinstance(domain, Categorical):
            values = domain.values()
            plain = all(isinstance(v, (bool, int, float, str, type(None))) for v in values)
            distinct = all(not (a == b) for i, a in enumerate(values) for b in values[i + 1:])
            if plain and distinct:
                self.distribution: Any = od.CategoricalDistribution(values)
            else:
                self.values = values
                self.distribution = od.CategoricalDistribution(list(range(len(values))))
        elif isinstance(domain, RandInt):
            self.distribution = od.IntDistribution(int(domain.low), int(domain.high))
        elif isinstance(domain, LogUniform):
            self.distribution = od.FloatDistribution(float(domain.low), float(domain.high), log=True)
        elif isinstance(domain, Uniform):
            self.distribution = od.FloatDistribution(float(domain.low), float(domain.high))
        else:
            raise TypeError(f"TPE does not know how to search a domain of type {type(domain).__name__}: {domain!r}")

    def encode(self, value: Any) -> Any:
        if self.values is None:
            return value
        for i, v in enumerate(self.values):
            if v == value and type(v) is type(value):
                return i
        raise KeyError(value)

    def decode(self, value: Any) -> Any:
        return value if self.values is None else self.values[value]

    def suggest(self, trial: Any, label: str) -> Any:
        import optuna.distributions as od

        d = self.distribution
        if isinstance(d, od.CategoricalDistribution):
            return self.decode(trial.suggest_categorical(label, list(d.choices)))
        if isinstance(d, od.IntDistribution):
            return trial.suggest_int(label, d.low, d.high)
        return trial.suggest_float(label, d.low, d.high, log=d.log)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence Optuna's study-creation log line and experimental-feature warnings."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


class _OptunaBridge:
    """Builds a study from observations and asks it for new samples (used by TPE and BOHB)."""

    def __init__(self, space: SearchSpace, objective: Objective, *, n_startup_trials: int,
                 n_ei_candidates: int, multivariate: bool):
        self.space = space
        self.direction: Literal["maximize", "minimize"] = "maximize" if objective.mode == "max" else "minimize"
        self.encodings = {label: _Encoding(spec.domain) for label, spec in space.items()}
        self.conditional = any(spec.conditions for spec in space.values())
        self.n_startup_trials = n_startup_trials
        self.n_ei_candidates = n_ei_candidates
        self.multivariate = multivariate

    def _frozen(self, sample: Mapping[str, Any], state: Any, value: float | None = None,
                steps: Mapping[int, float] | None = None) -> Any:
        import optuna

        labels = [label for label in sample if label in self.encodings]
        return optuna.trial.create_trial(
            state=state, value=value,
            params={label: self.encodings[label].encode(sample[label]) for label in labels},
            distributions={label: self.encodings[label].distribution for label in labels},
            intermediate_values=dict(steps or {}))

    def propose(self, observations: Sequence[_Observation], pending: Sequence[Mapping[str, Any]], n: int,
                seed: int, is_new: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any] | None]:
        """``n`` samples (``None`` where Optuna kept repeating seen samples)."""
        import optuna
        from optuna.trial import TrialState

        with _quiet():
            sampler = optuna.samplers.TPESampler(
                seed=seed, n_startup_trials=self.n_startup_trials, n_ei_candidates=self.n_ei_candidates,
                multivariate=self.multivariate, group=self.multivariate and self.conditional,
                constant_liar=True)
            study = optuna.create_study(direction=self.direction, sampler=sampler)
            frozen = []
            for obs in observations:
                if obs.state == "complete":
                    frozen.append(self._frozen(obs.sample, TrialState.COMPLETE, obs.value))
                else:
                    frozen.append(self._frozen(obs.sample, TrialState.PRUNED, steps=obs.steps))
            frozen += [self._frozen(sample, TrialState.RUNNING) for sample in pending]
            study.add_trials(frozen)
            out: list[dict[str, Any] | None] = []
            taken: set[str] = set()
            rng = random.Random(seed)
            for _ in range(n):
                found = None
                for _ in range(_ATTEMPTS):
                    trial = study.ask()  # left RUNNING: a "liar" for the next asks
                    sample: dict[str, Any] = {}
                    for label, spec in self.space.items():
                        if spec.active(sample):
                            sample[label] = self.encodings[label].suggest(trial, label)
                    if self.space.rules and self.space.violation(sample) is not None:
                        # Optuna knows the domains, not the rules: the rule draws its labels again and
                        # the repaired sample, not the suggestion, stands in as the running trial.
                        sample = self.space.repaired(sample, rng)
                        study.tell(trial, state=TrialState.FAIL)
                        study.add_trial(self._frozen(sample, TrialState.RUNNING))
                    if is_new(sample) and sample_key(sample) not in taken:
                        found = sample
                        taken.add(sample_key(sample))
                        break
                out.append(found)
        return out


def observation(trial: Trial, objective: Objective, sample: dict[str, Any]) -> _Observation | None:
    """How a finished trial enters the study (``None``: it does not)."""
    if trial.status is TrialStatus.DUPLICATE or not trial.status.finished:
        return None
    value = final_value(trial, objective)
    if trial.status is TrialStatus.COMPLETED and value is not None:
        return _Observation(sample, "complete", value)
    if trial.status is TrialStatus.STOPPED and value is not None:
        steps = {i: v for i, v in enumerate(curve_of(trial, objective)) if not math.isnan(v)}
        return _Observation(sample, "pruned", steps=steps or {max(trial.steps - 1, 0): value})
    return _Observation(sample, "failed", steps={})


class TPE(SearchBase):
    """Tree-structured Parzen Estimator, through Optuna's ``TPESampler``.

    ``batch_size`` samples per group (proposed together with Optuna's constant liar);
    ``n_startup_trials`` random samples first; ``n_ei_candidates`` candidates per suggestion;
    ``multivariate`` uses the multivariate TPE (with ``group=True`` on conditional spaces).
    Optuna's sampler is seeded from the strategy's rng for every ask, so the search is
    deterministic given the seed. A sample equal to an earlier one is asked again, and after a
    few tries replaced by a random unseen sample; the search ends when a finite space is exhausted.

    ``stopping``: a rule that stops running trials early, as Optuna pairs ``TPESampler`` with a
    pruner; the trials it stops reach TPE as pruned trials with their values so far.

    >>> strategy = td.strategy.TPE(stopping=td.strategy.ASHA(max_steps=9))  # doctest: +SKIP
    """

    def __init__(self, batch_size: int = 4, n_startup_trials: int = 10, n_ei_candidates: int = 24,
                 multivariate: bool = True, stopping: Strategy | None = None):
        self.batch_size = batch_size
        self.n_startup_trials = n_startup_trials
        self.n_ei_candidates = n_ei_candidates
        self.multivariate = multivariate
        self.stopping = stopping

    def _check(self) -> None:
        check_int("TPE", "batch_size", self.batch_size, 1)
        check_int("TPE", "n_startup_trials", self.n_startup_trials, 0)
        check_int("TPE", "n_ei_candidates", self.n_ei_candidates, 1)
        check_bool("TPE", "multivariate", self.multivariate)

    def _setup(self) -> None:
        self._bridge = _OptunaBridge(self.space, self.objective, n_startup_trials=self.n_startup_trials,
                                     n_ei_candidates=self.n_ei_candidates, multivariate=self.multivariate)
        self._observations: dict[int, _Observation] = {}

    def _observe(self, trial: Trial, key: str | None) -> None:
        if key is None:
            return
        obs = observation(trial, self.objective, self.space.validate(trial.sample))
        if obs is not None:
            self._observations[trial.id] = obs

    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        self._require_started()
        n = cap(self.batch_size, remaining)
        if math.isfinite(self._size):
            n = min(n, int(self._size) - len(self._seen))
        if n <= 0:
            return None
        observations = [self._observations[tid] for tid in sorted(self._observations)]
        proposals = self._bridge.propose(observations, list(self._pending.values()), n,
                                         derive_seed(self._seed, "tpe", self._proposed), self._is_new)
        samples = []
        for proposal in proposals:
            if proposal is None or not self._is_new(proposal):
                proposal = self._random_unseen(self._rng("random"))
                if proposal is None:
                    break
            samples.append(self._accept(proposal))
        return self._group(samples, "tpe")
