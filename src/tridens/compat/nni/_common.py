"""What every NNI compat module shares: the error for what tridens cannot honour, and the rule
for arguments that have no tridens meaning.

The rule: an NNI argument whose meaning tridens has is renamed onto it; an argument that only
changes logging (``log_prob_every_n_step``, ``log_frequency``, ``workers``...) is accepted and
ignored; any other argument without a tridens meaning is accepted at NNI's default value and
refused, naming the argument and the tridens alternative, at any other value -- so a script
keeps running only where it would do what its author asked.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from tridens.errors import TridensError

__all__ = ["NotSupported", "refuse", "only_default", "tridens_kwargs"]


class NotSupported(TridensError, ValueError):
    """An NNI argument, class or feature that tridens does not provide (the message says what to use)."""


def refuse(owner: str, name: str, value: Any, instead: str) -> NotSupported:
    """The error for ``owner(name=value)``: says tridens has no such thing and what to use instead."""
    return NotSupported(f"The {name!r} parameter of {owner} has no tridens equivalent, so it can only be left at "
                        f"NNI's default. Got {value!r} instead. {instead}")


def _same(value: Any, default: Any) -> bool:
    if value is default:
        return True
    try:
        return bool(value == default) and type(value) is type(default)
    except Exception:  # e.g. tensors or objects whose == is not a bool
        return False


def only_default(owner: str, name: str, value: Any, default: Any, instead: str) -> None:
    """Raise :func:`refuse` unless ``value`` is NNI's ``default`` (``int``/``float`` defaults compare by value)."""
    if _same(value, default):
        return
    if isinstance(value, (int, float)) and isinstance(default, (int, float)) and not isinstance(value, bool) \
            and value == default:
        return
    raise refuse(owner, name, value, instead)


def tridens_kwargs(owner: str, target: Callable[..., Any], kwargs: Mapping[str, Any], nni_names: Any = (),
                   shown: str | None = None) -> dict[str, Any]:
    """``kwargs`` checked against the keyword parameters of the tridens ``target`` (its class
    hierarchy included): tridens options may be passed through an NNI constructor; anything else
    is an error naming the argument."""
    known: set[str] = set()
    classes = target.__mro__ if isinstance(target, type) else (target,)
    for cls in classes:
        init = cls.__init__ if isinstance(cls, type) else cls
        if init is object.__init__:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self":
                known.add(p.name)
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        name = unknown[0]
        raise NotSupported(f"{owner} got an unexpected parameter {name!r}. It takes NNI's "
                           f"{', '.join(sorted(nni_names)) or 'parameters'} and the options of "
                           f"{shown or getattr(target, '__qualname__', target)}: "
                           f"{', '.join(sorted(known))}.")
    return dict(kwargs)
