"""``fixed_arch`` / ``model_context``: build a space's class as the concrete model of one sample.

Inside the context, constructing a ``ModelSpace`` subclass resolves every choice from the
sample (the mechanism ``space.freeze`` uses), so NNI's idiom works unchanged::

    with fixed_arch(exp.export_top_models(formatter="dict")[0]):
        model = MyModelSpace()          # the chosen architecture, freshly initialised
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

from tridens.errors import InvalidSample, TridensError
from tridens.files import MANIFEST_BYTES, regular_file
from tridens.space._context import FixedResolver, using
from tridens.space._domain import Domain

__all__ = ["fixed_arch", "model_context"]


@contextlib.contextmanager
def fixed_arch(fixed_arch: str | os.PathLike[str] | Mapping[str, Any], verbose: bool = True) -> Iterator[None]:
    """``nni.retiarii.fixed_arch`` / ``nni.nas.fixed.fixed_arch``: ``fixed_arch`` is a sample (dict)
    or the path of a JSON file holding one. A label the space asks for and the sample lacks is
    an ``InvalidSample`` naming it."""
    if isinstance(fixed_arch, (str, os.PathLike)):
        path = Path(fixed_arch)
        try:
            sample = json.loads(regular_file(path, max_bytes=MANIFEST_BYTES, what="fixed_arch file").read_text())
        except (OSError, ValueError, TridensError) as err:
            raise InvalidSample(f"fixed_arch: cannot read a sample from {path}: {err}") from err
    else:
        sample = fixed_arch
    if not isinstance(sample, Mapping):
        raise InvalidSample(f"The 'fixed_arch' parameter of fixed_arch must be a dict (label -> value) or a JSON file "
                            f"holding one. Got {type(sample).__name__} instead.")
    with using(_NniFixedResolver(dict(sample))):
        yield


class _NniFixedResolver(FixedResolver):
    """Reads a ``LayerChoice``'s value as NNI does: the index of a list candidate may be a string
    (``"2"``, as NNI's SPOS ``architecture_final.json`` writes it), and NNI 2.x's graph engine names a
    candidate ``layerchoice_{label}_{name}``."""

    def resolve(self, label: str, domain: Domain, source: str = "choice") -> Any:
        value = self.sample.get(label)
        if source == "layer_choice" and isinstance(value, str) and not domain.contains(value):
            name = value.removeprefix(f"layerchoice_{label}_")
            if not domain.contains(name) and name.isdigit() and domain.contains(int(name)):
                name = int(name)  # type: ignore[assignment]
            self.sample = {**self.sample, label: name}
        return super().resolve(label, domain, source)


def model_context(sample: Mapping[str, Any]) -> Any:
    """``nni.nas.space.model_context(sample)`` (NNI 3): the same as :func:`fixed_arch`."""
    return fixed_arch(sample)
