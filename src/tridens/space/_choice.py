"""``td.choice``, ``td.uniform``, ``td.loguniform``, ``td.randint`` and placeholder arithmetic."""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..errors import InvalidSample
from ._context import active_resolver
from ._domain import Categorical, Domain, LabelSpec, LogUniform, RandInt, SearchSpace, Uniform

__all__ = ["Placeholder", "choice", "uniform", "loguniform", "randint", "Choice", "Expr", "resolve_value", "labels_in"]


class Placeholder:
    """A value decided later by a sample; supports arithmetic (``w * 2``, ``w // 4``)."""

    def resolve(self, sample: Mapping[str, Any]) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def labels(self) -> Iterator["Choice"]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _op(self, fn: Callable[..., Any], *others: Any) -> "Expr":
        return Expr(fn, (self, *others))

    def _rop(self, fn: Callable[..., Any], other: Any) -> "Expr":
        return Expr(fn, (other, self))

    def __add__(self, o: Any) -> "Expr": return self._op(operator.add, o)
    def __radd__(self, o: Any) -> "Expr": return self._rop(operator.add, o)
    def __sub__(self, o: Any) -> "Expr": return self._op(operator.sub, o)
    def __rsub__(self, o: Any) -> "Expr": return self._rop(operator.sub, o)
    def __mul__(self, o: Any) -> "Expr": return self._op(operator.mul, o)
    def __rmul__(self, o: Any) -> "Expr": return self._rop(operator.mul, o)
    def __truediv__(self, o: Any) -> "Expr": return self._op(operator.truediv, o)
    def __rtruediv__(self, o: Any) -> "Expr": return self._rop(operator.truediv, o)
    def __floordiv__(self, o: Any) -> "Expr": return self._op(operator.floordiv, o)
    def __rfloordiv__(self, o: Any) -> "Expr": return self._rop(operator.floordiv, o)
    def __mod__(self, o: Any) -> "Expr": return self._op(operator.mod, o)
    def __pow__(self, o: Any) -> "Expr": return self._op(operator.pow, o)
    def __rpow__(self, o: Any) -> "Expr": return self._rop(operator.pow, o)
    def __neg__(self) -> "Expr": return self._op(operator.neg)


class Choice(Placeholder):
    """A labelled decision created outside a space's construction (e.g. an evaluator's ``lr``)."""

    def __init__(self, label: str, domain: Domain, source: str = "choice"):
        self.label, self.domain, self.source = label, domain, source

    def resolve(self, sample: Mapping[str, Any]) -> Any:
        if self.label not in sample:
            raise InvalidSample(f"sample is missing label {self.label!r} (domain {self.domain!r})")
        value = sample[self.label]
        if not self.domain.contains(value):
            raise InvalidSample(f"value {value!r} of label {self.label!r} is outside its domain {self.domain!r}")
        return self.domain.to_candidate(value)

    def labels(self) -> Iterator["Choice"]:
        yield self

    def __repr__(self) -> str:
        return f"Choice({self.label!r}, {self.domain!r})"


class Expr(Placeholder):
    """Arithmetic over placeholders, evaluated when the sample is known."""

    def __init__(self, fn: Callable[..., Any], operands: Sequence[Any]):
        self.fn, self.operands = fn, tuple(operands)

    def resolve(self, sample: Mapping[str, Any]) -> Any:
        return self.fn(*(resolve_value(o, sample) for o in self.operands))

    def labels(self) -> Iterator[Choice]:
        for o in self.operands:
            if isinstance(o, Placeholder):
                yield from o.labels()

    def __repr__(self) -> str:
        return f"{self.fn.__name__}{self.operands!r}"


def _checked_label(label: Any, function: str) -> str:
    """``label`` if it is a non-empty str: labels are keys of JSON samples in the store, so a
    number or None would come back as another label on resume."""
    if not isinstance(label, str) or not label:
        raise ValueError(f"The 'label' parameter of td.{function} must be a non-empty str. Got {label!r} instead.")
    return label


def _decide(label: str, domain: Domain, source: str) -> Any:
    resolver = active_resolver()
    if resolver is None:
        return Choice(label, domain, source)
    return resolver.resolve(label, domain, source)


def choice(label: str, candidates: Sequence[Any] | Mapping[str, Any]) -> Any:
    """One of ``candidates``, decided by the sample under ``label``.

    Inside a ``ModelSpace.__init__`` it returns the chosen candidate itself, so it can go into
    any constructor argument; elsewhere it returns a :class:`Choice` placeholder.

    >>> import tridens as td
    >>> td.choice("lr", [0.01, 0.1])
    Choice('lr', Categorical([0.01, 0.1]))
    """
    return _decide(_checked_label(label, "choice"), Categorical(candidates, label=label), "choice")


def uniform(label: str, low: float, high: float) -> Any:
    """A float in ``[low, high]``. ``td.uniform("dropout", 0.0, 0.5)``"""
    return _decide(_checked_label(label, "uniform"), Uniform(low, high, label=label), "uniform")


def loguniform(label: str, low: float, high: float) -> Any:
    """A float in ``[low, high]`` drawn uniformly in log space. ``td.loguniform("lr", 1e-4, 1e-1)``"""
    return _decide(_checked_label(label, "loguniform"), LogUniform(low, high, label=label), "loguniform")


def randint(label: str, low: int, high: int) -> Any:
    """An int in ``[low, high]`` (both included). ``td.randint("layers", 1, 4)``"""
    return _decide(_checked_label(label, "randint"), RandInt(low, high, label=label), "randint")


def resolve_value(obj: Any, sample: Mapping[str, Any]) -> Any:
    """Replace placeholders in ``obj`` (nested in lists, tuples, dicts) by their sampled values."""
    if isinstance(obj, Placeholder):
        return obj.resolve(sample)
    if isinstance(obj, dict):
        return {k: resolve_value(v, sample) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(resolve_value(v, sample) for v in obj)
    return obj


def labels_in(obj: Any) -> SearchSpace:
    """The search space of every placeholder found in ``obj`` (nested containers included)."""
    found: list[LabelSpec] = []

    def walk(o: Any) -> None:
        if isinstance(o, Placeholder):
            for c in o.labels():
                found.append(LabelSpec(c.label, c.domain, source=c.source))
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    space = SearchSpace([])
    for spec in found:
        space = space.merged(SearchSpace([spec]))
    return space
