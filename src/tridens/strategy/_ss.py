"""SS, the sub-sampling bandit for hyperparameter evaluation (Huang et al., "An Asymptotically
Optimal Multi-Armed Bandit Algorithm and Hyperparameter Optimization", arXiv 2007.05670; MLSys
2022 as "Improving Model Training with Multi-fidelity Hyperparameter Evaluation").

The rule. A configuration's observations are its per-step values of the objective (scores,
higher is better), one per epoch trained. The **leader** is the configuration with the most
observations so far, over the whole search (ties: the higher mean, then the earlier trial). A
challenger ``k`` with ``n`` observations **beats the leader** when the mean of its ``n``
observations is at least the mean of *some* ``n`` contiguous observations of the leader
(:func:`beats_leader`). Since learning curves rise, the leader's weakest stretch is usually its
first ``n`` epochs: a challenger goes on when it learns at least as well as the best-explored
configuration did over the same length of training, not when its last value beats the leader's
last value. Winners train on at the next budget; when nobody wins, the leader does.

How tridens runs it (where this differs from the paper, and why):

* **Brackets and budgets.** :class:`SS` keeps Hyperband's brackets and rung budgets (one bracket
  = one TrialGroup, rungs at ``R // eta**(s - i)``), as the paper's HPO version and Huawei vega's
  ``ssa.py`` do. At a rung the SS rule picks who continues instead of the top ``1/eta``.
* **Stop, not pause.** tridens' strategies continue or stop a trial; a stopped trial is never
  resumed. In the bandit a losing challenger waits and can win a later round; here it is stopped,
  and the forced-exploration term, which in the bandit revives under-explored arms (``n_k <
  c_r``), becomes a minimum: in a bracket of ``n`` configurations every trial keeps training
  through the first ``c_n - 1`` rungs, ``c_n = floor(sqrt(log(n * eta / (eta - 1))))`` (vega's
  choice; 1 for brackets up to 36 configurations at ``eta = 3``, so it rarely acts).
* **Every winner, and at least a Hyperband rung.** As in the paper, every challenger that beats
  the leader continues (and so does the leader, when it is in the rung). Taken literally with stopping,
  "nobody wins, so only the leader goes on" would end every rung with one trial: inside a
  bracket all members of a rung have as many observations as each other, so when the leader is
  among them a challenger's only stretch of the leader is its whole curve, and later brackets
  meet a leader trained to the full budget whose early epochs few beat. The paper's version for
  high GPU usage keeps the devices busy instead, and vega trains Hyperband's number at every
  rung; here a rung of ``m`` trials keeps the winners **and at least** ``max(1, m // eta)``: when
  fewer win, the rung is filled by the members closest to winning, i.e. with the highest mean
  (the duel's statistic; all of them face the same stretch of the leader). A bracket therefore
  never trains fewer trials per rung than Hyperband's.
* **One leader for the whole search**, not one per bracket as when BOSS calls SS on each
  bracket: a bracket's own leader sits in the rung with as many observations as its
  challengers, so the duel could never be won; the search's best-explored configuration gives
  the rung a reference it can beat.
* **Mean of the observations**, as in the paper, is what a challenger is judged by and what fills
  the rung (vega ranks by the last value). On rising learning curves the mean weighs the first
  epochs as much as the last, so it ranks configurations that start slowly but end well lower
  than Hyperband's last value does (on ``bench/data/digits-mlp``, Spearman against the final
  accuracy after 9 of 27 epochs: 0.83 for the mean, 0.89 for the last value); the paper's
  analysis assumes observations drawn from one distribution per arm, which a learning curve is
  not.

With a user training loop (trials one after another) a rung's decision is due before the rung
is complete; then :class:`AsyncSS`'s rule applies, as Hyperband falls back to ASHA's.

:class:`AsyncSS` is to SS what ASHA is to successive halving: no waiting for a full round. When
a trial reaches a rung, it is compared at once with what exists at that moment: it continues if
(a) it beats the *current* leader -- the trial with the most observations at that moment,
possibly one still training, which makes the comparison against the leader's weakest stretch of
the same length a fair one however far ahead the leader is -- or (b) its mean is in the top
``1/eta`` of the means the rung has recorded so far (ASHA's quota: at most ``(m - 1) / eta`` of
the ``m`` recorded means strictly better), the asynchronous "at least a Hyperband rung". Nothing
waits for other trials, so it suits executors that train trials in parallel and report them in
any order.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..trial import Decision, Objective, Trial, TrialGroup
from ._asha import ASHA
from ._common import cap, sample_key
from ._hyperband import Hyperband, _Bracket

__all__ = ["SS", "AsyncSS", "beats_leader", "forced_rungs"]


def beats_leader(challenger: Sequence[float], leader: Sequence[float]) -> bool:
    """Does the mean of ``challenger``'s observations reach the mean of some contiguous,
    equally long stretch of ``leader``'s? Scores: higher is better.

    >>> beats_leader([0.5, 0.7], [0.4, 0.8, 0.9])     # 0.6 >= mean(0.4, 0.8)
    True
    >>> beats_leader([0.5, 0.55], [0.6, 0.8, 0.9])
    False
    """
    n = len(challenger)
    if n == 0 or len(leader) < n:
        return False
    mine = _mean(challenger)
    window = sum(leader[:n])
    lowest = window
    for j in range(n, len(leader)):
        window += leader[j] - leader[j - n]
        lowest = min(lowest, window)
    return mine >= lowest / n - 1e-12


def forced_rungs(n: int, eta: int) -> int:
    """Rungs through which every trial of a bracket of ``n`` keeps training (``c_n - 1``).

    >>> forced_rungs(27, 3), forced_rungs(81, 3)
    (0, 1)
    """
    if n < 1:
        return 0
    return max(int(math.sqrt(math.log(n * eta / (eta - 1)))), 1) - 1


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else -math.inf


class _Leader:
    """The trial with the most observations (ties: higher mean, then lower id), kept up to date
    as curves grow: a trial's count only grows, so only the trial just updated can overtake."""

    def __init__(self) -> None:
        self.stats: dict[int, tuple[int, float]] = {}    # trial id -> (observations, sum of scores)
        self.best: int | None = None

    def _rank(self, tid: int) -> tuple[int, float, int]:
        n, total = self.stats[tid]
        return n, (total / n if n else -math.inf), -tid

    def update(self, tid: int, scores: Sequence[float]) -> None:
        replaced = tid in self.stats and len(scores) < self.stats[tid][0]
        self.stats[tid] = (len(scores), float(sum(scores)))
        if replaced and tid == self.best:  # a shorter curve than before (a history record): recompute
            self.best = max(self.stats, key=self._rank)
        elif self.best is None or self._rank(tid) > self._rank(self.best):
            self.best = tid


class _SubSampling:
    """What SS and AsyncSS share: scores per trial, the leader, the duel. The strategy it is mixed
    into holds the curves, the objective and the leader."""

    _curves: dict[int, list[float]]
    objective: Objective
    _leader: _Leader

    def _scores(self, tid: int, upto: int | None = None) -> list[float]:
        curve = self._curves.get(tid, [])
        curve = curve if upto is None else curve[:upto]
        return [self.objective.score(v) for v in curve]

    def _track(self, tid: int) -> None:
        self._leader.update(tid, self._scores(tid))

    def _wins(self, tid: int, budget: int) -> bool:
        """Does trial ``tid``, after ``budget`` steps, beat the leader's sub-samples (or lead)?"""
        leader = self._leader.best
        if leader is None or leader == tid:
            return True
        return beats_leader(self._scores(tid, budget), self._scores(leader))


class SS(_SubSampling, Hyperband):
    """Sub-sampling (SS) in Hyperband's brackets, random proposals; see the module docstring.

    ``max_steps`` (required), ``min_steps`` and ``reduction_factor`` (``eta``) as in
    :class:`Hyperband`; :meth:`schedule` lists the brackets.

    >>> SS(max_steps=27).schedule()[0]
    (27, [1, 3, 9, 27])
    """

    _kind = "ss"

    def _setup(self) -> None:
        super()._setup()
        self._leader = _Leader()

    def report(self, trial: Trial, step: int, value: float) -> None:
        super().report(trial, step, value)
        self._track(trial.id)

    def _observe(self, trial: Trial, key: str | None) -> None:
        super()._observe(trial, key)
        self._track(trial.id)

    def _mean_at(self, key: str, budget: int) -> float | None:
        tid = self._ids.get(key)
        curve = self._curves.get(tid, []) if tid is not None else []
        if len(curve) < budget:
            return None
        return _mean(self._scores(tid, budget))  # type: ignore[arg-type]

    def _decide_rung(self, bracket: _Bracket, i: int, key: str) -> None:
        budget = bracket.budgets[i]
        decided = bracket.decisions[i]
        members = bracket.rung(i)
        if key not in members:
            decided[key] = Decision.STOP
            return
        means = {k: v for k in members if (v := self._mean_at(k, budget)) is not None}
        if i < forced_rungs(len(bracket.members), self.reduction_factor):
            decided[key] = Decision.CONTINUE  # forced exploration
            return
        previous_closed = i == 0 or all(k in bracket.decisions[i - 1] or self._finished(k)
                                        for k in bracket.rung(i - 1))
        if not decided and previous_closed and all(k in means or self._finished(k) for k in members):
            order = {k: j for j, k in enumerate(members)}
            ranked = sorted(means, key=lambda k: (-means[k], order[k]))
            winners = {k for k in ranked if self._wins(self._ids[k], budget)}  # the leader wins
            keep = winners | set(ranked[:max(1, len(means) // self.reduction_factor)])
            for k in ranked:
                decided[k] = Decision.CONTINUE if k in keep else Decision.STOP
            return
        decided[key] = _async_decision(means, key, self.reduction_factor,
                                       self._wins(self._ids[key], budget))


def _async_decision(means: dict[str, float], key: str, eta: int, wins: bool) -> Decision:
    """AsyncSS's rule for ``key`` given the means its rung has recorded so far: a winner of the
    duel continues, and so does a trial within ASHA's quota."""
    mine = means[key]
    better = sum(1 for v in means.values() if v > mine)
    in_quota = better <= (len(means) - 1) / eta
    return Decision.CONTINUE if wins or in_quota else Decision.STOP


class AsyncSS(_SubSampling, ASHA):
    """Asynchronous sub-sampling: ASHA's rungs and groups, SS's duel against the leader (see the
    module docstring for how a promotion is decided without a full round).

    Parameters as :class:`ASHA` (``min_steps``, ``max_steps``, ``reduction_factor``, ``brackets``,
    ``min_trials``, ``batch_size``).

    >>> AsyncSS(max_steps=27).rungs()
    [1, 3, 9]
    """

    def _setup(self) -> None:
        super()._setup()
        self._leader = _Leader()
        self._id_of: dict[str, int] = {}

    def ask(self, remaining: int | None = None) -> TrialGroup | None:
        self._require_started()
        samples = self._propose_random(cap(self.batch_size, remaining))
        for sample in samples:
            self._bracket_of(sample_key(sample))
        return self._group(samples, "async-ss", max_steps=self.max_steps)

    def report(self, trial: Trial, step: int, value: float) -> None:
        key = self._key_of(trial)
        if key is not None:
            self._id_of.setdefault(key, trial.id)
        super().report(trial, step, value)
        self._track(trial.id)

    def _observe(self, trial: Trial, key: str | None) -> None:
        if key is not None:
            self._id_of.setdefault(key, trial.id)
        super()._observe(trial, key)
        self._track(trial.id)

    def _record(self, key: str, curve: Sequence[float], upto: int | None = None) -> None:
        """A rung records the mean score of a trial's first ``budget`` steps."""
        b = self._bracket_of(key)
        for budget in self._rung_budgets[b]:
            if len(curve) >= budget and (upto is None or budget == upto):
                scores = [self.objective.score(v) for v in curve[:budget]]
                self._recorded.setdefault((b, budget), {})[key] = _mean(scores)

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
            decision = _async_decision(rung, key, self.reduction_factor, self._wins(trial.id, budget))
            if decision is Decision.STOP:
                self._stopped.add(key)
        self._decisions[(key, budget)] = decision
        return decision
