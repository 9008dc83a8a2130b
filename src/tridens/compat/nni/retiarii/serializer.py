"""``nni.retiarii.serializer`` (NNI 2.x): ``model_wrapper``, ``basic_unit``, ``serialize``, ``trace``,
``trace_symbol`` -- none needs to record anything in tridens, which refers to code by import path."""

from typing import Any

from .. import trace
from . import basic_unit, model_wrapper, serialize

__all__ = ["model_wrapper", "basic_unit", "serialize", "trace", "trace_symbol"]


def trace_symbol(symbol: Any = None, **_: Any) -> Any:
    """``trace_symbol(fn_or_cls)`` returns it unchanged (NNI records it for serialization)."""
    return symbol if symbol is not None else (lambda s: s)
