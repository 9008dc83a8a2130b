"""What an evaluator computes, as plain data: each parameter as text a later run can compare.

A resumed experiment must train its new trials as the earlier ones were trained. Its search
space says which labels vary; :func:`evaluator_fingerprint` says what stays fixed: every setting
(``epochs``, the batch size, the optimizer...), a digest of the data (``train``, ``val`` and
any other dataset parameter) and a digest of the code of a function parameter (the training loop
of a :class:`FunctionalEvaluator`, a loss, a transform: its syntax tree, so comments and
formatting do not count). A hyperparameter (``td.choice`` and friends) is named by its label;
the search space describes its domain.

>>> import torch, tridens as td
>>> ds = torch.utils.data.TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))
>>> fp = evaluator_fingerprint(td.evaluators.Classification(ds, ds, epochs=4, lr=td.choice("lr", [0.1, 0.2])))
>>> fp["epochs"], fp["lr"], fp["train"][:5]
('4', 'hyperparameter lr', 'data ')
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from ..space._choice import Placeholder
from ._stage_records import _hash_value, dataset_digest

__all__ = ["evaluator_fingerprint", "fingerprint_changes"]

#: Parameters that say where a trial runs, not what it computes.
_WHERE = ("device",)
#: Items of a dataset that is not made of tensors hashed for its digest (with its length).
_SAMPLED_ITEMS = 64


def _data_digest(dataset: Any) -> str:
    """The contents of a tensor dataset (every value); of another dataset, its length and a
    digest of up to :data:`_SAMPLED_ITEMS` items spread over it (reading every image of a large
    folder would cost more than the check is worth)."""
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    if isinstance(base, TensorDataset):
        digest = dataset_digest(dataset)
        if digest is not None:
            return digest
    n = len(dataset)
    h = hashlib.sha1(f"{type(dataset).__qualname__}:{n}".encode())
    step = max(1, n // _SAMPLED_ITEMS)
    try:
        ok = all(_hash_value(h, dataset[i]) for i in range(0, n, step))
    except Exception:
        ok = False
    return h.hexdigest() if ok else f"{type(dataset).__qualname__} of {n} items"


def _code_digest(fn: Any) -> str:
    """The code of a function (its syntax tree: comments and layout do not count), else its name."""
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    try:
        tree = ast.dump(ast.parse(textwrap.dedent(inspect.getsource(fn))), include_attributes=False)
    except (OSError, TypeError, SyntaxError, IndentationError):
        code = getattr(fn, "__code__", None)
        if code is None:
            return name
        tree = repr((code.co_code, code.co_consts, code.co_names))
    return f"{name} {hashlib.sha1(tree.encode()).hexdigest()[:16]}"


def _describe(value: Any) -> str:
    if isinstance(value, Placeholder):
        return f"hyperparameter {getattr(value, 'label', None) or value!r}"
    if isinstance(value, Dataset) or (hasattr(value, "__getitem__") and hasattr(value, "__len__")
                                      and hasattr(value, "tensors")):
        return f"data {_data_digest(value)}"
    if isinstance(value, torch.Tensor):
        h = hashlib.sha1()
        _hash_value(h, value)
        return f"tensor {h.hexdigest()}"
    if isinstance(value, torch.nn.Module):
        return f"module {type(value).__module__}.{type(value).__qualname__}: {' '.join(repr(value).split())}"
    if inspect.isfunction(value) or inspect.ismethod(value):
        return f"code {_code_digest(value)}"
    if inspect.isclass(value):
        return f"class {value.__module__}.{value.__qualname__}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in value.items()) + "}"
    if callable(value):  # an object with __call__: its class's code
        return f"callable {_code_digest(type(value).__call__)}"
    return repr(value)


def evaluator_fingerprint(evaluator: Any) -> dict[str, str]:
    """Each parameter of ``evaluator`` (what it was constructed with) as comparable text: its
    value, ``data <digest>`` for a dataset, ``code <name> <digest>`` for a function,
    ``hyperparameter <label>`` for a placeholder. The device is left out (where, not what)."""
    out = {"type": f"{type(evaluator).__module__}.{type(evaluator).__qualname__}"}
    for key, value in evaluator.params().items():
        if key not in _WHERE:
            out[key] = _describe(value)
    return out


def fingerprint_changes(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """What differs between two fingerprints, one short phrase each (``epochs 4 -> 6``, ``the
    'train' data``, ``the code of train_mlp``, ``new setting 'gamma'``).

    >>> fingerprint_changes({"epochs": "4", "train": "data ab"}, {"epochs": "6", "train": "data cd"})
    ['epochs 4 -> 6', "the 'train' data"]
    """
    changes = []
    for key in sorted(set(recorded) | set(current), key=lambda k: (k not in current, list(current).index(k) if k in current else 0)):
        old, new = recorded.get(key), current.get(key)
        if old == new:
            continue
        if old is None:
            changes.append(f"new setting {key!r}")
        elif new is None:
            changes.append(f"removed setting {key!r}")
        elif new.startswith("data ") or old.startswith("data "):
            changes.append(f"the {key!r} data")
        elif new.startswith("code ") and old.startswith("code "):
            changes.append(f"the code of {new.split()[1].rsplit('.', 1)[-1]}")
        else:
            short = [v if len(v) <= 40 else v[:37] + "..." for v in (old, new)]
            changes.append(f"{key} {short[0]} -> {short[1]}")
    return changes
