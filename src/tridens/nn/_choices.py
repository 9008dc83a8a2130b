"""Structural choices: LayerChoice, InputChoice, Repeat.

Each is a function that, while a space is being built, asks the active resolver for its label
and returns a *plain* module: the chosen candidate, a fixed input selector, an ``nn.Sequential``.
A frozen model therefore has no choice machinery left in its forward.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import InvalidSpace
from ..space import active_resolver, resolve
from ..space import Categorical, RandInt

__all__ = ["LayerChoice", "InputChoice", "Repeat", "ChosenInputs", "instantiate_candidate"]

ModuleOrFactory = nn.Module | Callable[[], nn.Module]


def _label(label: str | None, kind: str) -> str:
    if label is not None:
        return label
    resolver = active_resolver()
    if resolver is None:
        raise InvalidSpace(f"{kind} must be created inside a ModelSpace's __init__")
    return resolver.auto_label(kind)


def instantiate_candidate(candidate: Any, label: str) -> nn.Module:
    """A LayerChoice candidate as a module: a module itself, or what a factory returns; anything
    else is an InvalidSpace error naming ``label``."""
    if isinstance(candidate, nn.Module):
        return candidate
    if callable(candidate):
        module = candidate()
        if isinstance(module, nn.Module):
            return module
    raise InvalidSpace(f"candidate {candidate!r} of label {label!r} is not an nn.Module or a factory of one")


def LayerChoice(candidates: Sequence[ModuleOrFactory] | Mapping[str, ModuleOrFactory], *, label: str | None = None) -> nn.Module:
    """One of several layers. The sample holds the index (list) or the key (dict).

    Candidates may be modules or zero-argument factories (only the chosen one is built).

    >>> self.op = tnn.LayerChoice([nn.Conv2d(8, 8, 3, padding=1), nn.Identity()], label="op")  # doctest: +SKIP
    """
    label = _label(label, "layerchoice")
    if isinstance(candidates, Mapping):
        domain = Categorical(dict(candidates), label=label)
    else:
        domain = Categorical(list(candidates), label=label, indexed=True)
    return instantiate_candidate(resolve(label, domain, "layer_choice"), label)


class ChosenInputs(nn.Module):
    """Selects fixed inputs from a list and reduces them: the frozen form of an InputChoice."""

    def __init__(self, indices: Sequence[int], reduction: str = "sum"):
        super().__init__()
        self.indices = [int(i) for i in indices]
        self.reduction = reduction

    def forward(self, inputs: Sequence[torch.Tensor]) -> Any:
        chosen = [inputs[i] for i in self.indices]
        if self.reduction == "none":
            return chosen
        if len(chosen) == 1:
            return chosen[0]
        if self.reduction == "concat":
            return torch.cat(chosen, dim=1)
        total = chosen[0]
        for x in chosen[1:]:
            total = total + x
        return total / len(chosen) if self.reduction == "mean" else total

    def extra_repr(self) -> str:
        return f"indices={self.indices}, reduction={self.reduction!r}"


_REDUCTIONS = ("sum", "mean", "concat", "none")


def InputChoice(n_candidates: int, n_chosen: int = 1, reduction: str = "sum", *, label: str | None = None) -> nn.Module:
    """Choose ``n_chosen`` of ``n_candidates`` inputs and reduce them (sum, mean, concat, none).

    Call the result with the list of candidate tensors. The sample holds the chosen index
    (``n_chosen=1``) or the sorted list of indices.

    >>> self.skip = tnn.InputChoice(n_candidates=3, n_chosen=1, label="skip")  # doctest: +SKIP
    >>> y = self.skip([x0, x1, x2])                                             # doctest: +SKIP
    """
    label = _label(label, "inputchoice")
    if not isinstance(n_candidates, int) or n_candidates < 1:
        raise InvalidSpace(f"The 'n_candidates' parameter of InputChoice {label!r} must be an int >= 1. Got {n_candidates!r} instead.")
    if not isinstance(n_chosen, int) or not 1 <= n_chosen <= n_candidates:
        raise InvalidSpace(f"The 'n_chosen' parameter of InputChoice {label!r} must be an int in [1, {n_candidates}]. Got {n_chosen!r} instead.")
    if reduction not in _REDUCTIONS:
        raise InvalidSpace(f"The 'reduction' parameter of InputChoice {label!r} must be one of {list(_REDUCTIONS)}. Got {reduction!r} instead.")
    hook = getattr(active_resolver(), "input_choice", None)
    if hook is not None:  # a one-shot supernet (tridens.oneshot) holds every input
        return hook(label, n_candidates, n_chosen, reduction)
    if n_chosen == 1:
        domain = Categorical(list(range(n_candidates)), label=label)
        picked = resolve(label, domain, "input_choice")
        return ChosenInputs([picked], reduction)
    combos = [list(c) for c in itertools.combinations(range(n_candidates), n_chosen)]
    picked = resolve(label, Categorical(combos, label=label), "input_choice")
    return ChosenInputs(picked, reduction)


def Repeat(blocks: Callable[[int], nn.Module] | nn.Module | Sequence[nn.Module],
           depth: int | tuple[int, int], *, label: str | None = None) -> nn.Sequential:
    """``depth`` blocks in sequence; ``depth`` may be a choice (``td.choice("depth", [1, 2, 3])``)
    or a ``(min, max)`` range that becomes its own label.

    ``blocks`` is a factory ``i -> module`` (choices inside it that exist only for block i are
    conditional on the depth), a module (deep-copied) or a list of modules (the first ``depth``).

    >>> self.blocks = tnn.Repeat(lambda i: Block(w), depth=td.choice("depth", [1, 2, 3]))  # doctest: +SKIP
    """
    if isinstance(depth, tuple):
        if len(depth) != 2 or not all(isinstance(d, int) for d in depth):
            raise InvalidSpace(f"The 'depth' parameter of Repeat must be an int, a choice or (min, max). Got {depth!r} instead.")
        label = _label(label, "repeat")
        depth = resolve(label, RandInt(depth[0], depth[1], label=label) if depth[0] < depth[1] else Categorical([depth[0]], label=label), "repeat")
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise InvalidSpace(f"The 'depth' parameter of Repeat must be a non-negative int. Got {depth!r} instead.")
    hook = getattr(active_resolver(), "repeat", None)
    built = hook(blocks, depth) if hook is not None else None
    if built is not None:  # a one-shot supernet (tridens.oneshot): the largest depth, cut per sample
        return built
    if isinstance(blocks, nn.Module):
        return nn.Sequential(*[copy.deepcopy(blocks) for _ in range(depth)])
    if isinstance(blocks, Sequence):
        if depth > len(blocks):
            raise InvalidSpace(f"Repeat got depth {depth} but only {len(blocks)} blocks")
        return nn.Sequential(*list(blocks)[:depth])
    return nn.Sequential(*[blocks(i) for i in range(depth)])
