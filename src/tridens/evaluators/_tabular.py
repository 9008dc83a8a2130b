"""``Tabular``: evaluate by looking results up in a benchmark table instead of training.

A table with learning curves is a multi-fidelity benchmark: each epoch is one query, and with a
:class:`SimulatedClock` every query is charged the CPU-seconds the table recorded for that epoch,
so strategies can be compared by simulated training time. :class:`CurveTable` reads such a table
(per-epoch validation accuracy, loss and CPU-seconds of every configuration, several seeds), as
``bench/record_curves.py`` records it by training a real space with tridens.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch.nn as nn

from ..errors import InvalidSample, TridensError
from ..space import Categorical, LabelSpec, SearchSpace
from ..trial import Objective
from ._base import StepwiseEvaluator
from ._errors import InvalidParameter
from ._params import Options, Satisfies, check

__all__ = ["Table", "MemoryTable", "CurveTable", "SimulatedClock", "Tabular", "TableTrainer"]


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


class CurveTable:
    """Learning curves of every configuration of a space, several recorded runs (seeds) each:
    ``curves`` maps the tuple of a sample's values (in ``labels`` order) to one list of per-epoch
    records (metric name -> value) per recorded run. A query with ``seed`` replays run
    ``seed % runs``. :meth:`load` reads the ``.json.gz`` files ``bench/record_curves.py`` writes.

    >>> t = CurveTable(["lr"], {(0.1,): [[{"val_acc": 0.5, "cpu_seconds": 2.0}, {"val_acc": 0.7, "cpu_seconds": 2.0}],
    ...                                  [{"val_acc": 0.6, "cpu_seconds": 2.5}, {"val_acc": 0.8, "cpu_seconds": 2.5}]]})
    >>> t.lookup({"lr": 0.1}, seed=3)[1]["val_acc"], round(t.final_mean({"lr": 0.1}), 2), t.epochs
    (0.8, 0.75, 2)
    """

    def __init__(self, labels: Sequence[str], curves: Mapping[tuple[Any, ...], Sequence[Sequence[Mapping[str, float]]]],
                 info: Mapping[str, Any] | None = None):
        self.labels = list(labels)
        self.curves = curves
        self.info = dict(info or {})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "CurveTable":
        """Read a recorded table (``{"labels", "rows": [{"sample", "seeds": [{"val_acc": [...], ...}]}]}``,
        gzip-compressed JSON)."""
        try:
            with gzip.open(path, "rt") as f:
                data = json.load(f)
            labels = list(data["labels"])
            curves: dict[tuple[Any, ...], list[list[dict[str, float]]]] = {}
            for row in data["rows"]:
                runs = []
                for run in row["seeds"]:
                    names = [k for k, v in run.items() if isinstance(v, list)]
                    runs.append([{k: float(run[k][e]) for k in names} for e in range(len(run[names[0]]))])
                curves[tuple(row["sample"][label] for label in labels)] = runs
        except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
            raise TridensError(f"{os.fspath(path)} is not a recorded curve table: {err}") from None
        info = {k: v for k, v in data.items() if k != "rows"}
        return cls(labels, curves, info)

    def __len__(self) -> int:
        return len(self.curves)

    @property
    def epochs(self) -> int:
        """The longest recorded curve (epochs)."""
        return max(len(run) for runs in self.curves.values() for run in runs)

    def search_space(self) -> SearchSpace:
        """One categorical label per column, holding the values the table has."""
        specs = []
        for i, label in enumerate(self.labels):
            values = sorted({key[i] for key in self.curves}, key=lambda v: (str(type(v)), v))
            specs.append(LabelSpec(label, Categorical(values)))
        return SearchSpace(specs)

    def _runs(self, sample: Mapping[str, Any]) -> Sequence[Sequence[Mapping[str, float]]]:
        missing = [label for label in self.labels if label not in sample]
        if missing:
            raise InvalidSample(f"sample is missing label {missing[0]!r} (the table is keyed by {self.labels!r})")
        key = tuple(sample[label] for label in self.labels)
        if key not in self.curves:
            raise InvalidSample(f"the table has no row for {dict(zip(self.labels, key))!r}")
        return self.curves[key]

    def lookup(self, sample: Mapping[str, Any], seed: int = 0) -> list[dict[str, float]]:
        runs = self._runs(sample)
        return [dict(r) for r in runs[seed % len(runs)]]

    def final_mean(self, sample: Mapping[str, Any], metric: str = "val_acc") -> float:
        """``metric`` at the last epoch, averaged over the recorded runs."""
        runs = self._runs(sample)
        return sum(run[-1][metric] for run in runs) / len(runs)

    def best(self, metric: str = "val_acc", mode: str = "max") -> tuple[dict[str, Any], float]:
        """The configuration with the best :meth:`final_mean`, and that value."""
        sign = 1.0 if mode == "max" else -1.0
        key = max(self.curves, key=lambda k: sign * self.final_mean(dict(zip(self.labels, k)), metric))
        sample = dict(zip(self.labels, key))
        return sample, self.final_mean(sample, metric)


class SimulatedClock:
    """Simulated time: the seconds a :class:`Tabular` evaluator charged for the epochs it replayed
    (each epoch the cost its table recorded), and how many epochs were queried. Pass one clock to
    the evaluator and read it while a search runs (in-process executors: a clock shipped to
    another process counts there).

    >>> clock = SimulatedClock()
    >>> clock.charge(1.5); clock.charge(0.5); clock.seconds, clock.queries
    (2.0, 2)
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.queries = 0

    def charge(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            raise TridensError(f"a query's cost must be a finite number of seconds >= 0; the table recorded {seconds!r}")
        self.seconds += seconds
        self.queries += 1


class TableTrainer:
    """Replays a looked-up learning curve one epoch at a time (nothing is trained). With a
    ``clock``, each replayed epoch is charged its ``cost`` metric (when the record has one)."""

    def __init__(self, curve: Sequence[Mapping[str, float]], seed: int, clock: SimulatedClock | None = None,
                 cost: str | None = None):
        self.curve = [dict(r) for r in curve]
        self.seed = seed
        self.epoch = 0
        self.clock = clock
        self.cost = cost

    @property
    def epochs(self) -> int:
        return len(self.curve)

    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs

    def train_epoch(self) -> dict[str, float]:
        if self.done:
            raise TridensError(f"the table holds {self.epochs} epoch(s) for this configuration; all were replayed")
        if self.clock is not None and self.cost is not None and self.cost in self.curve[self.epoch]:
            self.clock.charge(float(self.curve[self.epoch][self.cost]))
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
    multi-fidelity strategies work; a table with final results only reports one step. Multi-fidelity
    mode: with a :class:`SimulatedClock` as ``clock``, every epoch replayed is charged the table's
    ``cost`` metric for that epoch (recorded CPU-seconds by default), so a search can be measured
    in simulated time (:class:`CurveTable` holds such tables).
    :meth:`search_space` holds no labels (the table's labels come from the model space, e.g.
    :func:`tridens.evaluators.nasbench201.space`).

    >>> from tridens.evaluators import Tabular, nasbench201
    >>> ev = Tabular(nasbench201.table("cifar10"), metric="val_acc", mode="max")
    >>> round(ev.evaluate(None, nasbench201.from_arch_str(
    ...     "|nor_conv_3x3~0|+|nor_conv_3x3~0|nor_conv_3x3~1|+|skip_connect~0|nor_conv_3x3~1|nor_conv_3x3~2|"), seed=0), 4)
    0.9168
    """

    needs_model = False

    def __init__(self, table: Table, *, metric: str = "val_acc", mode: str = "max",
                 clock: SimulatedClock | None = None, cost: str = "cpu_seconds"):
        self.table = table
        self.metric = metric
        self.mode = mode
        self.clock = clock
        self.cost = cost

    @property
    def objective(self) -> Objective:
        return Objective(self.metric, self.mode)

    def trainer(self, model: nn.Module | None, sample: Mapping[str, Any], seed: int) -> TableTrainer:
        owner = type(self).__name__
        check(owner, self.params(), {
            "table": [Satisfies(lambda t: callable(getattr(t, "lookup", None)), "a Table (an object with lookup(sample, seed))")],
            "metric": [Satisfies(lambda v: isinstance(v, str) and v != "", "a metric name")],
            "mode": [Options(["max", "min"])],
            "clock": [Satisfies(lambda c: c is None or callable(getattr(c, "charge", None)),
                                "None or a SimulatedClock (an object with charge(seconds))")],
            "cost": [Satisfies(lambda v: isinstance(v, str) and v != "", "a metric name")],
        })
        curve = list(self.table.lookup(sample, seed))
        if not curve:
            raise TridensError(f"the table returned no result for {dict(sample)!r}")
        if self.metric not in curve[-1]:
            raise InvalidParameter(f"The 'metric' parameter of {owner} must be one of the table's metrics "
                                   f"{sorted(curve[-1])!r}. Got {self.metric!r} instead.")
        return TableTrainer(curve, seed, self.clock, self.cost)
