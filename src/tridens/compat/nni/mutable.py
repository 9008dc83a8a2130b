"""``nni.mutable`` (NNI 3.0) on tridens.

Inside a model space's ``__init__`` a mutable is its chosen value (``Categorical([16, 32],
label="w")`` is 16 or 32), as ``td.choice`` is; elsewhere it is a placeholder that an evaluator
resolves from the trial's sample and that answers ``.label``, ``.values``, ``.default()``,
``.random()``, ``.grid()`` and ``.freeze(sample)``.

=================================  =====================================================
NNI                                tridens
=================================  =====================================================
``Categorical(values, label=)``    ``td.choice(label, values)``
``CategoricalMultiple(values, n)`` ``td.choice`` over the ``n``-subsets (all if ``n=None``)
``Numerical(low, high, ...)``      ``td.uniform`` / ``td.loguniform`` (``quantize``: a choice)
``frozen_context(sample)``         ``space.freeze(sample)``'s context (``fixed_arch``)
``label_scope(name)``              labels prefixed ``name/``
``ensure_frozen(x)``               the value (a placeholder is resolved by the construction)
``SampleValidationError``          ``td.InvalidSample``
=================================  =====================================================
"""

from __future__ import annotations

import itertools
import random as _random
from typing import Any, Iterator, Mapping, Sequence

from tridens.errors import InvalidSample
from tridens.space import Categorical as _CategoricalDomain
from tridens.space import Choice, Domain, LogUniform, Uniform
from tridens.space._context import active_resolver

from ._common import NotSupported
from ._fixed import fixed_arch
from ._scope import label_scope, scoped

__all__ = ["Categorical", "CategoricalMultiple", "Numerical", "Mutable", "MutableExpression", "Sample",
           "SampleValidationError", "SampleMissingError", "ConstraintViolation", "ExpressionConstraint",
           "frozen_context", "frozen", "label_scope", "ensure_frozen", "MutableChoice"]

Sample = dict


class SampleValidationError(InvalidSample):
    """``nni.mutable.SampleValidationError``: a sample a space refuses (``td.InvalidSample``)."""


class SampleMissingError(SampleValidationError):
    """A label the sample lacks."""


ConstraintViolation = SampleValidationError


class MutableChoice(Choice):
    """A mutable created outside a space's construction: a ``td`` placeholder with NNI's methods."""

    @property
    def values(self) -> list[Any]:
        return self.domain.values()

    def default(self) -> Any:
        return self.domain.to_candidate(self.domain.default())

    def random(self, memo: Any = None, random_state: _random.Random | None = None) -> Any:
        return self.domain.to_candidate(self.domain.sample(random_state or _random.Random()))

    def grid(self, memo: Any = None, granularity: int | None = None) -> Iterator[Any]:
        return iter(self.domain.to_candidate(v) for v in self.domain.values())

    def freeze(self, sample: Mapping[str, Any]) -> Any:
        return self.resolve(sample)

    def simplify(self) -> dict[str, "MutableChoice"]:
        return {self.label: self}

    def contains(self, sample: Mapping[str, Any]) -> bool:
        return self.label in sample and self.domain.contains(sample[self.label])


def _decide(label: str | None, domain_of: Any, kind: str) -> Any:
    label = scoped(label)
    resolver = active_resolver()
    if label is None:
        if resolver is None:
            raise NotSupported(f"nni.mutable.{kind} outside a model space's __init__ needs label=...; tridens resolves "
                               "it from the trial's sample by that label.")
        label = resolver.auto_label(kind.lower())
    domain: Domain = domain_of(label)
    if resolver is None:
        return MutableChoice(label, domain, kind.lower())
    return resolver.resolve(label, domain, kind.lower())


def Categorical(values: Sequence[Any], *, default: Any = None, weights: Any = None, label: str | None = None) -> Any:
    """``Categorical([16, 32], label="width")``: one of ``values`` (= ``td.choice``)."""
    if weights is not None:
        raise NotSupported("The 'weights' parameter of nni.mutable.Categorical has no tridens equivalent: tridens' "
                           "strategies sample candidates uniformly. Repeat a value in the list to favour it.")
    return _decide(label, lambda lb: _CategoricalDomain(list(values), label=lb), "Categorical")


def CategoricalMultiple(values: Sequence[Any], *, n_chosen: int | None = None, label: str | None = None) -> Any:
    """``n_chosen`` of ``values`` (any number when ``None``): a choice among the subsets, as lists."""
    values = list(values)
    sizes = range(len(values) + 1) if n_chosen is None else [n_chosen]
    subsets = [list(c) for r in sizes for c in itertools.combinations(values, r)]
    return _decide(label, lambda lb: _CategoricalDomain(subsets, label=lb), "CategoricalMultiple")


def Numerical(low: float = float("-inf"), high: float = float("inf"), *, mu: float | None = None,
              sigma: float | None = None, log_distributed: bool = False, quantize: float | None = None,
              default: Any = None, distribution: Any = None, label: str | None = None) -> Any:
    """A number in ``[low, high]``: ``td.uniform``, ``td.loguniform`` with ``log_distributed=True``,
    a finite choice with ``quantize``."""
    if mu is not None or sigma is not None or distribution is not None:
        raise NotSupported("nni.mutable.Numerical with mu/sigma/distribution (a normal or scipy prior) has no tridens "
                           "equivalent: give low and high (td.uniform / td.loguniform).")
    if quantize is not None:
        n = int(round((high - low) / quantize))
        grid = [round(low + i * quantize, 10) for i in range(n + 1)]
        return _decide(label, lambda lb: _CategoricalDomain(grid, label=lb), "Numerical")
    cls = LogUniform if log_distributed else Uniform
    return _decide(label, lambda lb: cls(low, high, label=lb), "Numerical")


def ensure_frozen(mutable: Any, *, strict: bool = True, sample: Mapping[str, Any] | None = None, retries: int = 1) -> Any:
    """The concrete value of ``mutable``: inside a space's construction choices already are values;
    a placeholder is resolved from ``sample``."""
    if isinstance(mutable, Choice):
        if sample is not None:
            return mutable.resolve(sample)
        resolver = active_resolver()
        if resolver is not None:
            return resolver.resolve(mutable.label, mutable.domain, mutable.source)
        if strict:
            raise SampleValidationError(f"ensure_frozen: {mutable!r} has no value outside a model space's construction")
    return mutable


def frozen_context(sample: Mapping[str, Any]) -> Any:
    """``with frozen_context(sample): model = Space()`` builds the model of ``sample`` (= ``fixed_arch``)."""
    return fixed_arch(sample)


frozen = frozen_context


class Mutable:
    """NNI's base class of mutables. tridens has no mutable objects to subclass: choices are
    values inside a space's construction; subclassing it raises, naming the alternative."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise NotSupported(f"{cls.__name__} subclasses nni.mutable.Mutable, which tridens does not provide: express the "
                           "decision with td.choice / td.uniform (or a tnn.LayerChoice) inside the space's __init__.")


class MutableExpression:
    """NNI's expression of mutables: refused; arithmetic on a tridens placeholder is an expression."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupported("nni.mutable.MutableExpression is not provided: arithmetic on a choice (w * 2, w // 4) "
                           "is already an expression in tridens (td.space.Expr).")


class ExpressionConstraint:
    """NNI's constraint on mutables: refused, naming tridens' constraints."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupported("nni.mutable.ExpressionConstraint is not provided: raise SampleValidationError "
                           "(td.InvalidSample) in the space's __init__ for an invalid sample, or bound measured facts "
                           "with td.Experiment(..., options=td.RunOptions(constraints=[td.strategy.Constraint('params', max=...)])).")
