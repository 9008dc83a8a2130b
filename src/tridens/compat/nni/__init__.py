"""NNI 3.0's NAS API on tridens: change only the import lines of an NNI script.

    import nni                                    ->  import tridens.compat.nni as nni
    from nni.nas.nn.pytorch import ModelSpace    ->  from tridens.compat.nni.nas.nn.pytorch import ModelSpace
    from nni.nas.evaluator import ...            ->  from tridens.compat.nni.nas.evaluator import ...
    import nni.nas.strategy as strategy          ->  import tridens.compat.nni.nas.strategy as strategy
    from nni.nas.experiment import NasExperiment ->  from tridens.compat.nni.nas.experiment import NasExperiment

The README's "Migrating from NNI" section lists how each name maps onto tridens.
"""

from __future__ import annotations

import contextvars
from typing import Any, Sequence

import tridens as _td

from ._scope import scoped as _scoped

__all__ = ["choice", "uniform", "loguniform", "randint", "quniform", "report_intermediate_result",
           "report_final_result", "trace"]

# The value given to report_final_result in the running trial (read by the compat evaluator).
_FINAL: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("nni_final_result", default=None)


def choice(label: str, choices: Sequence[Any]) -> Any:
    """``nni.choice(label, choices)`` = ``td.choice``."""
    return _td.choice(_scoped(label), list(choices))


def uniform(label: str, low: float, high: float) -> Any:
    return _td.uniform(_scoped(label), low, high)


def loguniform(label: str, low: float, high: float) -> Any:
    return _td.loguniform(_scoped(label), low, high)


def randint(label: str, lower: int, upper: int) -> Any:
    """``nni.randint`` draws from ``[lower, upper)``; ``td.randint`` includes both ends."""
    return _td.randint(_scoped(label), lower, upper - 1)


def quniform(label: str, low: float, high: float, quantize: float) -> Any:
    """A uniform value rounded to ``quantize``: a finite choice in tridens."""
    n = int(round((high - low) / quantize))
    return _td.choice(_scoped(label), [round(low + i * quantize, 10) for i in range(n + 1)])


def report_intermediate_result(metric: Any) -> None:
    """``nni.report_intermediate_result`` = ``td.report`` (steps are counted for you)."""
    _td.report(metric)


def report_final_result(metric: Any) -> None:
    """The trial's final value; NNI reports it apart from the intermediate curve."""
    holder = _FINAL.get()
    if holder is None:
        _td.report(metric)  # outside a compat evaluator: the last report is the final value
        return
    holder.append(float(metric["default"] if isinstance(metric, dict) else metric))


def trace(cls_or_func: Any = None, **_: Any) -> Any:
    """``nni.trace`` is not needed in tridens (samples are JSON, code is referred to by import path)."""
    return cls_or_func if cls_or_func is not None else (lambda f: f)
