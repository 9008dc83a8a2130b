"""Regularized (aging) evolution, Real et al., "Regularized Evolution for Image Classifier
Architecture Search" (AAAI 2019)."""

from __future__ import annotations

import random
from typing import Any

from ..trial import Trial, TrialGroup
from ._base import Strategy
from ._common import SearchBase, cap, check_bool, check_float, check_int, final_value, sample_key

__all__ = ["RegularizedEvolution"]

_MUTATION_ATTEMPTS = 32


class RegularizedEvolution(SearchBase):
    """Tournament selection with aging.

    First ``population`` random samples (one group, ``evolution-init``). Then each group (a
    generation of ``batch_size`` children) is made by, for every child: drawing ``sample_size``
    members of the population at random, taking the best as the parent, and mutating it: each
    active label is re-drawn (to a different value) with probability ``mutation_prob``, at least
    one label always. Conditional labels follow the child: labels that become inactive are
    dropped, labels that become active are drawn at random. The population is the ``population``
    youngest trials (highest ids) that finished with a value, so the oldest dies as a child
    arrives. Failed and duplicate trials never join it; the initial phase lasts until
    ``population`` trials have a value, so failures are replaced by fresh random samples.

    A child that repeats an earlier sample is mutated again (then replaced by a random sample),
    so no sample is proposed twice. :meth:`parent_of` gives the trial a child was mutated from.

    With ``inherit_weights=True`` each generation's group names every child's parent
    (``TrialGroup.parents``): a child starts from its parent's trained weights for the layers
    they share (matched through the graph IR; the others keep their initialisation), and children
    of one parent in a generation train merged in one super-graph, their shared layers stored
    once (:mod:`tridens.xopt._supergraph`). The trial records its ``parent`` and, in
    ``info["inherit"]``, what it inherited.

    ``stopping``: a rule that stops running trials early (:class:`ASHA`, :class:`Hyperband`,
    :class:`MedianStopping`); a stopped trial joins the population with its last value.

    >>> strategy = td.strategy.RegularizedEvolution(population=8, inherit_weights=True)  # doctest: +SKIP
    """

    def __init__(self, population: int = 20, sample_size: int = 5, mutation_prob: float = 0.05,
                 batch_size: int = 4, inherit_weights: bool = False, stopping: Strategy | None = None):
        self.population = population
        self.sample_size = sample_size
        self.mutation_prob = mutation_prob
        self.batch_size = batch_size
        self.inherit_weights = inherit_weights
        self.stopping = stopping

    def _check(self) -> None:
        name = "RegularizedEvolution"
        check_int(name, "population", self.population, 2)
        check_int(name, "sample_size", self.sample_size, 1, self.population, high_text=f"population={self.population}")
        check_float(name, "mutation_prob", self.mutation_prob, 0.0, 1.0)
        check_int(name, "batch_size", self.batch_size, 1)
        check_bool(name, "inherit_weights", self.inherit_weights)

    def _setup(self) -> None:
        self._scored: dict[int, float] = {}   # trial id -> score (maximized), trials with a value
        self._parents: dict[str, int] = {}    # child sample key -> parent trial id

    def _observe(self, trial: Trial, key: str | None) -> None:
        value = final_value(trial, self.objective)
        if value is not None and key is not None:
            self._scored[trial.id] = self.objective.score(value)

    def parent_of(self, sample: dict[str, Any]) -> int | None:
        """The id of the trial ``sample`` was mutated from (``None`` for random samples)."""
        return self._parents.get(sample_key(sample))

    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        self._require_started()
        filling = len(self._scored) + len(self._pending)
        if filling < self.population:
            return self._group(self._propose_random(cap(self.population - filling, remaining)), "evolution-init")
        samples = []
        for _ in range(cap(self.batch_size, remaining)):
            child = self._child(self._rng("child"))
            if child is None:
                break
            samples.append(self._accept(child))
        group = self._group(samples, "evolution")
        if group is not None and self.inherit_weights:
            group.parents = [self.parent_of(sample) for sample in samples]
        return group

    # -- internals ---------------------------------------------------------------------------

    def _child(self, rng: random.Random) -> dict[str, Any] | None:
        members = sorted(self._scored)[-self.population:]
        if not members:  # asked again before any of the initial population finished
            return self._random_unseen(rng)
        contestants = rng.sample(members, min(self.sample_size, len(members)))
        parent_id = max(contestants, key=lambda tid: (self._scored[tid], tid))
        parent = self.space.validate(self._trials[parent_id].sample)
        for _ in range(_MUTATION_ATTEMPTS):
            child = self._mutate(parent, rng)
            # a child breaking one of the space's sample rules (a cell's edge budget) is drawn again
            if child is not None and self._is_new(child) and self.space.violation(child) is None:
                self._parents[sample_key(child)] = parent_id
                return child
        return self._random_unseen(rng)

    def _mutate(self, parent: dict[str, Any], rng: random.Random) -> dict[str, Any] | None:
        mutable = [label for label in parent
                   if not self.space[label].domain.finite or self.space[label].domain.size() > 1]
        if not mutable:
            return None
        chosen = {label for label in mutable if rng.random() < self.mutation_prob}
        if not chosen:
            chosen = {rng.choice(mutable)}
        child: dict[str, Any] = {}
        for label, spec in self.space.items():
            if not spec.active(child):
                continue
            if label in chosen:
                child[label] = _redraw(spec.domain, parent[label], rng)
            elif label in parent:
                child[label] = parent[label]
            else:  # newly active under the child's values
                child[label] = spec.domain.sample(rng)
        return self.space.validate(child)


def _redraw(domain: Any, current: Any, rng: random.Random) -> Any:
    """A value of ``domain`` other than ``current`` (for continuous domains: a fresh draw)."""
    if domain.finite and domain.size() <= 1024:
        others = [v for v in domain.values() if v != current or type(v) is not type(current)]
        return rng.choice(others) if others else current
    for _ in range(_MUTATION_ATTEMPTS):
        value = domain.sample(rng)
        if value != current:
            return value
    return value
