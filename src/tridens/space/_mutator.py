"""Graph mutators (Retiarii's Mutator) and spaces made of a base model plus mutators."""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

from torch import nn

from ..errors import InvalidSpace
from ._context import Resolver, active_resolver, resolve
from ._domain import Categorical
from ._model_space import BaseSpace, ModelSpace, Mutation, _as_tuple

__all__ = ["Mutator", "MutatorSpace"]


class Mutator:
    """Edits the graph IR of a concrete model; each decision goes through :meth:`choice`.

    >>> class AddBatchNorm(td.Mutator):                               # doctest: +SKIP
    ...     def mutate(self, graph):
    ...         for node in graph.nodes(op_type=nn.Conv2d):
    ...             if self.choice([False, True], label=f"bn.{node.name}"):
    ...                 graph.insert_after(node, nn.BatchNorm2d(node.output_shape[1]))

    ``mutate`` must make the same decisions in the same order for the same sample (no hidden
    randomness): the sample alone determines the model.
    """

    #: Module types this mutator edits as whole nodes: the space traces them as leaves (one
    #: ``call_module`` node each) instead of tracing through their ``forward``.
    leaf_modules: tuple[type[nn.Module], ...] = ()

    def mutate(self, graph: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement mutate(graph)")

    def edit(self, graph: Any) -> None:
        """What a space runs on the traced graph: ``self.mutate(graph)``. A mutator written against
        another graph API (NNI's ``nni.retiarii.Mutator``) overrides it to hand ``mutate`` its own
        view of ``graph``."""
        self.mutate(graph)

    @property
    def name(self) -> str:
        return type(self).__name__

    def choice(self, candidates: Sequence[Any] | Mapping[str, Any], label: str | None = None) -> Any:
        """Decide among ``candidates`` under ``label`` (default: ``<MutatorName>_<n>`` in call order)."""
        resolver = active_resolver()
        if resolver is None:
            raise InvalidSpace(f"{self.name}.choice() was called outside a space's freeze or discovery")
        label = label if label is not None else resolver.auto_label(self.name)
        return resolve(label, Categorical(candidates, label=label), f"mutator:{self.name}")


class MutatorSpace(BaseSpace):
    """A base model plus mutators; build it with ``td.ModelSpace.from_base(...)``.

    Freezing a sample builds the base (re-running its inline choices if it is a ModelSpace),
    traces it to the graph IR on ``example_inputs``, applies each mutator in order and
    generates the concrete module from the edited graph.
    """

    def __init__(self, base: nn.Module, mutators: Sequence[Mutator], example_inputs: Any = None):
        if not isinstance(base, nn.Module):
            raise InvalidSpace(f"the base model of a space must be an nn.Module, got {type(base).__name__}")
        for m in mutators:
            if not isinstance(m, Mutator):
                raise InvalidSpace(f"mutators must be td.Mutator instances, got {m!r}")
        self.base = base
        self.mutators = list(mutators)
        inputs = example_inputs if example_inputs is not None else getattr(base, "example_inputs", None)
        if inputs is None:
            raise InvalidSpace("from_base needs example_inputs: mutators read the shapes of the traced graph")
        self.example_inputs = _as_tuple(inputs)

    def _base_model(self, resolver: Resolver) -> nn.Module:
        if isinstance(self.base, ModelSpace) and "_tridens_init" in self.base.__dict__:
            return self.base._build(resolver, discovery=False)
        return copy.deepcopy(self.base)

    def _build(self, resolver: Resolver, discovery: bool) -> nn.Module:
        from ..graph import trace

        model = self._base_model(resolver)
        history = [Mutation(by="inline", choices={k: v[1] for k, v in resolver.asked.items()})]
        leaves = tuple(dict.fromkeys(t for m in self.mutators for t in m.leaf_modules))
        graph = trace(model, self.example_inputs, leaf_modules=leaves)
        for mutator in self.mutators:
            before = set(resolver.asked)
            mutator.edit(graph)
            history.append(Mutation(by=mutator.name,
                                    choices={k: v[1] for k, v in resolver.asked.items() if k not in before}))
        resolver.history = history  # type: ignore[attr-defined]
        module = graph.to_module()
        return module

    def _history(self, resolver: Resolver, model: nn.Module) -> list[Mutation]:
        return list(getattr(resolver, "history", []))

    def __repr__(self) -> str:
        return f"MutatorSpace(base={type(self.base).__name__}, mutators={[m.name for m in self.mutators]})"
