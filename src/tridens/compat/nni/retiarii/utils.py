"""``nni.retiarii.utils`` (NNI 2.x): the helpers NNI scripts import.

``original_state_dict_hooks`` is a no-op context (a frozen tridens model has the state-dict names
of a plain module already); ``NoContextError`` is the error of a choice outside a space."""

import contextlib
from typing import Any, Iterator

from tridens.errors import InvalidSpace

from .serializer import trace_symbol

__all__ = ["NoContextError", "original_state_dict_hooks", "trace_symbol"]

NoContextError = InvalidSpace


@contextlib.contextmanager
def original_state_dict_hooks(model: Any) -> Iterator[None]:
    """A no-op: tridens' models keep their own state-dict names."""
    yield
