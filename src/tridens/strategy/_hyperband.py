"""Hyperband (Li et al., JMLR 2018), synchronous successive halving in brackets.

How brackets map to TrialGroups. With ``R = max_steps``, ``r = min_steps`` and
``eta = reduction_factor``, ``s_max`` is the largest ``s`` with ``r * eta**s <= R``. Bracket ``s``
(``s_max`` down to 0, then again) is **one TrialGroup** of ``n = ceil((s_max + 1) / (s + 1) * eta**s)``
samples with ``max_steps = R``. Its rungs are the budgets ``R // eta**(s - i)`` for ``i = 0..s``
(the last one is ``R``). Trials train continuously, never restarted from a checkpoint: at the end
of step ``budget - 1`` of rung ``i`` (steps are 0-based epochs) :meth:`decide` keeps the best
``floor(n_i / eta)`` of the ``n_i`` trials in the rung and stops the others, which is Hyperband's
"train the survivors on ``eta`` times the budget" done as stop decisions. Bracket ``s = 0`` trains
its trials to ``R`` without stopping.

Lockstep or one at a time. When the engine trains a group in lockstep it reports every trial's
value at a rung before asking any decision there, and the whole rung is ranked at once (exact
Hyperband). With a user training loop trials run one after another, so a decision is due before
the rung is complete; then a trial continues if its value is in the top ``1/eta`` of the values
the rung has seen so far (ASHA's rule: at most ``(n - 1) / eta`` of the ``n`` values strictly
better). That keeps about the same fraction in expectation, but not exactly ``floor(n_i / eta)``:
a quota would stop good trials only for arriving late.

A duplicate or failed trial is one fewer in its rung; the bracket is not refilled (the next
group is a new bracket). Resuming: the groups of the history (by ``Trial.group``) are the
brackets already run; the next group is the bracket that follows them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..trial import Decision, Trial, TrialGroup
from ._base import Strategy
from ._common import SearchBase, cap, check_int, check_order, sample_key

__all__ = ["Hyperband"]


@dataclass
class _Bracket:
    index: int
    s: int
    budgets: list[int]                      # rung budgets (steps), ascending, last = max_steps
    members: list[str]                      # sample keys, proposal order
    decisions: list[dict[str, Decision]] = field(default_factory=list)   # per rung: key -> decision

    def __post_init__(self) -> None:
        self.decisions = [{} for _ in self.budgets[:-1]]

    def rung(self, i: int) -> list[str]:
        if i == 0:
            return list(self.members)
        return [k for k in self.members if self.decisions[i - 1].get(k) is Decision.CONTINUE]


class Hyperband(SearchBase):
    """Hyperband with random proposals; see the module docstring for the bracket/group mapping.

    ``max_steps`` (required) is the largest number of steps (epochs) a trial trains, ``min_steps``
    the smallest budget a trial gets before it can be stopped, ``reduction_factor`` (``eta``) the
    fraction ``1/eta`` kept at every rung. Runs bracket after bracket until the engine's trial
    budget is spent or a finite space is exhausted. :meth:`schedule` lists the brackets.
    """

    _kind = "hyperband"

    def __init__(self, min_steps: int = 1, max_steps: int | None = None, reduction_factor: int = 3):
        self.min_steps = min_steps
        self.max_steps = max_steps
        self.reduction_factor = reduction_factor

    def _check(self) -> None:
        name = type(self).__name__
        check_int(name, "min_steps", self.min_steps, 1)
        check_int(name, "max_steps", self.max_steps, 1)
        check_int(name, "reduction_factor", self.reduction_factor, 2)
        assert self.max_steps is not None   # check_int refused None
        check_order(name, "min_steps", self.min_steps, "max_steps", self.max_steps)

    # -- the plan --------------------------------------------------------------------------------

    def _s_max(self) -> int:
        s = 0
        while self.min_steps * self.reduction_factor ** (s + 1) <= self.max_steps:
            s += 1
        return s

    def _plan(self, index: int) -> tuple[int, int, list[int]]:
        """(s, number of trials, rung budgets) of the ``index``-th bracket."""
        eta, s_max = self.reduction_factor, self._s_max()
        s = s_max - index % (s_max + 1)
        n = -(-(s_max + 1) * eta ** s // (s + 1))
        budgets = [self.max_steps // eta ** (s - i) for i in range(s + 1)]
        return s, n, budgets

    def schedule(self) -> list[tuple[int, list[int]]]:
        """One Hyperband iteration: (trials, rung budgets) of each bracket, most aggressive first.

        >>> Hyperband(max_steps=9).schedule()
        [(9, [1, 3, 9]), (5, [3, 9]), (3, [9])]
        """
        self._check()
        return [self._plan(i)[1:] for i in range(self._s_max() + 1)]

    def as_stopping(self) -> Strategy:
        """As another strategy's ``stopping=`` policy, Hyperband is what Optuna's ``HyperbandPruner``
        is: one asynchronous successive halving per bracket, bracket ``b``'s first rung at
        ``min_steps * eta**b``, trials dealt to the ``s_max + 1`` brackets in turn -- an
        :class:`ASHA` with that many brackets. Its own brackets are groups it proposes, which a
        stopping rule does not."""
        from ._asha import ASHA

        self._check()
        return ASHA(min_steps=self.min_steps, max_steps=self.max_steps, reduction_factor=self.reduction_factor,
                    brackets=self._s_max() + 1)

    # -- protocol ------------------------------------------------------------------------------

    def _setup(self) -> None:
        self._next_bracket = 0
        self._bracket_of: dict[str, _Bracket] = {}
        self._ids: dict[str, int] = {}  # sample key -> trial id, once the engine made the trial

    def _resumed(self, history: Sequence[Trial]) -> None:
        groups = {t.group for t in history if t.group is not None}
        self._next_bracket = len(groups)
        loose = sum(1 for t in history if t.group is None)  # an engine that did not record groups
        while loose > 0:
            loose -= self._plan(self._next_bracket)[1]
            self._next_bracket += 1

    def _propose(self, n: int) -> list[dict[str, Any]]:
        return self._propose_random(n)

    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        self._require_started()
        s, n, budgets = self._plan(self._next_bracket)
        samples = self._propose(cap(n, remaining))
        if not samples:
            return None
        bracket = _Bracket(self._next_bracket, s, budgets, [sample_key(x) for x in samples])
        for key in bracket.members:
            self._bracket_of[key] = bracket
        self._next_bracket += 1
        return TrialGroup(samples, max_steps=self.max_steps, name=f"{self._kind}-{bracket.index}-s{s}")

    def report(self, trial: Trial, step: int, value: float) -> None:
        super().report(trial, step, value)
        key = self._key_of(trial)
        if key is not None:
            self._ids.setdefault(key, trial.id)

    def _observe(self, trial: Trial, key: str | None) -> None:
        if key is not None:
            self._ids.setdefault(key, trial.id)

    def decide(self, trial: Trial, step: int) -> Decision:
        key = self._key_of(trial)
        bracket = self._bracket_of.get(key) if key is not None else None
        if key is None or bracket is None:
            return Decision.CONTINUE
        self._ids.setdefault(key, trial.id)
        if any(d.get(key) is Decision.STOP for d in bracket.decisions):
            return Decision.STOP
        budgets = bracket.budgets[:-1]
        if step + 1 not in budgets:
            return Decision.CONTINUE
        i = budgets.index(step + 1)
        if key not in bracket.decisions[i] and self._value(key, step + 1) is None:
            return Decision.CONTINUE  # asked before its value arrived: nothing to judge yet
        if key not in bracket.decisions[i]:
            self._decide_rung(bracket, i, key)
        return bracket.decisions[i][key]

    # -- rungs -----------------------------------------------------------------------------------

    def _value(self, key: str, budget: int) -> float | None:
        """The objective's score (higher is better) of ``key`` after ``budget`` steps."""
        curve = self._curves.get(self._ids.get(key, -1))
        if not curve or len(curve) < budget:
            return None
        return self.objective.score(curve[budget - 1])

    def _finished(self, key: str) -> bool:
        tid = self._ids.get(key)
        return tid is not None and tid in self._trials

    def _decide_rung(self, bracket: _Bracket, i: int, key: str) -> None:
        budget = bracket.budgets[i]
        decided = bracket.decisions[i]
        members = bracket.rung(i)
        if key not in members:
            decided[key] = Decision.STOP
            return
        scores = {k: v for k in members if (v := self._value(k, budget)) is not None}
        previous_closed = i == 0 or all(k in bracket.decisions[i - 1] or self._finished(k)
                                        for k in bracket.rung(i - 1))
        if not decided and previous_closed and all(k in scores or self._finished(k) for k in members):
            # the whole rung is in before its first decision: rank it (synchronous Hyperband)
            keep = max(1, len(scores) // self.reduction_factor)
            order = {k: j for j, k in enumerate(members)}
            ranked = sorted(scores, key=lambda k: (-scores[k], order[k]))
            for rank, k in enumerate(ranked):
                decided[k] = Decision.CONTINUE if rank < keep else Decision.STOP
            return
        # a decision is due before the rung is complete (one trial at a time): ASHA's rule
        mine = scores[key]
        better = sum(1 for v in scores.values() if v > mine)
        decided[key] = Decision.CONTINUE if better <= (len(scores) - 1) / self.reduction_factor else Decision.STOP
