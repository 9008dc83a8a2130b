"""The one mechanism by which ``td.choice`` & co. resolve inside constructors.

A *resolver* is installed in a :mod:`contextvars` variable while a space's ``__init__`` runs:

* by ``ModelSpace`` construction and search-space discovery (a recording resolver that answers
  every label with a default or a given partial assignment and writes down what was asked), and
* by ``space.freeze(sample)`` (a fixed resolver answering from the sample).

``td.choice(label, candidates)`` asks the active resolver and gets a plain value back, so any
constructor (``nn.Conv2d``, user modules) receives ordinary ints, floats and modules. With no
resolver active, ``td.choice`` returns a :class:`~tridens.space.Choice` placeholder instead (used for
evaluator hyperparameters, resolved later from the trial's sample). Nothing is patched and no
class is rewritten; this module is the whole mechanism.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Mapping

from ..errors import InvalidSample, InvalidSpace
from ._domain import Domain, SampleRule

__all__ = ["Resolver", "FixedResolver", "RecordingResolver", "active_resolver", "resolve", "using"]

_ACTIVE: contextvars.ContextVar["Resolver | None"] = contextvars.ContextVar("tridens_resolver", default=None)


class Resolver:
    """Answers label -> value during one construction; the same label is one decision."""

    def __init__(self) -> None:
        self.asked: dict[str, tuple[Domain, Any, str]] = {}  # label -> (domain, value, source), in order
        self.rules: list[SampleRule] = []  # joint conditions on labels, registered by the modules built
        self._auto: dict[str, int] = {}

    def add_rule(self, rule: SampleRule) -> None:
        """Register a :class:`~tridens.space.SampleRule` over labels asked in this construction
        (the space's search space keeps the rules of its first construction)."""
        if all(r.key() != rule.key() for r in self.rules):
            self.rules.append(rule)

    def auto_label(self, kind: str) -> str:
        """A label for an unlabelled choice: ``kind_1``, ``kind_2``... in construction order, which
        is the same in every re-run of the same ``__init__``."""
        self._auto[kind] = self._auto.get(kind, 0) + 1
        return f"{kind}_{self._auto[kind]}"

    def resolve(self, label: str, domain: Domain, source: str = "choice") -> Any:
        """Return the *candidate* (not the sample value) chosen for ``label``."""
        if not isinstance(label, str) or not label:
            raise InvalidSpace(f"a label must be a non-empty string, got {label!r}")
        if label in self.asked:
            known, value, _ = self.asked[label]
            if not known.same_as(domain):
                raise InvalidSpace(
                    f"label {label!r} is used with conflicting candidates: {known!r} and {domain!r}")
            return domain.to_candidate(value)
        value = self.decide(label, domain)
        self.asked[label] = (domain, value, source)
        return domain.to_candidate(value)

    def decide(self, label: str, domain: Domain) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def value_of(self, label: str) -> Any:
        return self.asked[label][1]


class FixedResolver(Resolver):
    """Answers from a complete sample (``freeze``)."""

    def __init__(self, sample: Mapping[str, Any]):
        super().__init__()
        self.sample = sample

    def decide(self, label: str, domain: Domain) -> Any:
        if label not in self.sample:
            raise InvalidSample(f"sample is missing label {label!r} (domain {domain!r})")
        value = self.sample[label]
        if not domain.contains(value):
            raise InvalidSample(f"value {value!r} of label {label!r} is outside its domain {domain!r}")
        return value


class RecordingResolver(Resolver):
    """Answers from a partial assignment, else the domain's default; used for discovery."""

    def __init__(self, assignment: Mapping[str, Any] | None = None):
        super().__init__()
        self.assignment = dict(assignment or {})

    def decide(self, label: str, domain: Domain) -> Any:
        if label in self.assignment and domain.contains(self.assignment[label]):
            return self.assignment[label]
        return domain.default()


def active_resolver() -> Resolver | None:
    """The resolver of the construction in progress, or None outside any."""
    return _ACTIVE.get()


@contextlib.contextmanager
def using(resolver: Resolver) -> Iterator[Resolver]:
    """Install ``resolver`` for the duration of the block (nesting restores the outer one)."""
    token = _ACTIVE.set(resolver)
    try:
        yield resolver
    finally:
        _ACTIVE.reset(token)


def resolve(label: str, domain: Domain, source: str) -> Any:
    """Ask the active resolver, or fail clearly when there is none."""
    resolver = _ACTIVE.get()
    if resolver is None:
        raise InvalidSpace(
            f"{source} {label!r} was created outside a ModelSpace's __init__ (or a mutator's mutate); "
            "create it while the space is being built")
    return resolver.resolve(label, domain, source)

