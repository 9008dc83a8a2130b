"""Parameter constraints declared as data, checked with one error template.

"The 'optimizer' parameter of Classification must be one of ['adam', 'adamw', 'rmsprop', 'sgd'].
Got 'sgdd' instead."
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

from ..space import Placeholder
from ._errors import InvalidParameter

__all__ = ["Constraint", "Options", "Interval", "Satisfies", "check", "labels_of"]


class Constraint:
    """A rule a parameter value must satisfy; ``describe()`` completes "must be ..."."""

    def holds(self, value: Any) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError


class Options(Constraint):
    """One of a fixed set of values (shown sorted)."""

    def __init__(self, values: Sequence[Any]):
        self.values = list(values)

    def holds(self, value: Any) -> bool:
        try:
            return value in self.values and not isinstance(value, bool)
        except TypeError:
            return False

    def describe(self) -> str:
        return f"one of {sorted(self.values, key=repr)!r}"


class Interval(Constraint):
    """A number of type ``kind`` ("int" or "float") in a range; ``None`` bounds are infinite.

    ``closed`` is "both", "left", "right" or "neither". Floats accept ints; bools are refused.
    """

    def __init__(self, kind: str, low: float | None, high: float | None, closed: str = "both"):
        self.kind, self.low, self.high, self.closed = kind, low, high, closed

    def holds(self, value: Any) -> bool:
        if isinstance(value, bool):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        if self.kind == "float" and not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.low is not None:
            if value < self.low or (value == self.low and self.closed in ("right", "neither")):
                return False
        if self.high is not None:
            if value > self.high or (value == self.high and self.closed in ("left", "neither")):
                return False
        return True

    def describe(self) -> str:
        left = "[" if self.closed in ("both", "left") and self.low is not None else "("
        right = "]" if self.closed in ("both", "right") and self.high is not None else ")"
        low = "-inf" if self.low is None else repr(self.low)
        high = "inf" if self.high is None else repr(self.high)
        return f"{'an int' if self.kind == 'int' else 'a float'} in the range {left}{low}, {high}{right}"


class Satisfies(Constraint):
    """Any predicate, with the words that describe it ("a callable", "a torch Dataset")."""

    def __init__(self, predicate: Callable[[Any], bool], description: str):
        self.predicate, self.description = predicate, description

    def holds(self, value: Any) -> bool:
        return bool(self.predicate(value))

    def describe(self) -> str:
        return self.description


def labels_of(params: Mapping[str, Any]) -> dict[str, str]:
    """Parameter name -> the label of the placeholder it was given (for error messages)."""
    out: dict[str, str] = {}
    for name, value in params.items():
        if isinstance(value, Placeholder):
            found = [c.label for c in value.labels()]
            if found:
                out[name] = ", ".join(dict.fromkeys(found))
    return out


def check(owner: str, values: Mapping[str, Any], constraints: Mapping[str, Sequence[Constraint]],
          labels: Mapping[str, str] | None = None) -> None:
    """Raise :class:`InvalidParameter` for the first value that satisfies none of its constraints.

    ``labels`` maps a parameter to the sample label it came from, added to the message.
    """
    for name, options in constraints.items():
        if name not in values:
            continue
        value = values[name]
        if any(c.holds(value) for c in options):
            continue
        wanted = " or ".join(c.describe() for c in options)
        where = f" (the value of label {labels[name]!r} in the sample)" if labels and name in labels else ""
        raise InvalidParameter(f"The {name!r} parameter of {owner} must be {wanted}. Got {value!r} instead{where}.")
