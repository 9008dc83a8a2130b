"""NNI 1.x's ``nni.nas.pytorch.callbacks``: the names importable, so that a script importing them at
top level for its 1.x branch (NNI 2.10's ``oneshot/darts/search.py`` without ``--v1``) runs its 2.x
branch; constructing either raises one line naming the 2.x way.

>>> ArchitectureCheckpoint("./checkpoints")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
tridens.compat.nni._common.NotSupported: ArchitectureCheckpoint is NNI 1.x's (nni.nas.pytorch), ...
"""

from __future__ import annotations

from typing import Any

from ..._common import NotSupported

__all__ = ["ArchitectureCheckpoint", "LRSchedulerCallback"]


class ArchitectureCheckpoint:
    """Not provided (NNI 1.x): constructing it raises, naming the 2.x way."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupported("ArchitectureCheckpoint is NNI 1.x's (nni.nas.pytorch), which tridens does not run: "
                           "use nni.retiarii.oneshot.pytorch's DartsTrainer and save trainer.export() "
                           "(json.dump), as NNI 2.x's examples do.")


class LRSchedulerCallback:
    """Not provided (NNI 1.x): constructing it raises, naming the 2.x way."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupported("LRSchedulerCallback is NNI 1.x's (nni.nas.pytorch), which tridens does not run: "
                           "NNI 2.x's one-shot trainers (nni.retiarii.oneshot.pytorch) take no callbacks; a "
                           "LightningModule's configure_optimizers can return the scheduler.")
