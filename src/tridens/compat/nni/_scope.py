"""NNI's label scopes: ``label_scope("cell")`` and ``ModelSpace`` subclasses declared with
``label_prefix=`` put ``cell/`` before every label created by the compat choices inside them.

One :mod:`contextvars` variable holds the current prefix; only the compat layer's choices read it
(``nni.choice``, ``nni.mutable.Categorical``, ``ValueChoice``, the compat ``LayerChoice`` ...).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

__all__ = ["label_scope", "scoped", "current_prefix"]

_PREFIX: contextvars.ContextVar[str] = contextvars.ContextVar("nni_label_prefix", default="")


def current_prefix() -> str:
    """The labels' prefix in effect (``""`` outside any scope)."""
    return _PREFIX.get()


def scoped(label: str | None) -> str | None:
    """``label`` inside the current scope (``None`` stays ``None``: an automatic label)."""
    if label is None:
        return None
    prefix = _PREFIX.get()
    return f"{prefix}/{label}" if prefix else label


@contextlib.contextmanager
def label_scope(name: str | None = None) -> Iterator[str]:
    """``with label_scope("cell"):`` labels created inside start with ``cell/`` (scopes nest).

    >>> with label_scope("backbone"):
    ...     scoped("width")
    'backbone/width'
    """
    if not name:
        yield _PREFIX.get()
        return
    token = _PREFIX.set(scoped(name) or name)
    try:
        yield _PREFIX.get()
    finally:
        _PREFIX.reset(token)
