"""``nni.retiarii.oneshot.pytorch.utils``: the running averages NNI's one-shot examples print.

>>> meters = AverageMeterGroup()
>>> meters.update({"loss": 2.0, "acc": 0.5}); meters.update({"loss": 1.0, "acc": 0.7})
>>> meters.loss.avg, meters["acc"].val
(1.5, 0.7)
>>> meters.summary()
'loss: 1.500000  acc: 0.600000'
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["AverageMeter", "AverageMeterGroup"]


class AverageMeter:
    """The last value (``val``) and the weighted mean (``avg``, over ``sum`` and ``count``) of one metric;
    ``fmt`` is the format spec of the printed numbers (NNI's ``":f"`` style)."""

    def __init__(self, name: str, fmt: str = ":f") -> None:
        self.name, self.fmt = name, fmt
        self.reset()

    def reset(self) -> None:
        self.val: Any = 0
        self.avg: Any = 0
        self.sum: Any = 0
        self.count = 0

    def update(self, val: Any, n: int = 1) -> None:
        """Account ``val`` with weight ``n``."""
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def _number(self, value: Any) -> str:
        return ("{" + self.fmt + "}").format(value)

    def __str__(self) -> str:
        return f"{self.name} {self._number(self.val)} ({self._number(self.avg)})"

    def summary(self) -> str:
        return f"{self.name}: {self._number(self.avg)}"


class AverageMeterGroup:
    """An :class:`AverageMeter` per metric name, made on first sight; read as ``group.loss`` or ``group["loss"]``."""

    def __init__(self) -> None:
        self.meters: dict[str, AverageMeter] = {}

    def update(self, data: Mapping[str, Any]) -> None:
        for name, value in data.items():
            self.meters.setdefault(name, AverageMeter(name, ":4f")).update(value)

    def __getattr__(self, name: str) -> AverageMeter:
        meters = self.__dict__.get("meters", {})
        if name not in meters:
            raise AttributeError(name)
        return meters[name]

    def __getitem__(self, name: str) -> AverageMeter:
        return self.meters[name]

    def __str__(self) -> str:
        return "  ".join(str(m) for m in self.meters.values())

    def summary(self) -> str:
        return "  ".join(m.summary() for m in self.meters.values())
