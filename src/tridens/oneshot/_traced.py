"""Numbers that remember which labels they came from.

While the supernet is built, ``td.choice("width", [16, 32])`` answers a :class:`TracedInt`: an
``int`` equal to the largest candidate (so every layer is built at its largest size) that also
carries a function ``sample -> value``; a float choice answers a :class:`TracedFloat` at its
largest candidate. Arithmetic keeps the trace (``w * 2``, ``k // 2``, ``math.trunc(w * r)``), so
after construction the supernet builder finds, in each layer's attributes (``out_channels``,
``kernel_size``, ``padding``...), which labels decide which dimension, and slices the largest
weight per sample. Comparisons and ``int(x)`` give plain values: control flow on a choice is
caught later, when the supernet's subnets are checked against models built alone.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, FrozenSet, Mapping, SupportsIndex

__all__ = ["TracedInt", "TracedFloat", "is_traced", "traced_labels", "value_at"]

Sample = Mapping[str, Any]


def is_traced(obj: Any) -> bool:
    return isinstance(obj, (TracedInt, TracedFloat))


def value_at(obj: Any, sample: Sample) -> Any:
    """``obj`` under ``sample``: traced numbers evaluated, tuples/lists element-wise, else as is."""
    if is_traced(obj):
        return obj.fn(sample)
    if isinstance(obj, tuple):
        return tuple(value_at(v, sample) for v in obj)
    if isinstance(obj, list):
        return [value_at(v, sample) for v in obj]
    return obj


def traced_labels(obj: Any) -> FrozenSet[str]:
    """The labels a (possibly nested) value depends on."""
    if is_traced(obj):
        return obj.labels
    if isinstance(obj, (tuple, list)):
        out: frozenset[str] = frozenset()
        for v in obj:
            out = out | traced_labels(v)
        return out
    return frozenset()


def plain(obj: Any) -> Any:
    """The value at the supernet's (largest) setting, with no trace left."""
    if isinstance(obj, TracedInt):
        return int(obj)
    if isinstance(obj, TracedFloat):
        return float(obj)
    if isinstance(obj, tuple):
        return tuple(plain(v) for v in obj)
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return obj


def _wrap(result: Any, fn: Callable[[Sample], Any], labels: FrozenSet[str]) -> Any:
    if isinstance(result, bool):
        return result
    if isinstance(result, int):
        return TracedInt(result, fn, labels)
    if isinstance(result, float):
        return TracedFloat(result, fn, labels)
    return result


def _strip(v: Any) -> Any:
    if isinstance(v, TracedInt):
        return int(v)
    if isinstance(v, TracedFloat):
        return float(v)
    return v


def _binary(op: Callable[[Any, Any], Any], reverse: bool = False) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        if not isinstance(other, (int, float)):
            return NotImplemented
        a, b = (other, self) if reverse else (self, other)
        result = op(_strip(a), _strip(b))
        return _wrap(result, lambda s: op(value_at(a, s), value_at(b, s)), traced_labels(a) | traced_labels(b))
    return method


def _unary(op: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def method(self: Any) -> Any:
        return _wrap(op(_strip(self)), lambda s: op(value_at(self, s)), self.labels)
    return method


class _TracedMixin:
    fn: Callable[[Sample], Any]
    labels: FrozenSet[str]

    def at(self, sample: Sample) -> Any:
        return self.fn(sample)

    # Immutable values: copies are the value itself (deep copies of candidate modules keep traces).
    def __copy__(self) -> Any:
        return self

    def __deepcopy__(self, memo: Any) -> Any:
        return self

    __add__ = _binary(operator.add)
    __radd__ = _binary(operator.add, True)
    __sub__ = _binary(operator.sub)
    __rsub__ = _binary(operator.sub, True)
    __mul__ = _binary(operator.mul)
    __rmul__ = _binary(operator.mul, True)
    __floordiv__ = _binary(operator.floordiv)
    __rfloordiv__ = _binary(operator.floordiv, True)
    __truediv__ = _binary(operator.truediv)
    __rtruediv__ = _binary(operator.truediv, True)
    __mod__ = _binary(operator.mod)
    __rmod__ = _binary(operator.mod, True)
    _pow = _binary(operator.pow)
    _rpow = _binary(operator.pow, True)

    # int's and float's signatures (pow() with a modulus is not traced: NotImplemented, a TypeError)
    def __pow__(self, other: Any, mod: Any = None) -> Any:
        return self._pow(other) if mod is None else NotImplemented

    def __rpow__(self, other: Any, mod: Any = None) -> Any:
        return self._rpow(other) if mod is None else NotImplemented

    __neg__ = _unary(operator.neg)
    __pos__ = _unary(operator.pos)
    __abs__ = _unary(abs)
    # math.trunc / floor / ceil and round() keep the trace (a size such as ``math.trunc(dim * ratio)``);
    # int() does not, so control flow on a choice stays visible as such.
    __trunc__ = _unary(math.trunc)
    __floor__ = _unary(math.floor)
    __ceil__ = _unary(math.ceil)

    def __round__(self, ndigits: SupportsIndex | None = None) -> Any:
        return _wrap(round(_strip(self), ndigits), lambda s: round(value_at(self, s), ndigits), self.labels)


class TracedInt(_TracedMixin, int):
    """An ``int`` (the supernet's value) plus ``fn(sample)`` and the labels it depends on."""

    def __new__(cls, value: int, fn: Callable[[Sample], Any], labels: FrozenSet[str] | set[str]) -> "TracedInt":
        obj = int.__new__(cls, value)
        obj.fn, obj.labels = fn, frozenset(labels)
        return obj

    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return int.__repr__(self)


class TracedFloat(_TracedMixin, float):
    """A ``float`` (the supernet's value) plus ``fn(sample)`` and the labels it depends on."""

    def __new__(cls, value: float, fn: Callable[[Sample], Any], labels: FrozenSet[str] | set[str]) -> "TracedFloat":
        obj = float.__new__(cls, value)
        obj.fn, obj.labels = fn, frozenset(labels)
        return obj

    __hash__ = float.__hash__

    def __repr__(self) -> str:
        return float.__repr__(self)
