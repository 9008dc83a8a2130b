"""Domains of labels and the description of a whole search space.

A *sample* is a JSON-able ``dict[label, value]``. For categorical labels the value is the
candidate itself when every candidate is a JSON scalar (``{"width": 32}``), else the candidate's
index or dict key (``{"op": 1}``), so samples never hold pickled objects.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from ..errors import InvalidSample, InvalidSpace

__all__ = ["Domain", "Categorical", "Uniform", "LogUniform", "RandInt", "Condition", "LabelSpec", "SampleRule",
           "SearchSpace", "hashable_value", "same_value"]

_JSON_SCALARS = (bool, int, float, str, type(None))


def _is_json_scalar(value: Any) -> bool:
    """A value a sample can hold as itself: a JSON scalar, or a list of them (InputChoice picks)."""
    if isinstance(value, list):
        return all(isinstance(v, _JSON_SCALARS) for v in value)
    return isinstance(value, _JSON_SCALARS)


class Domain:
    """The set of values a label may take."""

    finite: bool = True

    def contains(self, value: Any) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def values(self) -> list[Any]:
        """Every sample value, for finite domains."""
        raise TypeError(f"{self!r} is not finite")

    def sample(self, rng: random.Random) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def default(self) -> Any:
        """The value used when nothing else decides (the first candidate / the low end)."""
        raise NotImplementedError

    def to_candidate(self, value: Any) -> Any:
        """The object a sample value stands for (a module for a LayerChoice index)."""
        return value

    def same_as(self, other: "Domain") -> bool:
        """Same sample values (candidate objects may differ: two LayerChoices sharing a label
        may hold layers of different widths, and are still one decision)."""
        mine, theirs = self.describe(), other.describe()
        mine.pop("candidates", None)
        theirs.pop("candidates", None)
        return mine == theirs

    def describe(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def size(self) -> float:
        return math.inf


class Categorical(Domain):
    """A finite set of candidates.

    >>> Categorical([16, 32, 64]).values()
    [16, 32, 64]
    """

    def __init__(self, candidates: Sequence[Any] | Mapping[str, Any], *, label: str = "?", indexed: bool | None = None):
        if isinstance(candidates, Mapping):
            self.candidates = list(candidates.values())
            self._values: list[Any] = list(candidates.keys())
        else:
            if isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__len__"):
                raise InvalidSpace(f"candidates of label {label!r} must be a list or dict, got {candidates!r}")
            self.candidates = list(candidates)
            if indexed is None:
                indexed = not all(_is_json_scalar(c) for c in self.candidates)
            self._values = list(range(len(self.candidates))) if indexed else list(self.candidates)
        if not self.candidates:
            raise InvalidSpace(f"label {label!r} has no candidates: a choice needs at least one")
        if len(set(map(hashable_value, self._values))) != len(self._values):
            raise InvalidSpace(f"label {label!r} has repeated candidates {self._values!r}")

    def contains(self, value: Any) -> bool:
        return any(same_value(value, v) for v in self._values)

    def values(self) -> list[Any]:
        return list(self._values)

    def sample(self, rng: random.Random) -> Any:
        return rng.choice(self._values)

    def default(self) -> Any:
        return self._values[0]

    def to_candidate(self, value: Any) -> Any:
        for v, c in zip(self._values, self.candidates):
            if same_value(value, v):
                return c
        raise KeyError(value)

    def describe(self) -> dict[str, Any]:
        shown = self._values if all(_is_json_scalar(v) for v in self._values) else [repr(v) for v in self._values]
        out: dict[str, Any] = {"type": "categorical", "values": shown}
        if any(not _is_json_scalar(c) for c in self.candidates) or self._values != self.candidates:
            out["candidates"] = [_short(c) for c in self.candidates]
        return out

    def size(self) -> float:
        return float(len(self._values))

    def __repr__(self) -> str:
        return f"Categorical({self._values!r})"


class _Range(Domain):
    finite = False
    kind = "range"

    def __init__(self, low: float, high: float, *, label: str = "?"):
        if not (isinstance(low, (int, float)) and isinstance(high, (int, float))):
            raise InvalidSpace(f"bounds of label {label!r} must be numbers, got low={low!r}, high={high!r}")
        if not low < high:
            raise InvalidSpace(f"`low < high` must hold for label {label!r}, but got (low={low!r}, high={high!r})")
        self.low, self.high = low, high

    def contains(self, value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high

    def default(self) -> Any:
        return self.low

    def describe(self) -> dict[str, Any]:
        return {"type": self.kind, "low": self.low, "high": self.high}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.low!r}, {self.high!r})"


class Uniform(_Range):
    kind = "uniform"

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)


class LogUniform(_Range):
    kind = "loguniform"

    def __init__(self, low: float, high: float, *, label: str = "?"):
        super().__init__(low, high, label=label)
        if low <= 0:
            raise InvalidSpace(f"`low > 0` must hold for log-uniform label {label!r}, but got low={low!r}")

    def sample(self, rng: random.Random) -> float:
        return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))


class RandInt(_Range):
    """Integers in ``[low, high]``, both ends included."""

    kind = "randint"

    def __init__(self, low: int, high: int, *, label: str = "?"):
        if not (isinstance(low, int) and isinstance(high, int)):
            raise InvalidSpace(f"bounds of randint label {label!r} must be ints, got low={low!r}, high={high!r}")
        super().__init__(low, high, label=label)
        self.finite = True

    def contains(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high

    def values(self) -> list[int]:
        return list(range(int(self.low), int(self.high) + 1))  # (ints: checked in __init__)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(int(self.low), int(self.high))

    def size(self) -> float:
        return float(self.high - self.low + 1)


@dataclass(frozen=True)
class Condition:
    """``label`` is active only when ``parent`` takes one of ``values``."""

    parent: str
    values: tuple[Any, ...]

    def holds(self, sample: Mapping[str, Any]) -> bool:
        return self.parent in sample and any(same_value(sample[self.parent], v) for v in self.values)

    def __str__(self) -> str:
        vals = list(self.values)
        if len(vals) == 1:
            return f"{self.parent} == {vals[0]!r}"
        return f"{self.parent} in {vals!r}"


@dataclass
class LabelSpec:
    """One decision of a space: its label, domain, conditions (all must hold) and origin."""

    label: str
    domain: Domain
    conditions: list[Condition] = field(default_factory=list)
    source: str = "choice"  # "choice", "layer_choice", "input_choice", "repeat", "cell", "mutator:<Name>"

    def active(self, sample: Mapping[str, Any]) -> bool:
        return all(c.holds(sample) for c in self.conditions)

    def describe(self) -> dict[str, Any]:
        out = dict(self.domain.describe())
        out["source"] = self.source
        if self.conditions:
            out["condition"] = " and ".join(str(c) for c in self.conditions)
        return out


class SampleRule:
    """A joint condition on several labels that their domains alone cannot state (e.g. a
    NAS-Bench-101 cell's edge budget over its input labels), with a way to draw valid values
    directly, so random sampling wastes no trial on a sample the space will refuse.

    A module registers one while its space is built (``active_resolver().add_rule(rule)``);
    :meth:`SearchSpace.random_sample` draws the rule's labels with :meth:`draw` once all of them
    are active, :meth:`SearchSpace.violation` reports a sample that breaks it. Subclasses set
    ``labels`` and implement :meth:`violation` and :meth:`draw`.
    """

    labels: tuple[str, ...] = ()

    def violation(self, sample: Mapping[str, Any]) -> str | None:  # pragma: no cover - abstract
        """Why ``sample`` (holding every label of the rule) breaks the rule, or None."""
        raise NotImplementedError

    def draw(self, rng: random.Random, sample: Mapping[str, Any]) -> dict[str, Any]:  # pragma: no cover - abstract
        """Values for ``labels`` that satisfy the rule, drawn uniformly among those that do."""
        raise NotImplementedError

    def key(self) -> tuple[Any, ...]:
        """Rules with equal keys are one rule (a cell built twice under one label registers twice)."""
        return (type(self).__qualname__, self.labels)


class SearchSpace(Mapping[str, LabelSpec]):
    """Every label of a space in discovery order, with its domain and condition, and the
    :class:`SampleRule` s that tie labels together.

    Behaves as a read-only ``dict[label, LabelSpec]``; ``describe()`` gives plain JSON.
    """

    def __init__(self, specs: Sequence[LabelSpec], rules: Sequence[SampleRule] = ()):
        self._specs = {s.label: s for s in specs}
        self.rules: tuple[SampleRule, ...] = tuple({r.key(): r for r in rules if all(l in self._specs for l in r.labels)}
                                                   .values())

    def __getitem__(self, label: str) -> LabelSpec:
        return self._specs[label]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def merged(self, other: "SearchSpace") -> "SearchSpace":
        """Union of two spaces (e.g. a model space and an evaluator's hyperparameters)."""
        specs = dict(self._specs)
        for label, spec in other.items():
            if label in specs and not specs[label].domain.same_as(spec.domain):
                raise InvalidSpace(
                    f"label {label!r} has conflicting domains: {specs[label].domain!r} and {spec.domain!r}")
            specs.setdefault(label, spec)
        return SearchSpace(list(specs.values()), self.rules + other.rules)

    def describe(self) -> dict[str, dict[str, Any]]:
        return {label: spec.describe() for label, spec in self._specs.items()}

    def active_labels(self, sample: Mapping[str, Any]) -> list[str]:
        return [label for label, spec in self._specs.items() if spec.active(sample)]

    def random_sample(self, rng: random.Random | int | None = None) -> dict[str, Any]:
        """Draw every active label; conditions are checked in discovery order, parents first."""
        rng = rng if isinstance(rng, random.Random) else random.Random(rng)
        position = {label: i for i, label in enumerate(self._specs)}
        # a rule draws its labels again, jointly, once the last of them is drawn
        last = {max(r.labels, key=position.__getitem__): r for r in self.rules if r.labels}
        sample: dict[str, Any] = {}
        for label, spec in self._specs.items():
            if spec.active(sample):
                sample[label] = spec.domain.sample(rng)
                rule = last.get(label)
                if rule is not None and all(l in sample for l in rule.labels):
                    sample.update(rule.draw(rng, sample))
        return sample

    def violation(self, sample: Mapping[str, Any]) -> str | None:
        """Why ``sample`` breaks one of the space's :class:`SampleRule` s (rules whose labels are all
        in the sample), or None."""
        for rule in self.rules:
            if all(l in sample for l in rule.labels):
                why = rule.violation(sample)
                if why is not None:
                    return why
        return None

    def repaired(self, sample: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
        """``sample`` with the labels of every :class:`SampleRule` it breaks drawn again by the
        rule (uniformly among the values that satisfy it); the other labels are kept. A model-based
        strategy whose suggestion breaks a rule keeps what it chose elsewhere.

        >>> space.repaired(suggested, random.Random(0))   # doctest: +SKIP
        """
        out = dict(sample)
        for rule in self.rules:
            if all(label in out for label in rule.labels) and rule.violation(out) is not None:
                out.update(rule.draw(rng, out))
        return out

    def default_sample(self) -> dict[str, Any]:
        sample: dict[str, Any] = {}
        for label, spec in self._specs.items():
            if spec.active(sample):
                sample[label] = spec.domain.default()
        return sample

    def validate(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """Check a sample; return it restricted to its active labels.

        Raises :class:`InvalidSample` naming the label for an unknown label, a missing active
        label or a value outside its domain. Labels that exist but are inactive under the
        sample are ignored (flat samplers such as TPE may propose them).
        """
        if not isinstance(sample, Mapping):
            raise InvalidSample(f"a sample must be a dict of label -> value, got {type(sample).__name__}")
        unknown = [k for k in sample if k not in self._specs]
        if unknown:
            raise InvalidSample(
                f"unknown label {unknown[0]!r} in sample (known labels: {', '.join(self._specs) or 'none'})")
        out: dict[str, Any] = {}
        for label, spec in self._specs.items():
            if not spec.active(out):
                continue
            if label not in sample:
                raise InvalidSample(f"sample is missing label {label!r} (domain {spec.domain!r})")
            value = sample[label]
            if not spec.domain.contains(value):
                raise InvalidSample(f"value {value!r} of label {label!r} is outside its domain {spec.domain!r}")
            out[label] = value
        return out

    def size(self) -> float:
        """Number of distinct samples, counting conditional labels only where active;
        ``math.inf`` when an active label is continuous. :class:`SampleRule` s are not counted:
        with rules this is an upper bound.

        One pass over the labels, keeping, for each assignment of the parents that labels not
        counted yet still depend on, how many partial samples lead to it. Each label is counted as
        soon as its parents are, so a parent is forgotten right after its last child: N optional
        layers with conditional widths keep two states at a time instead of 2 ** N samples.

        >>> space = SearchSpace([LabelSpec("use", Categorical([False, True])),
        ...                      LabelSpec("width", Categorical([8, 16, 32]), [Condition("use", (True,))])])
        >>> space.size()
        4.0
        """
        specs = self._counting_order()
        live: list[set[str]] = [set() for _ in range(len(specs) + 1)]  # parents read at index >= j
        for j in range(len(specs) - 1, -1, -1):
            live[j] = live[j + 1] | {c.parent for c in specs[j].conditions}
        # key of the live parents' values -> (those values, number of partial samples)
        states: dict[tuple[Any, ...], tuple[dict[str, Any], int]] = {(): ({}, 1)}
        for j, spec in enumerate(specs):
            branch = spec.label in live[j + 1]
            keep = live[j + 1]
            nxt: dict[tuple[Any, ...], tuple[dict[str, Any], int]] = {}
            for assigned, count in states.values():
                if not spec.active(assigned):
                    options: list[tuple[dict[str, Any], int]] = [(assigned, count)]
                elif not spec.domain.finite:
                    return math.inf
                elif branch:
                    options = [({**assigned, spec.label: v}, count) for v in spec.domain.values()]
                else:
                    options = [(assigned, count * int(spec.domain.size()))]
                for values, n in options:
                    values = {p: v for p, v in values.items() if p in keep}
                    key = tuple(sorted((p, type(v).__name__, repr(v)) for p, v in values.items()))
                    seen = nxt.get(key)
                    nxt[key] = (values, n if seen is None else seen[1] + n)
            states = nxt
        return float(sum(n for _, n in states.values()))

    def _counting_order(self) -> list[LabelSpec]:
        """The labels that can be active, each placed once its parents are: labels that no other
        label depends on first, then the earliest ready parent. A label conditioned on a label
        that comes after it (or on none) is never active in a sample and is left out."""
        specs = list(self._specs.values())
        position = {s.label: i for i, s in enumerate(specs)}
        usable = [s for i, s in enumerate(specs)
                  if all(position.get(c.parent, len(specs)) < i for c in s.conditions)]
        children: dict[str, int] = {}
        for s in usable:
            for parent in {c.parent for c in s.conditions}:
                children[parent] = children.get(parent, 0) + 1
        placed: set[str] = set()
        order: list[LabelSpec] = []
        waiting = list(usable)
        while waiting:
            ready = [s for s in waiting if all(c.parent in placed for c in s.conditions)]
            if not ready:  # a parent left out above: its children are never active either
                break
            pick = next((s for s in ready if not children.get(s.label)), ready[0])
            waiting.remove(pick)
            placed.add(pick.label)
            order.append(pick)
            for parent in {c.parent for c in pick.conditions}:
                children[parent] -= 1
        return order

    def grid(self) -> Iterator[dict[str, Any]]:
        """Every sample of a finite space, in a fixed order."""
        specs = list(self._specs.values())

        def walk(i: int, assigned: dict[str, Any]) -> Iterator[dict[str, Any]]:
            while i < len(specs) and not specs[i].active(assigned):
                i += 1
            if i == len(specs):
                yield dict(assigned)
                return
            spec = specs[i]
            for v in spec.domain.values():
                yield from walk(i + 1, {**assigned, spec.label: v})

        if not all(s.domain.finite for s in specs):
            raise InvalidSpace("a grid needs finite domains; continuous labels: "
                               + ", ".join(s.label for s in specs if not s.domain.finite))
        for sample in walk(0, {}):
            if not self.rules or self.violation(sample) is None:
                yield sample

    def __repr__(self) -> str:
        lines = [f"  {label}: {spec.domain!r}" + (f"  if {' and '.join(map(str, spec.conditions))}" if spec.conditions else "")
                 for label, spec in self._specs.items()]
        return "SearchSpace(\n" + "\n".join(lines) + "\n)"


def hashable_value(v: Any) -> Any:
    """``v`` as a dict key that tells ``True`` from ``1``: lists become tuples (recursively), a
    hashable value is paired with whether it is a bool, anything unhashable becomes its id."""
    if isinstance(v, list):
        return tuple(hashable_value(x) for x in v)
    try:
        hash(v)
        return (type(v) is bool, v)
    except TypeError:
        return id(v)


def same_value(a: Any, b: Any) -> bool:
    """Equal values of the same type (element-wise for lists and tuples): ``True == 1`` in Python,
    but a sample of ``{"bn": 1}`` must not match the candidate ``True``."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b or (
        isinstance(a, (int, float)) and isinstance(b, (int, float))
        and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


def _short(obj: Any) -> str:
    text = repr(obj).replace("\n", " ")
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."
