"""Model spaces: discovery of every label (conditions included) and freezing a sample.

``class Net(tnn.ModelSpace)``: constructing ``Net(...)`` runs its ``__init__`` under a
recording resolver (see :mod:`._context`), so every ``td.choice`` gets its default and is written
down; the result is a working model with default choices that also describes its space.
``space.freeze(sample)`` re-runs the same ``__init__`` under a fixed resolver and returns the
concrete model. Discovery re-runs ``__init__`` on the meta device with other values of each
finite label to find labels that exist only under some values (the kernel of block 3 exists only
when depth >= 3).
"""

from __future__ import annotations

import contextlib
import random
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..errors import InvalidSample, InvalidSpace
from ._choice import Placeholder
from ._context import FixedResolver, RecordingResolver, Resolver, active_resolver, using
from ._domain import Condition, Domain, LabelSpec, SearchSpace, same_value

__all__ = ["BaseSpace", "ModelSpace", "Mutation", "discover"]

# Discovery enumerates the values of finite labels up to this many values per label.
_MAX_ENUMERATED_VALUES = 32
_MAX_DISCOVERY_RUNS = 5000


class Mutation(dict):
    """One step of a concrete model's history: who decided (``"inline"`` or a mutator's name)
    and the choices made, in order. A dict: ``{"by": "AddBatchNorm", "choices": {...}}``."""

    @property
    def by(self) -> str:
        return self["by"]

    @property
    def choices(self) -> dict[str, Any]:
        return self["choices"]


class BaseSpace:
    """What every space offers: description, sampling, validation and freezing.

    Subclasses implement ``_build(resolver, discovery)`` (construct the concrete model while
    ``resolver`` is active) and may provide ``example_inputs``.
    """

    example_inputs: tuple[torch.Tensor, ...] | None = None
    #: True when every label exists in every model (no choice decides whether another label is
    #: asked): discovery then needs only the first construction instead of one per value.
    labels_unconditional: bool = False

    # -- to implement -------------------------------------------------------------------------
    def _build(self, resolver: Resolver, discovery: bool) -> nn.Module:  # pragma: no cover
        raise NotImplementedError

    def _history(self, resolver: Resolver, model: nn.Module) -> list[Mutation]:
        return [Mutation(by="inline", choices={k: v[1] for k, v in resolver.asked.items()})]

    def _base_trace(self) -> dict[str, tuple[Domain, Any, str]] | None:
        return None

    # -- public API ----------------------------------------------------------------------------
    def search_space(self) -> SearchSpace:
        """Every label with its domain and condition, in an order where parents come first.

        >>> space.search_space().describe()          # doctest: +SKIP
        {'width': {'type': 'categorical', 'values': [16, 32], 'source': 'choice'}, ...}
        """
        cached = self.__dict__.get("_tridens_search_space")
        if cached is None:
            base = self._base_trace()
            if self.labels_unconditional:
                trace = base if base is not None else self._discovery_run({})
                cached = SearchSpace([LabelSpec(label, domain, [], source) for label, (domain, _, source) in trace.items()])
            else:
                cached = discover(self._discovery_run, base)
            rules = self.__dict__.get("_tridens_rules")
            if rules:
                cached = SearchSpace(list(cached.values()), rules)
            self.__dict__["_tridens_search_space"] = cached
        return cached

    def size(self) -> float:
        """Number of distinct samples (``math.inf`` if a continuous label is active)."""
        return self.search_space().size()

    def random_sample(self, rng: random.Random | int | None = None) -> dict[str, Any]:
        """A random valid sample. ``space.random_sample(random.Random(0))``"""
        return self.search_space().random_sample(rng)

    def default_sample(self) -> dict[str, Any]:
        """The sample of every label's first candidate (what the space object itself computes)."""
        return self.search_space().default_sample()

    def restrict(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        """The labels of ``sample`` that belong to this space (an experiment's samples also hold
        the evaluator's hyperparameters)."""
        labels = self.search_space()
        return {k: v for k, v in sample.items() if k in labels}

    def validate(self, sample: Mapping[str, Any], example_inputs: Any = None) -> dict[str, Any]:
        """Check labels and values and, with example inputs (``example_inputs``, else the space's
        own), that the model's forward runs on them, as :meth:`freeze` does; return the sample
        restricted to its active labels. Raises :class:`InvalidSample`."""
        clean = self.search_space().validate(sample)
        if example_inputs is not None or self.example_inputs is not None:
            self.freeze(clean, example_inputs=example_inputs)
        return clean

    def freeze(self, sample: Mapping[str, Any], *, example_inputs: Any = None, check: bool | None = None,
               device: str | torch.device | None = None) -> nn.Module:
        """The concrete model of ``sample``: a plain ``nn.Module`` with no choices left.

        The model carries ``tridens_sample`` (the sample) and ``tridens_history`` (a list of
        :class:`Mutation`). When example inputs are known (argument or ``space.example_inputs``)
        a forward pass checks that the shapes fit, unless ``check=False``.

        ``device="meta"`` builds the structure only (no weights allocated or initialised, no
        forward check): what a fingerprint needs, several times cheaper for large models; the
        engine deduplicates this way before it initialises a model. Mutator spaces trace their
        base on the CPU, so for them ``"meta"`` builds a normal model.

        >>> model = space.freeze({"width": 32, "op": 1})   # doctest: +SKIP
        """
        clean = self.search_space().validate(sample)
        meta = device is not None and torch.device(device).type == "meta"
        resolver = FixedResolver(clean)
        with using(resolver):
            try:
                model = self._build(resolver, discovery=meta)
            except InvalidSample as err:
                raise InvalidSample(f"sample {dict(clean)} is invalid: {err}") from err
        if device is not None and not meta:
            model = model.to(device)
        inputs = _as_tuple(example_inputs if example_inputs is not None else self.example_inputs)
        if inputs is not None and check is not False and not meta:
            check_forward(model, inputs, clean)
        # plain attributes of the built module (nn.Module's own attribute typing covers tensors/modules)
        setattr(model, "tridens_sample", dict(clean))
        setattr(model, "tridens_history", self._history(resolver, model))
        return model

    # -- discovery -------------------------------------------------------------------------------
    def _discovery_run(self, assignment: Mapping[str, Any]) -> dict[str, tuple[Domain, Any, str]]:
        resolver = RecordingResolver(assignment)
        with using(resolver):
            self._build(resolver, discovery=True)
        return resolver.asked


class _SpaceMeta(type):
    """Constructing a top-level ModelSpace runs its ``__init__`` under a recording resolver.

    Inside an active resolver (a freeze, a discovery run, or a space nested in another space)
    construction is ordinary. This is the only place the class of a space is involved.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if active_resolver() is not None:
            resolver = active_resolver()
            assert resolver is not None
            return super().__call__(*_resolve_args(resolver, args), **_resolve_args(resolver, kwargs))
        resolver = RecordingResolver()
        with using(resolver):
            obj = super().__call__(*_resolve_args(resolver, args), **_resolve_args(resolver, kwargs))
        obj.__dict__["_tridens_init"] = (args, kwargs)
        obj.__dict__["_tridens_first_trace"] = dict(resolver.asked)
        obj.__dict__["_tridens_rules"] = list(resolver.rules)
        return obj


class ModelSpace(nn.Module, BaseSpace, metaclass=_SpaceMeta):
    """Base class of a model space written as a PyTorch module with inline choices.

    >>> import tridens as td
    >>> from torch import nn
    >>> from tridens import nn as tnn
    >>> class Net(tnn.ModelSpace):
    ...     def __init__(self):
    ...         super().__init__()
    ...         w = td.choice("width", [8, 16])
    ...         self.fc = nn.Linear(4, w)
    ...     def forward(self, x):
    ...         return self.fc(x)
    >>> space = Net()
    >>> space.freeze({"width": 16}).fc.out_features
    16

    The space object itself is a working model built with every label's first candidate.
    Set ``self.example_inputs = (tensor, ...)`` in ``__init__`` (or pass ``example_inputs=`` to
    ``freeze``) to have samples whose shapes don't fit rejected with the failing layer named.
    """

    def _build(self, resolver: Resolver, discovery: bool) -> nn.Module:
        init = self.__dict__.get("_tridens_init")
        if init is None:
            raise InvalidSpace(f"{type(self).__name__} is a frozen model, not a space: it has no choices left")
        args, kwargs = init
        with (_meta_device() if discovery and not self.__dict__.get("_tridens_no_meta") else contextlib.nullcontext()):
            return type(self)(*args, **kwargs)

    def _discovery_run(self, assignment: Mapping[str, Any]) -> dict[str, tuple[Domain, Any, str]]:
        try:
            return super()._discovery_run(assignment)
        except (InvalidSpace, InvalidSample):
            raise
        except Exception:
            if self.__dict__.get("_tridens_no_meta"):
                raise
            # Some constructors compute on tensors; they cannot run on the meta device.
            self.__dict__["_tridens_no_meta"] = True
            return super()._discovery_run(assignment)

    def _base_trace(self) -> dict[str, tuple[Domain, Any, str]] | None:
        return self.__dict__.get("_tridens_first_trace")

    @classmethod
    def from_base(cls, model: nn.Module, mutators: Sequence[Any] = (), example_inputs: Any = None) -> "BaseSpace":
        """A space made of a base model plus graph mutators (Retiarii's Mutator).

        ``model`` may be a plain module or a ModelSpace (inline choices and mutators combine).

        >>> space = td.ModelSpace.from_base(BaseNet(), [AddBatchNorm()], example_inputs=(x,))  # doctest: +SKIP
        """
        from ._mutator import MutatorSpace

        return MutatorSpace(model, mutators, example_inputs)


# ---------------------------------------------------------------------------------------------
def discover(run: Callable[[Mapping[str, Any]], dict[str, tuple[Domain, Any, str]]],
             base: dict[str, tuple[Domain, Any, str]] | None = None) -> SearchSpace:
    """Find every label of a space and the conditions under which it exists.

    ``run(assignment)`` builds the space with some labels fixed (others at their default) and
    returns the labels asked, in order. Starting from the all-default run, every finite label is
    set to each of its other values; a label present for only some values of another label gets
    the condition ``other in values`` (plus the conditions of ``other``); labels that appear only
    under a value are explored in turn, so nested conditions (a choice inside block 3 inside a
    depth choice) are found.
    """
    specs: dict[str, LabelSpec] = {}
    runs = [0]

    def do_run(assignment: Mapping[str, Any]) -> dict[str, tuple[Domain, Any, str]]:
        runs[0] += 1
        if runs[0] > _MAX_DISCOVERY_RUNS:
            raise InvalidSpace(f"discovery of the space needed more than {_MAX_DISCOVERY_RUNS} constructions; "
                               "reduce the number of labels that change which other labels exist")
        trace = run(assignment)
        for label, (domain, _, source) in trace.items():
            known = specs.get(label)
            if known is None:
                specs[label] = LabelSpec(label, domain, [], source)
            elif not known.domain.same_as(domain):
                raise InvalidSpace(
                    f"label {label!r} has different candidates depending on other choices "
                    f"({known.domain!r} vs {domain!r} under {dict(assignment)}); give each its own label")
        return trace

    def add_condition(label: str, parent: str, values: list[Any]) -> None:
        spec = specs[label]
        for i, cond in enumerate(spec.conditions):
            if cond.parent == parent:
                merged = list(cond.values) + [v for v in values if not any(same_value(v, w) for w in cond.values)]
                spec.conditions[i] = Condition(parent, tuple(merged))
                return
        inherited = [c for c in specs[parent].conditions if all(c.parent != d.parent for d in spec.conditions)]
        spec.conditions = inherited + spec.conditions + [Condition(parent, tuple(values))]

    def explore(assignment: dict[str, Any], trace: dict[str, tuple[Domain, Any, str]], labels: list[str]) -> None:
        for label in labels:
            domain, current, _ = trace[label]
            if not domain.finite or domain.size() > _MAX_ENUMERATED_VALUES:
                continue
            by_value: list[tuple[Any, dict[str, tuple[Domain, Any, str]]]] = []
            for value in domain.values():
                same = same_value(value, current)
                by_value.append((value, trace if same else do_run({**assignment, label: value})))
            seen: dict[str, None] = {}
            for _, t in by_value:
                seen.update(dict.fromkeys(t))
            for other in seen:
                if other == label:
                    continue
                present = [v for v, t in by_value if other in t]
                if len(present) < len(by_value):
                    add_condition(other, label, present)
            for value, t in by_value:
                new = [lb for lb in t if lb not in trace]
                if new:
                    explore({**assignment, label: value}, t, new)

    first = base if base is not None else do_run({})
    if base is not None:
        for label, (domain, _, source) in base.items():
            specs.setdefault(label, LabelSpec(label, domain, [], source))
    explore({}, first, list(first))
    return SearchSpace(_parents_first(list(specs.values())))


def _parents_first(specs: list[LabelSpec]) -> list[LabelSpec]:
    by_label = {s.label: s for s in specs}
    out: list[LabelSpec] = []
    placed: set[str] = set()

    def place(spec: LabelSpec, stack: tuple[str, ...]) -> None:
        if spec.label in placed:
            return
        if spec.label in stack:
            raise InvalidSpace(f"labels {' -> '.join(stack + (spec.label,))} condition each other in a cycle")
        for cond in spec.conditions:
            if cond.parent in by_label:
                place(by_label[cond.parent], stack + (spec.label,))
        placed.add(spec.label)
        out.append(spec)

    for spec in specs:
        place(spec, ())
    return out


@contextlib.contextmanager
def _meta_device() -> Iterator[None]:
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _resolve_args(resolver: Resolver, obj: Any) -> Any:
    """Placeholders passed as constructor arguments (``Net(width=td.choice(...))``) are decided
    by the resolver of the construction."""
    if isinstance(obj, Placeholder):
        sample = {c.label: _value_via(resolver, c) for c in obj.labels()}
        return obj.resolve(sample)
    if isinstance(obj, dict):
        return {k: _resolve_args(resolver, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and any(isinstance(v, Placeholder) for v in obj):
        return type(obj)(_resolve_args(resolver, v) for v in obj)
    return obj


def _value_via(resolver: Resolver, choice: Any) -> Any:
    resolver.resolve(choice.label, choice.domain, choice.source)
    return resolver.value_of(choice.label)


def _as_tuple(inputs: Any) -> tuple[Any, ...] | None:
    if inputs is None:
        return None
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def check_forward(model: nn.Module, inputs: tuple[Any, ...], sample: Mapping[str, Any]) -> None:
    """Run ``model`` once on ``inputs``; if it fails, raise :class:`InvalidSample` naming the
    sample and the innermost layer whose forward raised."""
    names = {m: n for n, m in model.named_modules()}
    stack: list[nn.Module] = []

    def enter(mod: nn.Module, _args: Any) -> None:
        stack.append(mod)

    def leave(mod: nn.Module, _args: Any, _out: Any) -> None:  # must return None: a value replaces the output
        stack.pop()

    handles = []
    for m in names:
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(*inputs)
    except Exception as err:
        failing = stack[-1] if stack else model
        name = names.get(failing) or "<root>"
        detail = " ".join(str(err).split())
        raise InvalidSample(
            f"sample {dict(sample)} does not fit its example inputs: layer {name!r} "
            f"({type(failing).__name__}) failed: {detail}") from err
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
