"""A package's names imported on first use (PEP 562 module ``__getattr__``): names whose modules
load PyTorch or Ray stay unloaded until a caller asks for them."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, MutableMapping, Sequence


def lazy_names(package: str, modules: Mapping[str, str], namespace: MutableMapping[str, Any],
               public: Sequence[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a name in ``modules`` (name -> the submodule
    that defines it, relative) is imported when first asked for and kept in ``namespace`` (the
    package's ``globals()``); ``public`` is its ``__all__``.

    >>> __getattr__, __dir__ = lazy_names("tridens", {"Trial": ".trial"}, {}, ["Trial"])
    >>> __getattr__("Trial").__name__
    'Trial'
    """
    def getattr_(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(public))

    return getattr_, dir_
