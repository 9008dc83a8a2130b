"""What every stacked forward of operator batching uses: freed-memory tuning and
dropout with masks drawn outside vmap, per model, from each trial's own random stream (the masks
a separate trainer would draw, bit for bit).
"""

from __future__ import annotations


import contextlib
import copy
import sys
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn as nn


_MALLOC_TUNED = False


def _keep_freed_memory() -> None:
    """Keep freed blocks in glibc's heap for reuse (``BatchingSettings.keep_freed_memory``); once."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED or not sys.platform.startswith("linux"):
        return
    _MALLOC_TUNED = True
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h> constants
    mallopt(m_mmap_threshold, 64 << 20)
    mallopt(m_trim_threshold, 512 << 20)


# -- dropout with masks drawn outside vmap ---------------------------------------------------------
_DROPOUTS: dict[type, int | None] = {nn.Dropout: None, nn.Dropout1d: 3, nn.Dropout2d: 4, nn.Dropout3d: 5}
_local = threading.local()


class _MaskDropout(nn.Module):
    """Stands in for a dropout module in the fused forward: multiplies by the next mask of the
    current step (drawn per model outside vmap), or records the shape it would need."""

    def __init__(self, index: int, batched_dim: int | None):
        super().__init__()
        self.index, self.batched_dim = index, batched_dim

    def mask_shape(self, shape: torch.Size) -> tuple[int, ...]:
        if self.batched_dim is None:  # element-wise dropout: one value per element
            return tuple(shape)
        if len(shape) == self.batched_dim:  # feature dropout: one value per (sample, channel)
            return (shape[0], shape[1]) + (1,) * (len(shape) - 2)
        return (shape[0],) + (1,) * (len(shape) - 1)  # no batch dim: F.dropoutNd unsqueezes one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        state = _local.state
        if state.record is not None:
            state.record.append((self.index, self.mask_shape(x.shape), x.dtype))
            return x
        mask = state.masks[state.position]
        state.position += 1
        return x if mask is None else x * mask


@dataclass
class _ForwardState:
    record: list[tuple[int, tuple[int, ...], torch.dtype]] | None = None
    masks: Sequence[torch.Tensor | None] = ()
    position: int = 0


@contextlib.contextmanager
def _forward_state(state: _ForwardState) -> Iterator[None]:
    previous = getattr(_local, "state", None)
    _local.state = state
    try:
        yield
    finally:
        _local.state = previous


def _dropout_ps(model: nn.Module) -> list[float]:
    """Every dropout's ``p``, in ``named_modules`` order (the index :func:`_skeleton` gives it)."""
    return [float(m.p) for _, m in model.named_modules() if type(m) in _DROPOUTS]


def _dropout_names(model: nn.Module) -> dict[str, int]:
    return {n: i for i, n in enumerate(n for n, m in model.named_modules() if type(m) in _DROPOUTS)}


def _skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device with its dropouts replaced by :class:`_MaskDropout`
    (numbered in ``named_modules`` order, as :func:`_dropout_ps`): the module ``functional_call``
    runs with the stacked parameters."""
    base = copy.deepcopy(model).to("meta")
    index = {id(m): i for i, m in enumerate(m for _, m in base.named_modules() if type(m) in _DROPOUTS)}
    replaced: dict[int, _MaskDropout] = {}
    for _, module in list(base.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) in _DROPOUTS:
                if id(child) not in replaced:
                    replaced[id(child)] = _MaskDropout(index[id(child)], _DROPOUTS[type(child)])
                setattr(module, child_name, replaced[id(child)])
    return base


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]
