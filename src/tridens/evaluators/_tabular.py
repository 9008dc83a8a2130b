"""``Tabular``: evaluate by looking results up in a benchmark table instead of training."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch.nn as nn

from ..errors import InvalidSample, TridensError
from ..trial import Objective
from ._base import StepwiseEvaluator
from ._errors import InvalidParameter
from ._params import Options, Satisfies, check

__all__ = ["Table", "MemoryTable", "Tabular", "TableTrainer"]


@runtime_checkable
class Table(Protocol):
    """A benchmark's recorded results.

    ``lookup`` returns the per-epoch records (metric name -> value) of the configuration that
    ``sample`` describes, trained with ``seed``; a table without learning curves returns a
    single record (the final result). It raises :class:`~tridens.InvalidSample` for a sample
    the table does not hold, naming the label.
    """

    def lookup(self, sample: Mapping[str, Any], seed: int) -> Sequence[Mapping[str, float]]: ...


class MemoryTable:
    """A table held in memory: ``rows`` maps the tuple of a sample's values (in ``labels`` order)
    to its result, a dict of metrics or a list of them (one per epoch).

    >>> t = MemoryTable(["op"], {("conv",): [{"val_acc": 0.5}, {"val_acc": 0.8}], ("pool",): {"val_acc": 0.6}})
    >>> t.lookup({"op": "conv"}, seed=0)
    [{'val_acc': 0.5}, {'val_acc': 0.8}]
    """

    def __init__(self, labels: Sequence[str], rows: Mapping[tuple[Any, ...], Mapping[str, float] | Sequence[Mapping[str, float]]]):
        self.labels = list(labels)
        self.rows = rows

    def lookup(self, sample: Mapping[str, Any], seed: int = 0) -> list[dict[str, float]]:
        missing = [label for label in self.labels if label not in sample]
        if missing:
            raise InvalidSample(f"sample is missing label {missing[0]!r} (the table is keyed by {self.labels!r})")
        key = tuple(sample[label] for label in self.labels)
        if key not in self.rows:
            raise InvalidSample(f"the table has no row for {dict(zip(self.labels, key))!r}")
        row = self.rows[key]
        return [dict(row)] if isinstance(row, Mapping) else [dict(r) for r in row]


class TableTrainer:
    """Replays a looked-up learning curve one epoch at a time (nothing is trained)."""

    def __init__(self, curve: Sequence[Mapping[str, float]], seed: int):
        self.curve = [dict(r) for r in curve]
        self.seed = seed
        self.epoch = 0

    @property
    def epochs(self) -> int:
        return len(self.curve)

    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs

    def train_epoch(self) -> dict[str, float]:
        if self.done:
            raise TridensError(f"the table holds {self.epochs} epoch(s) for this configuration; all were replayed")
        self.epoch += 1
        return {}

    def validate(self) -> dict[str, float]:
        if self.epoch == 0:
            raise TridensError("no epoch replayed yet: call train_epoch() first")
        return dict(self.curve[self.epoch - 1])

    def state_dict(self) -> dict[str, Any]:
        return {"format": 1, "epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["epoch"])


class Tabular(StepwiseEvaluator):
    """Look a configuration's results up in ``table`` (a :class:`Table`) instead of training.

    The model is not used (``needs_model`` is False: the engine may skip building it); the sample
    selects the row, the seed the recorded run. Each epoch of the table's curve is reported, so
    multi-fidelity strategies work; a table with final results only reports one step.
    :meth:`search_space` holds no labels (the table's labels come from the model space, e.g.
    :func:`tridens.evaluators.nasbench201.space`).

    >>> from tridens.evaluators import Tabular, nasbench201
    >>> ev = Tabular(nasbench201.table("cifar10"), metric="val_acc", mode="max")
    >>> round(ev.evaluate(None, nasbench201.from_arch_str(
    ...     "|nor_conv_3x3~0|+|nor_conv_3x3~0|nor_conv_3x3~1|+|skip_connect~0|nor_conv_3x3~1|nor_conv_3x3~2|"), seed=0), 4)
    0.9168
    """

    needs_model = False

    def __init__(self, table: Table, *, metric: str = "val_acc", mode: str = "max"):
        self.table = table
        self.metric = metric
        self.mode = mode

    @property
    def objective(self) -> Objective:
        return Objective(self.metric, self.mode)

    def trainer(self, model: nn.Module | None, sample: Mapping[str, Any], seed: int) -> TableTrainer:
        owner = type(self).__name__
        check(owner, self.params(), {
            "table": [Satisfies(lambda t: callable(getattr(t, "lookup", None)), "a Table (an object with lookup(sample, seed))")],
            "metric": [Satisfies(lambda v: isinstance(v, str) and v != "", "a metric name")],
            "mode": [Options(["max", "min"])],
        })
        curve = list(self.table.lookup(sample, seed))
        if not curve:
            raise TridensError(f"the table returned no result for {dict(sample)!r}")
        if self.metric not in curve[-1]:
            raise InvalidParameter(f"The 'metric' parameter of {owner} must be one of the table's metrics "
                                   f"{sorted(curve[-1])!r}. Got {self.metric!r} instead.")
        return TableTrainer(curve, seed)
