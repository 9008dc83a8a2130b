"""ASHA, asynchronous successive halving (Li et al., MLSys 2020), stopping variant.

Groups are batches of ``batch_size`` random samples, each with ``max_steps`` steps. Rungs sit at
the budgets ``min_steps * eta**(b + k) < max_steps`` (``b`` the trial's bracket, ``k = 0, 1, ...``).
When a trial reaches a rung, its value is recorded there; at the end of that step it continues
if it is in the top ``1/eta`` of every value the rung has recorded so far (its own included),
precisely: if at most ``(n - 1) / eta`` of the rung's ``n`` values are strictly better, else it is
stopped. There is no waiting for a rung to fill, which is what makes it asynchronous: with a
user training loop (one trial at a time) it decides with what it has seen so far, and in lockstep
it sees the whole group's values first. Trials are never restarted ("promoted" from a checkpoint),
they continue, as in Ray Tune's ``ASHAScheduler``.

``min_trials``: a rung stops nothing until it has recorded that many values (Optuna's
``bootstrap_count``); ``brackets``: trials are dealt round-robin to ``brackets`` brackets whose
first rung is ``eta**b`` times later, as in Ray Tune.
"""

from __future__ import annotations

from typing import Sequence

from ..trial import Decision, Trial, TrialGroup
from ._common import SearchBase, cap, check_int, check_order, sample_key

__all__ = ["ASHA"]


class ASHA(SearchBase):
    """Asynchronous successive halving with random proposals (see the module docstring)."""

    def __init__(self, min_steps: int = 1, max_steps: int | None = None, reduction_factor: int = 3,
                 brackets: int = 1, min_trials: int = 1, batch_size: int = 8):
        self.min_steps = min_steps
        self.max_steps = max_steps
        self.reduction_factor = reduction_factor
        self.brackets = brackets
        self.min_trials = min_trials
        self.batch_size = batch_size

    def _check(self) -> None:
        check_int("ASHA", "min_steps", self.min_steps, 1)
        check_int("ASHA", "max_steps", self.max_steps, 1)
        check_int("ASHA", "reduction_factor", self.reduction_factor, 2)
        check_int("ASHA", "brackets", self.brackets, 1)
        check_int("ASHA", "min_trials", self.min_trials, 1)
        check_int("ASHA", "batch_size", self.batch_size, 1)
        assert self.max_steps is not None   # check_int refused None
        check_order("ASHA", "min_steps", self.min_steps, "max_steps", self.max_steps)

    def rungs(self, bracket: int = 0) -> list[int]:
        """The budgets (in steps) at which trials of ``bracket`` can be stopped.

        >>> ASHA(max_steps=27).rungs()
        [1, 3, 9]
        """
        self._check()
        out, budget = [], self.min_steps * self.reduction_factor ** bracket
        while budget < self.max_steps:
            out.append(budget)
            budget *= self.reduction_factor
        return out

    def as_stopping(self) -> "ASHA":
        """As another strategy's ``stopping=`` policy (``td.strategy.TPE(stopping=ASHA())``), ASHA's
        rungs judge that strategy's trials, dealt to brackets in the order they first report."""
        return self

    def _setup(self) -> None:
        self._bracket: dict[str, int] = {}                    # sample key -> bracket
        self._rung_budgets = [set(self.rungs(b)) for b in range(self.brackets)]
        self._recorded: dict[tuple[int, int], dict[str, float]] = {}   # (bracket, budget) -> key -> score
        self._decisions: dict[tuple[str, int], Decision] = {}
        self._stopped: set[str] = set()

    def _bracket_of(self, key: str) -> int:
        if key not in self._bracket:  # a trial we did not propose (or from the history)
            self._bracket[key] = len(self._bracket) % self.brackets
        return self._bracket[key]

    def _record(self, key: str, curve: Sequence[float], upto: int | None = None) -> None:
        b = self._bracket_of(key)
        for budget in self._rung_budgets[b]:
            if len(curve) >= budget and (upto is None or budget == upto):
                self._recorded.setdefault((b, budget), {})[key] = self.objective.score(curve[budget - 1])

    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        self._require_started()
        samples = self._propose_random(cap(self.batch_size, remaining))
        for sample in samples:
            self._bracket_of(sample_key(sample))
        return self._group(samples, "asha", max_steps=self.max_steps)

    def report(self, trial: Trial, step: int, value: float) -> None:
        super().report(trial, step, value)
        key = self._key_of(trial)
        if key is not None:
            self._record(key, self._curves[trial.id], upto=step + 1)

    def _observe(self, trial: Trial, key: str | None) -> None:
        if key is not None:
            self._record(key, self._curves.get(trial.id, []))

    def decide(self, trial: Trial, step: int) -> Decision:
        key = self._key_of(trial)
        if key is None:
            return Decision.CONTINUE
        if key in self._stopped:
            return Decision.STOP
        b, budget = self._bracket_of(key), step + 1
        if budget not in self._rung_budgets[b]:
            return Decision.CONTINUE
        if (key, budget) in self._decisions:
            return self._decisions[(key, budget)]
        rung = self._recorded.get((b, budget), {})
        if key not in rung:
            return Decision.CONTINUE  # asked before its value arrived
        decision = Decision.CONTINUE
        if len(rung) >= self.min_trials:
            mine = rung[key]
            better = sum(1 for v in rung.values() if v > mine)
            if better > (len(rung) - 1) / self.reduction_factor:
                decision = Decision.STOP
                self._stopped.add(key)
        self._decisions[(key, budget)] = decision
        return decision
