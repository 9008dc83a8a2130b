"""Stage keys as plain data: what a stage store keeps to recognise the same training across runs.

:meth:`TrainConfig.stage_key` identifies an epoch's training within one process (it holds the
datasets and the loss by identity). :func:`stage_record` says the same as JSON-able data -- the
optimizer, its settings, the batch size, the data seed, every step's learning rate, digests of the
training and validation data, the loss and transforms by import path -- so that an experiment run
later, in another process, finds the stages an earlier one trained. Where some part cannot be named
stably (a lambda as the loss, a dataset of opaque items) there is no record and nothing is shared
across runs.

>>> import torch, tridens as td
>>> ds = torch.utils.data.TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))
>>> record = stage_record(td.evaluators.Classification(ds, ds, epochs=2, batch_size=4).config(), 1)
>>> record["batch_size"], record["lrs"]
(4, [0.01, 0.01])
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Any

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

__all__ = ["stage_record", "dataset_digest", "callable_name", "record_digest"]

_DIGESTS: "weakref.WeakKeyDictionary[Any, str | None]" = weakref.WeakKeyDictionary()


def _hash_value(digest: Any, value: Any) -> bool:
    """Feed ``value`` into ``digest``; False for a value with no stable bytes."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return True
    if isinstance(value, np.ndarray):
        digest.update(f"A{value.dtype}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
        return True
    if isinstance(value, (int, float, str, bool, type(None))):
        digest.update(repr((type(value).__name__, value)).encode())
        return True
    if isinstance(value, (tuple, list)):
        digest.update(f"L{len(value)}".encode())
        return all(_hash_value(digest, v) for v in value)
    if isinstance(value, dict):
        digest.update(f"D{len(value)}".encode())
        return all(_hash_value(digest, k) and _hash_value(digest, v) for k, v in sorted(value.items(), key=repr))
    return False


def dataset_digest(dataset: Any) -> str | None:
    """A digest of a dataset's contents (computed once per dataset object): its tensors for a
    ``TensorDataset``, the indices and the base's digest for a ``Subset``, every item otherwise;
    ``None`` when an item has no stable bytes (a PIL image, an object).

    >>> ds = torch.utils.data.TensorDataset(torch.arange(4.0))
    >>> dataset_digest(ds) == dataset_digest(torch.utils.data.TensorDataset(torch.arange(4.0)))
    True
    """
    try:
        if dataset in _DIGESTS:
            return _DIGESTS[dataset]
    except TypeError:  # not weakly referenceable: computed every time
        pass
    digest = hashlib.sha1(type(dataset).__qualname__.encode())
    if isinstance(dataset, TensorDataset):
        ok = all(_hash_value(digest, t) for t in dataset.tensors)
    elif isinstance(dataset, Subset):
        base = dataset_digest(dataset.dataset)
        ok = base is not None and _hash_value(digest, [int(i) for i in dataset.indices])
        digest.update(str(base).encode())
    else:
        try:
            ok = all(_hash_value(digest, dataset[i]) for i in range(len(dataset)))
        except Exception:
            ok = False
    value = digest.hexdigest() if ok else None
    try:
        _DIGESTS[dataset] = value
    except TypeError:
        pass
    return value


def callable_name(fn: Any) -> str | None:
    """A stable name of a loss or transform: the import path of a function or class, with the
    repr of a module instance; ``None`` for a lambda, a local function or an opaque object."""
    if fn is None:
        return "None"
    if isinstance(fn, torch.nn.Module):
        return f"{type(fn).__module__}.{type(fn).__qualname__}:{fn!r}"
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    return f"{module}.{qualname}"


def stage_record(config: Any, epoch: int) -> dict[str, Any] | None:
    """``config.stage_key(epoch)`` as plain data (JSON), or ``None`` where a part has no stable
    name (then the stage is shared within a run only)."""
    parts = {"train": dataset_digest(config.train), "val": dataset_digest(config.val),
             "loss": callable_name(config.loss), "transforms": callable_name(config.transforms)}
    if any(v is None for v in parts.values()):
        return None
    first, last = config.epoch_steps(epoch)
    return {"optimizer": config.optimizer, "momentum": config.momentum, "weight_decay": config.weight_decay,
            "batch_size": config.batch_size_at(epoch), "data_seed": config.data_seed,
            "lrs": [config.lr_at(step) for step in range(first, last)], **parts, "task": config.task,
            "metrics": list(config.metrics), "device": config.device.type}


def record_digest(previous: str, record: dict[str, Any]) -> str:
    """The digest of a path of stage records: ``previous`` (the path so far, ``""`` at the root)
    extended by one epoch's ``record``."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(f"{previous}|{text}".encode()).hexdigest()
