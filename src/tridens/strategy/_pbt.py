"""PBT, Population Based Training (Jaderberg et al., 2017), as a strategy that forks trials.

A group is a **population** of ``population`` random samples trained in lockstep for
``max_steps`` steps (epochs; None: the evaluator's budget). After every ``interval`` steps, once
every member has reported the step, the members are ranked by the objective at that step; each
member of the bottom ``quantile`` **exploits** a member of the top ``quantile`` drawn at random --
it continues from that member's weights, optimizer state and step -- and **explores**: each label of
``hyperparams`` of the copied sample is resampled from its domain with probability
``resample_probability``, else moved (a number multiplied by one of ``perturbation``, clipped to its
domain; a choice moved to a neighbouring candidate). Labels not in ``hyperparams`` are copied from
the source with its weights.

An exploit is a fork (:meth:`Strategy.fork`): the engine moves the member onto its source's state
through the source unit's ``fork`` -- the mechanism stage trees branch with -- so it runs wherever
members can be forked: the in-process executor, fused or not, the process pool and Ray (the
population spread over the workers in lockstep; a source in another worker hands its state over,
through the driver or through Ray's ``storage=``). The trial keeps its id, number and ``sample`` (the hyperparameters
it started with); ``trial.schedule()`` gives what it trained with epoch by epoch, across the forks,
and ``trial.info["exploits"]`` whom it copied at which epoch. :func:`tridens.evaluators.replay`
retrains a schedule alone.

Members are the trials of one group (``Trial.group``), so a population re-run after a crash
(its trials interrupted, trained again from their start) exploits exactly as the first run did:
every choice is drawn from ``(seed, trial number, step)``. Nothing is stopped. When a population is
done, the next ``ask`` starts a new population of unseen samples, until the trial budget or the
space runs out (``budget=population``: one population).

>>> PBT(population=8, interval=2, max_steps=12).forks
True
"""

from __future__ import annotations

import math
import random
from typing import Any, Sequence

from ..space import Categorical, RandInt, SearchSpace
from ..trial import Fork, Trial, TrialGroup
from ._common import SearchBase, cap, check_float, check_int, derive_rng

__all__ = ["PBT"]


class PBT(SearchBase):
    """Population Based Training: exploit (copy a better member's state) and explore (perturb its
    hyperparameters) every ``interval`` steps; see the module docstring.

    >>> strategy = td.strategy.PBT(population=8, interval=2, hyperparams=["lr", "momentum"])  # doctest: +SKIP
    >>> exp = td.Experiment(space, evaluator, strategy, budget=8)                                  # doctest: +SKIP
    """

    forks = True

    def __init__(self, population: int = 8, interval: int = 1, max_steps: int | None = None,
                 quantile: float = 0.25, resample_probability: float = 0.25,
                 perturbation: Sequence[float] = (0.8, 1.2), hyperparams: Sequence[str] | None = None):
        self.population = population
        self.interval = interval
        self.max_steps = max_steps
        self.quantile = quantile
        self.resample_probability = resample_probability
        self.perturbation = perturbation
        self.hyperparams = hyperparams

    def _check(self) -> None:
        check_int("PBT", "population", self.population, 2)
        check_int("PBT", "interval", self.interval, 1)
        check_int("PBT", "max_steps", self.max_steps, 1, optional=True)
        check_float("PBT", "quantile", self.quantile, 0.0, 0.5, low_open=True)
        check_float("PBT", "resample_probability", self.resample_probability, 0.0, 1.0)
        factors = self.perturbation
        if (isinstance(factors, (str, bytes)) or not isinstance(factors, Sequence) or not factors
                or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors)):
            raise ValueError(f"The 'perturbation' parameter of PBT must be a non-empty list of positive factors. "
                             f"Got {factors!r} instead.")
        if self.hyperparams is not None and (isinstance(self.hyperparams, str)
                                             or not all(isinstance(h, str) for h in self.hyperparams)):
            raise ValueError(f"The 'hyperparams' parameter of PBT must be None or a list of labels. "
                             f"Got {self.hyperparams!r} instead.")

    def _setup(self) -> None:
        unknown = [h for h in self.hyperparams or () if h not in self.space]
        if unknown:
            raise ValueError(f"The 'hyperparams' parameter of PBT names {unknown[0]!r}, which is not a label of the "
                             f"searched space {sorted(self.space)!r}")
        self._scores: dict[tuple[Any, int], dict[int, float]] = {}   # (group, step) -> trial id -> score
        self._members: dict[int, Trial] = {}                          # running trials, by id
        self._answers: dict[tuple[int, int], Fork | None] = {}        # (trial id, step) -> the fork given

    # -- protocol ------------------------------------------------------------------------------
    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        self._require_started()
        return self._group(self._propose_random(cap(self.population, remaining)), "pbt", max_steps=self.max_steps)

    def report(self, trial: Trial, step: int, value: float) -> None:
        super().report(trial, step, value)
        self._members[trial.id] = trial
        self._scores.setdefault((trial.group, step), {})[trial.id] = self.objective.score(value)

    def fork(self, trial: Trial, step: int) -> Fork | None:
        """A member of the bottom quantile at an exploit step copies one of the top quantile."""
        if (trial.id, step) in self._answers:
            return self._answers[(trial.id, step)]
        answer = None
        if (step + 1) % self.interval == 0 and (self.max_steps is None or step + 1 < self.max_steps):
            answer = self._exploit(trial, step)
        self._answers[(trial.id, step)] = answer
        return answer

    def _observe(self, trial: Trial, key: str | None) -> None:
        self._members.pop(trial.id, None)

    # -- exploit and explore ------------------------------------------------------------------------
    def _exploit(self, trial: Trial, step: int) -> Fork | None:
        scores = self._scores.get((trial.group, step), {})
        n = len(scores)
        k = min(n // 2, math.ceil(n * self.quantile))
        if k < 1 or trial.id not in scores:
            return None
        ranked = sorted(scores, key=lambda tid: (-scores[tid], tid))
        if trial.id not in ranked[n - k:]:
            return None
        rng = derive_rng(self._seed, "exploit", trial.label, step)
        source = rng.choice(ranked[:k])
        # what the source trains with now: its sample, or the last stage of its recorded lineage
        current = self._members[source].schedule().stages[-1].sample if source in self._members else self._samples[source]
        return Fork(source, self._explore(current, rng))

    def _explore(self, sample: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        """``sample`` with each explored label resampled or moved (see the module docstring)."""
        space: SearchSpace = self.space
        out = dict(sample)
        for label in self.hyperparams if self.hyperparams is not None else list(space):
            if label not in out:
                continue
            domain = space[label].domain
            if rng.random() < self.resample_probability:
                out[label] = domain.sample(rng)
            else:
                out[label] = _moved(domain, out[label], rng, self.perturbation)
        for spec in space.values():  # a conditional label follows its parents
            if spec.active(out):
                if spec.label not in out:
                    out[spec.label] = spec.domain.sample(rng)
            else:
                out.pop(spec.label, None)
        return space.validate(out)


def _moved(domain: Any, value: Any, rng: random.Random, factors: Sequence[float]) -> Any:
    """A neighbouring candidate of a choice, or the number times a factor within its bounds."""
    if isinstance(domain, Categorical):
        values = domain.values()
        index = next((i for i, v in enumerate(values) if v == value), 0)
        return values[min(max(index + rng.choice((-1, 1)), 0), len(values) - 1)]
    factor = rng.choice(list(factors))
    if isinstance(domain, RandInt):
        return int(min(max(round(value * factor), domain.low), domain.high))
    return float(min(max(value * factor, domain.low), domain.high))
