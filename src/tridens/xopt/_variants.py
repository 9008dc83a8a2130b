"""Activation variants: models that differ only in their parameter-free elementwise activation
modules (``nn.ReLU`` here, ``nn.Tanh`` there -- the commonest choice in a search space) stack into
one fused unit. The structure key sees every activation *site* as the same placeholder; each
model's choice at each site is its *variant*, and the fused forward applies each row's own
activation (on a slice of the stacked tensor: the same elementwise function on the same values, so
fused still equals separate bit for bit).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch.nn as nn

# Elementwise, parameter-free, shape-preserving modules: any one can stand in for another at a site.
ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Hardswish, nn.Hardtanh,
    nn.Mish, nn.Softplus, nn.Identity)

def is_site(module: nn.Module) -> bool:
    """An activation module another activation can replace: one of :data:`ACTIVATIONS` exactly
    (not a subclass, whose forward may be anything), with no parameters, buffers, children or hooks."""
    return type(module) in ACTIVATIONS and not module._parameters and not module._buffers and \
        not module._modules and not has_hooks(module)


def is_hook_attribute(key: str) -> bool:
    """A module attribute that holds registered hooks (``_forward_hooks``, ``_backward_pre_hooks``, ...)."""
    return key.startswith("_") and key.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called"))


def has_hooks(module: nn.Module) -> bool:
    """Whether any hook is registered on ``module`` itself."""
    return any(value for key, value in module.__dict__.items() if is_hook_attribute(key))


def sites(model: nn.Module) -> dict[str, nn.Module]:
    """The model's activation sites by qualified name (a module registered under two names: the first)."""
    out: dict[str, nn.Module] = {}
    seen: set[int] = set()
    for name, m in model.named_modules():
        if name and is_site(m) and id(m) not in seen:
            seen.add(id(m))
            out[name] = m
    return out


def describe(module: nn.Module) -> tuple[Any, ...]:
    """What tells one activation from another: its class and plain settings (``inplace`` left out:
    the fused forward never runs in place)."""
    attrs = tuple(sorted((k, repr(v)) for k, v in module.__dict__.items()
                         if k not in ("training", "inplace") and not k.startswith("_")))
    return (type(module).__module__, type(module).__qualname__, attrs)


def variant(model: nn.Module) -> tuple[Any, ...]:
    """The model's choice at every site: ``((name, description), ...)`` in module order."""
    return tuple((name, describe(m)) for name, m in sites(model).items())


@contextlib.contextmanager
def sites_as_placeholders(model: nn.Module) -> Iterator[None]:
    """Within the block, every site of ``model`` is one ``nn.Identity`` (for a structure key that
    does not tell activation variants apart); restored on exit."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    placeholder = nn.Identity()
    try:
        for parent in list(model.modules()):
            for child_name, child in list(parent._modules.items()):
                if child is not None and is_site(child):
                    swapped.append((parent, child_name, child))
                    parent._modules[child_name] = placeholder
        yield
    finally:
        for parent, child_name, child in reversed(swapped):
            parent._modules[child_name] = child


def order_by_variant(models: Sequence[nn.Module]) -> list[int]:
    """Indices of ``models`` with each variant's together, variants in order of first appearance
    (stable within a variant): a fused unit then applies each activation to one slice of its rows."""
    first: dict[tuple[Any, ...], int] = {}
    keys = [first.setdefault(variant(m), len(first)) for m in models]
    return sorted(range(len(models)), key=lambda i: keys[i])


def runs(rows: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """``(start, end, value)`` for each run of equal consecutive ``rows``."""
    out: list[tuple[int, int, Any]] = []
    for i, value in enumerate(rows):
        if out and out[-1][2] == value:
            out[-1] = (out[-1][0], i + 1, value)
        else:
            out.append((i, i + 1, value))
    return out
