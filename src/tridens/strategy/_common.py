"""Machinery shared by tridens' strategies: parameter checks, seeded randomness, bookkeeping.

Not part of the protocol (see :mod:`._base`); a third-party strategy need not use it.

Determinism and resume. A strategy draws one 64-bit seed from the engine's ``rng`` in ``start``
and derives every later random choice from ``(seed, what, k)``, ``k`` being the index of the
proposal (0 for the first sample ever proposed, ``len(history)`` for the first one after a
resume). So what a strategy proposes depends only on its seed and on the trials it has been told
about, never on how many random numbers earlier calls consumed: a search resumed from its
finished trials continues exactly as the uninterrupted search would have.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any, Iterable, Mapping, Sequence

from ..errors import InvalidSample
from ..space import SearchSpace
from ..trial import Decision, Objective, Trial, TrialGroup, TrialStatus
from ._base import Strategy

__all__: list[str] = []  # private helpers

#: Finite spaces up to this size are enumerated when random draws keep hitting seen samples.
_ENUMERATE_LIMIT = 200_000
_RANDOM_ATTEMPTS = 64


# ---------------------------------------------------------------------------------------------
# parameter checks (scikit-learn style: constructors store, ``start`` validates)

def _range_text(low: Any, high: Any, *, as_float: bool) -> str:
    fmt = (lambda v: repr(float(v))) if as_float else repr
    lo = "-inf" if low is None else (low if isinstance(low, str) else fmt(low))
    hi = "inf" if high is None else (high if isinstance(high, str) else fmt(high))
    return f"{'(' if low is None else '['}{lo}, {hi}{')' if high is None else ']'}"


def check_int(owner: str, name: str, value: Any, low: int | None = None, high: int | None = None,
              *, high_text: str | None = None, optional: bool = False) -> None:
    """``The 'population' parameter of RegularizedEvolution must be an int in the range [2, inf).
    Got 1 instead.``"""
    if optional and value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        shown_high = high_text if high_text is not None and high is not None else high
        what = "an int or None" if optional else "an int"
        raise ValueError(f"The {name!r} parameter of {owner} must be {what} in the range "
                         f"{_range_text(low, shown_high, as_float=False)}. Got {value!r} instead.")


def check_float(owner: str, name: str, value: Any, low: float | None = None, high: float | None = None,
                *, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)
    if not ok:
        text = _range_text(low, high, as_float=True)
        if low_open:
            text = "(" + text[1:]
        raise ValueError(f"The {name!r} parameter of {owner} must be a float in the range {text}. "
                         f"Got {value!r} instead.")


def check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"The {name!r} parameter of {owner} must be a bool. Got {value!r} instead.")


def check_order(owner: str, low_name: str, low: int, high_name: str, high: int) -> None:
    if not low <= high:
        raise ValueError(f"`{low_name} <= {high_name}` must hold for {owner}, "
                         f"but got ({low_name}={low!r}, {high_name}={high!r}).")


# ---------------------------------------------------------------------------------------------
# samples and randomness

def sample_key(sample: Mapping[str, Any]) -> str:
    """A canonical text for a sample, for dedup (order of labels does not matter)."""
    return json.dumps(sample, sort_keys=True, separators=(",", ":"))


def derive_rng(seed: int, *parts: Any) -> random.Random:
    """An independent generator for ``(seed, *parts)``; string seeds hash with SHA-512, so this
    is the same across processes and Python versions."""
    return random.Random(":".join(str(p) for p in (seed, *parts)))


def derive_seed(seed: int, *parts: Any) -> int:
    return derive_rng(seed, *parts).getrandbits(32)


def cap(n: int, remaining: int | None) -> int:
    return n if remaining is None else max(0, min(n, remaining))


def curve_of(trial: Trial, objective: Objective) -> list[float]:
    """The per-step values of the objective recorded on a trial (may be empty)."""
    values = trial.metrics.get(objective.metric)
    if values:
        return [float(v) for v in values]
    if trial.metric is not None and trial.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED):
        # a record without a per-step history: one value at its last step
        return [math.nan] * max(trial.steps - 1, 0) + [float(trial.metric)]
    return []


def final_value(trial: Trial, objective: Objective) -> float | None:
    """The value a finished trial scored, or ``None`` when it has none (failed, duplicate)."""
    if trial.status not in (TrialStatus.COMPLETED, TrialStatus.STOPPED):
        return None
    value = trial.metric
    if value is None:
        values = trial.metrics.get(objective.metric)
        value = values[-1] if values else None
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def stopping_rule(owner: str, stopping: Any) -> Strategy:
    """The rule ``stopping`` (a constructor's ``stopping=`` policy) applies; one-line error otherwise."""
    rule = stopping.as_stopping() if isinstance(stopping, Strategy) else None
    if rule is None:
        raise ValueError(f"The 'stopping' parameter of {owner} must be a stopping rule (td.strategy.ASHA, "
                         f"Hyperband, BOHB or MedianStopping) or None. Got {stopping!r} instead.")
    return rule


class SearchBase(Strategy):
    """Bookkeeping most strategies share: the samples seen so far (for dedup and exhaustion),
    per-trial learning curves, and the proposal counter that seeds every random choice.

    Subclasses implement ``_check`` (parameter validation), optionally ``_setup`` (fresh state,
    called before the history is replayed) and ``_observe`` (a trial finished), and ``ask``.

    A subclass whose constructor stores a ``stopping`` policy (a strategy whose
    :meth:`~Strategy.as_stopping` is a rule: ASHA, Hyperband, BOHB, MedianStopping) proposes as
    before and lets that rule decide whether its running trials continue, as an Optuna sampler
    does with a pruner: the rule is started with the same history on a random stream of its own
    (so the proposals are those of the strategy alone), sees every report and finished trial,
    and its ``max_steps`` becomes the groups' budget.
    """

    def _check(self) -> None:
        """Validate the constructor's parameters; raise ``ValueError`` naming the rule."""

    def _setup(self) -> None:
        """Reset strategy-specific state (``start`` calls it before replaying the history)."""

    def _observe(self, trial: Trial, key: str | None) -> None:
        """``trial`` finished; ``key`` is its sample's key (``None`` if the sample is invalid)."""

    def _resumed(self, history: Sequence[Trial]) -> None:
        """Called once after the history is replayed."""

    # -- protocol ----------------------------------------------------------------------------

    def start(self, space: SearchSpace, objective: Objective, rng: random.Random,
              history: Sequence[Trial] = ()) -> None:
        self._check()
        stopping = getattr(self, "stopping", None)
        rule = None if stopping is None else stopping_rule(type(self).__name__, stopping)
        self._stopper: Strategy | None = None   # started once the history is replayed below
        self.space, self.objective, self.rng = space, objective, rng
        self._seed = rng.getrandbits(64)
        self._space_size: float | None = None        # counted when first needed (see _size)
        self._seen: set[str] = set()             # every sample proposed or told about
        self._pending: dict[str, dict[str, Any]] = {}   # proposed, not told yet
        self._curves: dict[int, list[float]] = {}       # trial id -> objective per step
        self._trials: dict[int, Trial] = {}             # finished trials by id
        self._keys: dict[int, str | None] = {}          # trial id -> sample key
        self._samples: dict[int, dict[str, Any]] = {}   # trial id -> sample, running or finished
        self._proposed = 0                               # index of the next proposal
        self._started = True
        self._setup()
        history = sorted(history, key=lambda t: t.id)
        for trial in history:
            self.tell(trial)
        # Proposal k draws from the k-th random stream: a resumed run continues at the count of
        # trials the experiment holds, so it proposes what an uninterrupted run would have.
        self._proposed = max([len(history)] + [t.number + 1 for t in history if t.number is not None])
        self._resumed(history)
        if rule is not None:
            rule.start(space, objective, derive_rng(self._seed, "stopping"), history)
            self._stopper = rule

    def objective_named(self, objective: Objective) -> None:
        self.objective = objective
        if self._stopper is not None:
            self._stopper.objective_named(objective)

    def report(self, trial: Trial, step: int, value: float) -> None:
        self._samples.setdefault(trial.id, trial.sample)
        curve = self._curves.setdefault(trial.id, [])
        while len(curve) <= step:
            curve.append(math.nan)
        curve[step] = float(value) if value is not None else math.nan
        if self._stopper is not None:
            self._stopper.report(trial, step, value)

    def decide(self, trial: Trial, step: int) -> Decision:
        """The stopping rule's decision; without one, every trial continues."""
        return self._stopper.decide(trial, step) if self._stopper is not None else Decision.CONTINUE

    def tell(self, trial: Trial) -> None:
        if trial.number is not None and trial.number >= self._proposed:  # a trial of an earlier run, re-run
            self._proposed = trial.number + 1
        key = self._key_of(trial)
        if key is not None:
            self._seen.add(key)
            self._pending.pop(key, None)
        recorded = curve_of(trial, self.objective)
        if recorded or trial.id not in self._curves:
            self._curves[trial.id] = recorded
        self._trials[trial.id] = trial
        self._samples[trial.id] = trial.sample
        self._observe(trial, key)
        if self._stopper is not None:
            self._stopper.tell(trial)

    # -- helpers -------------------------------------------------------------------------------

    def _require_started(self) -> None:
        if not getattr(self, "_started", False):
            raise RuntimeError(f"{type(self).__name__}.start(space, objective, rng) must be called before ask()")

    def _key_of(self, trial: Trial) -> str | None:
        if trial.id in self._keys:
            return self._keys[trial.id]
        try:
            key: str | None = sample_key(self.space.validate(trial.sample))
        except InvalidSample:
            key = None
        self._keys[trial.id] = key
        return key

    @property
    def _size(self) -> float:
        """The number of distinct samples of the space, counted on first use (a strategy starts
        without it: a random proposal needs no count)."""
        if self._space_size is None:
            self._space_size = self.space.size()
        return self._space_size

    def _exhausted(self) -> bool:
        return bool(self._seen) and len(self._seen) >= self._size  # every space holds a sample

    def _is_new(self, sample: Mapping[str, Any]) -> bool:
        return sample_key(sample) not in self._seen

    def _accept(self, sample: dict[str, Any]) -> dict[str, Any]:
        """Record ``sample`` as proposed; advances the proposal counter."""
        key = sample_key(sample)
        self._seen.add(key)
        self._pending[key] = sample
        self._proposed += 1
        return sample

    def _rng(self, what: str, k: int | None = None) -> random.Random:
        return derive_rng(self._seed, what, self._proposed if k is None else k)

    def _random_unseen(self, rng: random.Random) -> dict[str, Any] | None:
        """A random sample not seen before, or ``None`` when the (finite) space is exhausted."""
        if self._exhausted():
            return None
        for _ in range(_RANDOM_ATTEMPTS):
            sample = self.space.random_sample(rng)
            if self._is_new(sample):
                return sample
        if self._size <= _ENUMERATE_LIMIT:
            try:
                rest = [s for s in self.space.grid() if self._is_new(s)]
            except ValueError:
                rest = []
            return rng.choice(rest) if rest else None
        for _ in range(_RANDOM_ATTEMPTS * 100):
            sample = self.space.random_sample(rng)
            if self._is_new(sample):
                return sample
        return None

    def _propose_random(self, n: int) -> list[dict[str, Any]]:
        samples = []
        for _ in range(n):
            sample = self._random_unseen(self._rng("random"))
            if sample is None:
                break
            samples.append(self._accept(sample))
        return samples

    def _group(self, samples: list[dict[str, Any]], name: str, max_steps: int | None = None) -> TrialGroup | None:
        if not samples:
            return None
        if max_steps is None and self._stopper is not None:
            max_steps = getattr(self._stopper, "max_steps", None)  # ASHA's: the most steps a trial trains
        return TrialGroup(samples, max_steps=max_steps, name=f"{name}-{self._proposed - len(samples)}")

    def _finished_values(self) -> Iterable[tuple[Trial, float]]:
        """(trial, final value) of every finished trial with a value, in id order."""
        for tid in sorted(self._trials):
            trial = self._trials[tid]
            value = final_value(trial, self.objective)
            if value is not None:
                yield trial, value
