"""The one interface every multi-trial strategy implements."""

from __future__ import annotations

import random
from typing import Any, Sequence

from ..space import SearchSpace
from ..trial import Decision, Fork, Objective, Trial, TrialGroup

__all__ = ["Strategy"]


class Strategy:
    """Decides which samples to train next and whether a running trial continues.

    The engine drives a strategy like this::

        strategy.start(search_space, objective, rng, history)   # history: finished trials (resume)
        while (group := strategy.ask(remaining)) is not None:
            for each trial of the group, for each step (epoch):
                strategy.report(trial, step, value)               # intermediate objective value
                if strategy.decide(trial, step) is Decision.STOP: stop that trial
            strategy.tell(trial)                                  # every finished trial, any status

    When a group's trials train in lockstep, the engine reports every trial's value for a step
    before asking any decision for that step, so synchronous rules (Hyperband rungs) see the
    whole rung. ``ask`` returns ``None`` when the strategy is finished, and must return a
    non-empty group otherwise. Constructors only store parameters; ``start`` validates them.

    What the engine guarantees (the strategies' determinism and resume rely on it): one Trial
    per sample of a group, in the group's order, with increasing ids; every trial told exactly
    once, including DUPLICATE ones and ones FAILED by a constraint before training; the trials
    of one group share ``Trial.group`` and other groups' trials have other values (Hyperband
    finds its brackets in a history that way); ``Trial.metrics[objective.metric]`` holds the
    values that were reported, one per step. Strategies identify trials by their sample: a
    strategy never proposes the same sample twice.

    A strategy whose ``forks`` is True may also answer :meth:`fork` after a step a trial
    continues: the engine then moves that trial onto another running trial's state with new
    hyperparameters (Population Based Training); the engine refuses such a strategy on an
    executor that cannot fork members. ``finite``: the strategy proposes a bounded number of
    samples by itself (a grid), so a run without a budget ends on its own.
    """

    forks = False
    finite = False

    def start(self, space: SearchSpace, objective: Objective, rng: random.Random,
              history: Sequence[Trial] = ()) -> None:
        """Begin (or resume) a search. ``history`` holds the finished trials of an earlier run,
        in id order; a strategy rebuilds its state from them (by default, by ``tell``-ing each)."""
        self.space, self.objective, self.rng = space, objective, rng
        for trial in history:
            self.tell(trial)

    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        """The next group of samples, at most ``remaining`` of them; ``None`` when done."""
        raise NotImplementedError

    def objective_named(self, objective: Objective) -> None:
        """The first report named the objective (a user's loop reporting dicts: their first key),
        before any trial was told: ``Trial.metrics[objective.metric]`` holds its values from now on.
        Default: ``self.objective = objective``."""
        self.objective = objective

    def report(self, trial: Trial, step: int, value: float) -> None:
        """An intermediate value of the objective for ``trial`` after ``step`` (0-based)."""

    def decide(self, trial: Trial, step: int) -> Decision:
        """Continue or stop ``trial`` after ``step``. Default: always continue."""
        return Decision.CONTINUE

    def fork(self, trial: Trial, step: int) -> Fork | None:
        """Asked after ``decide`` let ``trial`` continue past ``step``: a :class:`Fork` moves it onto
        a running trial's state (weights, optimizer state) with new hyperparameters; ``None``
        (the default) lets it go on as it is."""
        return None

    def tell(self, trial: Trial) -> None:
        """``trial`` finished (completed, stopped, failed or duplicate)."""

    def as_stopping(self) -> Strategy | None:
        """The rule this strategy applies when it is another strategy's ``stopping=`` policy
        (Optuna's pruner beside a sampler): a strategy whose ``report``/``decide``/``tell`` judge
        trials it did not propose, and whose ``ask`` is never called. ``None`` (the default): this
        strategy stops nothing on its own."""
        return None

    def params(self) -> dict[str, Any]:
        """The constructor's parameters (for the store, as JSON)."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and k not in ("space", "objective", "rng")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"
