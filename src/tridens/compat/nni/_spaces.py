"""NNI's space primitives with NNI's label scoping, ``LayerChoice.label``, ``ModelSpace`` subclasses
declared with ``label_prefix=``, and the NAS-Bench cells, on ``tridens.nn`` and ``tridens.hub``."""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from tridens import hub as _hub
from tridens import nn as _tnn
from tridens.space._context import active_resolver

from ._scope import current_prefix, label_scope, scoped

__all__ = ["ModelSpace", "LayerChoice", "InputChoice", "Repeat", "Cell", "NasBench101Cell", "NasBench201Cell",
           "UnboundLayerChoice", "UnboundInputChoice", "PlainModuleSpace", "has_unbound_choices"]


_OUTSIDE = ("{kind} was created outside a model space: tridens builds a space by running its __init__ under its "
            "resolver (a plain torch.nn.Module may hold only LayerChoice and InputChoice, as NNI 2.x's one-shot "
            "trainers take it). Derive the class from tridens.compat.nni.retiarii.nn.pytorch's nn.Module (NNI 2.x's "
            "one-shot trainers then take it as it is), decorate it with @model_wrapper (tridens.compat.nni.retiarii), "
            "or derive it from ModelSpace (tridens.compat.nni.nas.nn.pytorch).")


def _label(label: str | None, kind: str) -> str | None:
    """The label in the current scope; an automatic one gets the scope's prefix too. Refuses a
    choice built outside any space's construction."""
    if active_resolver() is None:
        from ._common import NotSupported

        raise NotSupported(_OUTSIDE.format(kind=kind))
    if label is not None:
        return scoped(label)
    prefix, resolver = current_prefix(), active_resolver()
    if prefix and resolver is not None:
        return f"{prefix}/{resolver.auto_label(kind)}"
    return None


class UnboundLayerChoice(nn.Module):
    """A ``LayerChoice`` built in a plain ``torch.nn.Module``, outside any space, as NNI 2.x lets
    its one-shot examples do: it holds the candidates and runs the first (NNI's behaviour). NNI 2.x's
    one-shot trainers and ``RetiariiExperiment`` make the module holding it a space
    (:class:`PlainModuleSpace`), where it becomes a ``tnn.LayerChoice`` of the same candidates."""

    def __init__(self, candidates: Any, label: str | None):
        super().__init__()
        from ._common import NotSupported

        named = dict(candidates) if isinstance(candidates, Mapping) else dict(enumerate(candidates))
        if not named or not all(isinstance(c, nn.Module) for c in named.values()):
            raise NotSupported(f"A LayerChoice{f' {label!r}' if label else ''} built outside a model space takes "
                               "nn.Module candidates (a list or a dict). Got "
                               f"{[type(c).__name__ for c in named.values()]} instead.")
        self.keys = list(named)
        self.candidates = nn.ModuleList(list(named.values()))
        self.named = isinstance(candidates, Mapping)
        self.label = label

    def choices(self) -> Any:
        """The candidates as given: a dict by key, or a list."""
        return dict(zip(self.keys, self.candidates)) if self.named else list(self.candidates)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.candidates[0](*args, **kwargs)


class UnboundInputChoice(nn.Module):
    """An ``InputChoice`` built in a plain ``torch.nn.Module`` (see :class:`UnboundLayerChoice`):
    it reads the first ``n_chosen`` inputs until its module is made a space."""

    def __init__(self, n_candidates: int, n_chosen: int, reduction: str, label: str | None):
        super().__init__()
        self.n_candidates, self.n_chosen, self.reduction, self.label = n_candidates, n_chosen, reduction, label
        self.first = _tnn.ChosenInputs(list(range(n_chosen)), reduction)

    def forward(self, inputs: Sequence[torch.Tensor]) -> Any:
        return self.first(inputs)


class PlainModuleSpace(_tnn.ModelSpace):
    """A plain module holding :class:`UnboundLayerChoice` / :class:`UnboundInputChoice` as a space:
    each build copies ``template`` and puts a ``tnn.LayerChoice`` / ``tnn.InputChoice`` of the same
    candidates where each unbound one is, labelled as given (or by its path in the module). Only
    structural choices can be unbound: a value chosen in a constructor needs the constructor to run
    again (derive the class from ``nni.retiarii.nn.pytorch``'s ``Module``, or ``@model_wrapper``).

    >>> space = PlainModuleSpace(CNN(8, 1, 4, 10, 2))   # NNI's examples/nas/oneshot/darts model  # doctest: +SKIP
    """

    def __init__(self, template: nn.Module):
        super().__init__()
        model = copy.deepcopy(template)
        for name, module in list(model.named_modules()):
            if isinstance(module, UnboundLayerChoice):
                bound = _tnn.LayerChoice(module.choices(), label=module.label or name)
            elif isinstance(module, UnboundInputChoice):
                bound = _tnn.InputChoice(module.n_candidates, module.n_chosen, module.reduction,
                                         label=module.label or name)
            else:
                continue
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, bound)
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


def has_unbound_choices(model: Any) -> bool:
    """Whether ``model`` is a plain module holding choices built outside any space."""
    return isinstance(model, nn.Module) and any(isinstance(m, (UnboundLayerChoice, UnboundInputChoice))
                                                for m in model.modules())


def LayerChoice(candidates: Any, *, prior: Any = None, label: str | None = None, **_: Any) -> nn.Module:
    """``tnn.LayerChoice``; the module built carries ``.label`` as NNI's does. Outside any space
    (in a plain ``torch.nn.Module``), an :class:`UnboundLayerChoice`."""
    from ._common import only_default

    only_default("LayerChoice", "prior", prior, None, "tridens' strategies sample candidates uniformly.")
    if active_resolver() is None:
        return UnboundLayerChoice(candidates, scoped(label) if label is not None else None)
    module = _tnn.LayerChoice(candidates, label=_label(label, "layerchoice"))
    if "label" not in module.__dict__ and not hasattr(type(module), "label"):
        module.label = label_of(module, label)
    return module


def label_of(module: nn.Module, given: str | None) -> str:
    """The label a LayerChoice was decided under: its own (a one-shot ``MixedLayer``'s), the given one
    in scope, or the last one the construction asked."""
    own = getattr(module, "label", None)
    if isinstance(own, str):
        return own
    if given is not None:
        return scoped(given) or given
    resolver = active_resolver()
    return next(reversed(resolver.asked)) if resolver is not None and resolver.asked else "layerchoice"


def InputChoice(n_candidates: int, n_chosen: int = 1, reduction: str = "sum", *, prior: Any = None,
                label: str | None = None, **_: Any) -> nn.Module:
    """``tnn.InputChoice`` in the current label scope; outside any space, an :class:`UnboundInputChoice`."""
    if active_resolver() is None:
        return UnboundInputChoice(n_candidates, n_chosen, reduction, scoped(label) if label is not None else None)
    return _tnn.InputChoice(n_candidates, n_chosen, reduction, label=_label(label, "inputchoice"))


def Repeat(blocks: Any, depth: Any, *, label: str | None = None) -> nn.Module:
    """``tnn.Repeat`` in the current label scope."""
    return _tnn.Repeat(blocks, depth, label=_label(label, "repeat"))


def Cell(op_candidates: Any, num_nodes: int, num_ops_per_node: int = 1, num_predecessors: int = 1,
         merge_op: str = "all", preprocessor: Any = None, postprocessor: Any = None, concat_dim: int = 1,
         *, label: str | None = None) -> nn.Module:
    """``tnn.Cell`` (NNI's labels ``{label}/op_{n}_{k}``, ``{label}/input_{n}_{k}``); ``preprocessor`` and
    ``postprocessor`` wrap it as NNI's do."""
    cell = _tnn.Cell(op_candidates, num_nodes, num_ops_per_node, num_predecessors, merge_op, concat_dim=concat_dim,
                     label=_label(label, "cell"))
    if preprocessor is None and postprocessor is None:
        return cell
    return _ProcessedCell(cell, preprocessor, postprocessor)


class _ProcessedCell(nn.Module):
    def __init__(self, cell: nn.Module, preprocessor: nn.Module | None, postprocessor: nn.Module | None):
        super().__init__()
        self.preprocessor, self.cell, self.postprocessor = preprocessor, cell, postprocessor
        self.output_node_indices = getattr(cell, "output_nodes", None)

    def forward(self, *inputs: Any) -> Any:
        states = list(inputs[0]) if len(inputs) == 1 and isinstance(inputs[0], (list, tuple)) else list(inputs)
        if self.preprocessor is not None:
            states = list(self.preprocessor(states))
        out = self.cell(*states)
        return self.postprocessor(out, states) if self.postprocessor is not None else out


class _PrefixedSpaceMeta(type(_tnn.ModelSpace)):  # type: ignore[misc]
    """Builds a space declared with ``label_prefix=`` inside ``label_scope(prefix)``."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        with label_scope(getattr(cls, "_nni_label_prefix", None)):
            return super().__call__(*args, **kwargs)


class ModelSpace(_tnn.ModelSpace, metaclass=_PrefixedSpaceMeta):
    """``nni.nas.nn.pytorch.ModelSpace``: ``class Backbone(ModelSpace, label_prefix="backbone")`` prefixes
    the labels of the choices its ``__init__`` creates through the compat API."""

    def __init_subclass__(cls, label_prefix: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if label_prefix is not None:
            cls._nni_label_prefix = label_prefix


def NasBench101Cell(num_nodes: int, in_features: int, out_features: int,
                    op_candidates: Mapping[str, Callable[[int], nn.Module]], projection: Callable[[int, int], nn.Module],
                    max_num_edges: int = 9, label: str | None = None) -> nn.Module:
    """``NasBench101Cell`` = ``tridens.hub.NasBench101Cell`` (labels ``{label}/op{i}``, ``{label}/input{i}``)."""
    return _hub.NasBench101Cell(in_features, out_features, num_nodes, op_candidates, max_num_edges,
                                projection=projection, label=_label(label, "nasbench101cell") or "nasbench101cell")


class NasBench201Cell(nn.Module):
    """``NasBench201Cell(op_candidates, in_features, out_features, label=)``: four nodes, each edge
    ``j <- i`` a ``LayerChoice`` labelled ``{label}/{j}_{i}`` over ``op(in, out)`` factories (the
    input node has ``in_features``)."""

    def __init__(self, op_candidates: Mapping[str, Callable[[int, int], nn.Module]] | Sequence[Callable[[int, int], nn.Module]],
                 in_features: int, out_features: int, num_tries: Any = None, label: str | None = None):
        super().__init__()
        label = _label(label, "nasbench201cell") or "nasbench201cell"
        named = dict(op_candidates) if isinstance(op_candidates, Mapping) else {str(i): f for i, f in enumerate(op_candidates)}
        self.edges = nn.ModuleDict()
        for j in range(1, 4):
            for i in range(j):
                c_in = in_features if i == 0 else out_features
                self.edges[f"{j}_{i}"] = _tnn.LayerChoice(
                    {name: (lambda f=f, c_in=c_in: f(c_in, out_features)) for name, f in named.items()},
                    label=f"{label}/{j}_{i}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nodes = [x]
        for j in range(1, 4):
            total = self.edges[f"{j}_0"](nodes[0])
            for i in range(1, j):
                total = total + self.edges[f"{j}_{i}"](nodes[i])
            nodes.append(total)
        return nodes[3]
