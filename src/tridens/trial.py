"""The small records that travel between layers: trials, groups of trials, objectives."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrialStatus", "Trial", "TrialGroup", "Objective", "Decision", "Fork", "Stage", "Schedule",
           "warm_start_parent"]


class TrialStatus(str, enum.Enum):
    PENDING = "pending"        # created by the engine, not started
    RUNNING = "running"
    COMPLETED = "completed"    # trained to its budget; .metric is final
    STOPPED = "stopped"        # stopped early by the strategy; .metric is its last value
    FAILED = "failed"          # raised, went NaN or timed out; .error says why
    DUPLICATE = "duplicate"    # same fingerprint, hyperparameters and seed as an earlier trial
    INTERRUPTED = "interrupted"  # was running when its run stopped (Ctrl-C, a killed driver); runs again on resume

    @property
    def finished(self) -> bool:
        return self not in (TrialStatus.PENDING, TrialStatus.RUNNING, TrialStatus.INTERRUPTED)

    def __str__(self) -> str:
        """The status as users read and write it: ``str(TrialStatus.COMPLETED) == 'completed'``."""
        return self.value


class Decision(str, enum.Enum):
    """A strategy's answer after an intermediate result."""

    CONTINUE = "continue"
    STOP = "stop"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Fork:
    """A strategy's request that a running trial continue from another member's state: the
    weights, optimizer state and step of trial ``source`` now, trained from here on with the
    hyperparameters ``sample`` (a PBT exploit and explore). Plain data.

    >>> Fork(source=3, sample={"lr": 0.08}).source
    3
    """

    source: int
    sample: dict[str, Any]


@dataclass(frozen=True)
class Stage:
    """Epochs from ``epoch`` on trained with hyperparameters ``sample`` by trial ``trial`` (whose
    ``seed`` its trainer had): one piece of a :class:`Schedule`."""

    epoch: int
    sample: dict[str, Any]
    trial: int
    seed: int


@dataclass(frozen=True)
class Schedule:
    """A trial's hyperparameters as a function of the epoch: the stages its weights went through,
    across the forks that copied them from other trials. ``schedule(e)`` is the sample epoch ``e``
    trained with; ``seed`` the initial seed of the first stage (its model's initialization).

    >>> s = Schedule([Stage(0, {"lr": 0.1}, 4, 7), Stage(3, {"lr": 0.08}, 6, 9)])
    >>> s(2), s(3), s.seed
    ({'lr': 0.1}, {'lr': 0.08}, 7)
    """

    stages: list[Stage]

    def __call__(self, epoch: int) -> dict[str, Any]:
        current = self.stages[0]
        for stage in self.stages:
            if stage.epoch <= epoch:
                current = stage
        return current.sample

    @property
    def seed(self) -> int:
        return self.stages[0].seed

    def to_json(self) -> list[dict[str, Any]]:
        """The stages as plain data (what ``trial.info["schedule"]`` holds)."""
        return [{"epoch": s.epoch, "sample": dict(s.sample), "trial": s.trial, "seed": s.seed} for s in self.stages]

    @classmethod
    def from_json(cls, stages: list[dict[str, Any]]) -> "Schedule":
        return cls([Stage(int(s["epoch"]), dict(s["sample"]), int(s["trial"]), int(s["seed"])) for s in stages])


@dataclass(frozen=True)
class Objective:
    """What a search optimizes: a metric name and a direction.

    >>> Objective("val_acc", "max").better(0.9, 0.8)
    True
    """

    metric: str = "val_acc"
    mode: str = "max"

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min"):
            raise ValueError(f"The 'mode' parameter of Objective must be 'max' or 'min'. Got {self.mode!r} instead.")

    def better(self, a: float | None, b: float | None) -> bool:
        """Is ``a`` strictly better than ``b``? ``None`` and NaN are worst."""
        if a is None or (isinstance(a, float) and math.isnan(a)):
            return False
        if b is None or (isinstance(b, float) and math.isnan(b)):
            return True
        return a > b if self.mode == "max" else a < b

    def score(self, value: float | None) -> float:
        """A number to maximize: ``value`` for max, ``-value`` for min, ``-inf`` when missing."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return -math.inf
        return value if self.mode == "max" else -value


# one-shot roles (``info["oneshot"]["role"]``) as tables name them
_ROLES = {"subnet": "supernet-scored", "retrain": "retrained"}


@dataclass(repr=False)
class Trial:
    """One model of the space trained (or looked up) once.

    ``metrics`` maps a metric name to its per-step (per-epoch) values; ``metric`` is the final
    value of the objective. ``info`` holds measured facts used by constraints (``params``, ``flops``).
    ``id`` is unique in its store; ``number`` counts the trials of its experiment from 0 (what a
    user sees in tables, logs and exports, as Optuna's ``trial.number``).
    """

    id: int
    sample: dict[str, Any]
    seed: int
    status: TrialStatus = TrialStatus.PENDING
    fingerprint: str | None = None
    metric: float | None = None
    metrics: dict[str, list[float]] = field(default_factory=dict)
    checkpoint: str | None = None
    error: str | None = None
    group: int | None = None
    max_steps: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    started_at: float | None = None
    finished_at: float | None = None
    experiment: str | None = None
    parent: int | None = None
    number: int | None = None

    @property
    def label(self) -> int:
        """The trial's number in its experiment (its store id when the number is unknown)."""
        return self.number if self.number is not None else self.id

    @property
    def role(self) -> str | None:
        """A one-shot run's trial: ``"supernet"``, ``"supernet-scored"`` (a subnet scored with weights
        inherited from the supernet: a proxy, ranked after trained models) or ``"retrained"`` (an
        architecture trained from scratch); ``None`` for every other trial.

        >>> Trial(id=3, sample={}, seed=0, info={"oneshot": {"role": "subnet", "inherited": True}}).role
        'supernet-scored'
        """
        one = self.info.get("oneshot")
        role = one.get("role") if isinstance(one, dict) else None
        return _ROLES.get(role, role) if isinstance(role, str) else None

    @property
    def duration(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at

    @property
    def steps(self) -> int:
        """The steps (epochs, or ``td.report`` calls) the trial trained: its longest metric curve."""
        return max((len(v) for v in self.metrics.values()), default=0)

    @property
    def epochs(self) -> int:
        """The epochs the trial trained (its steps; what the tables' ``epochs`` column shows)."""
        return self.steps

    def __repr__(self) -> str:
        """One short line: number, status, final value, epochs, sample (not every curve and fact).

        >>> Trial(id=7, sample={"lr": 0.1}, seed=3, status=TrialStatus.COMPLETED, metric=0.91,
        ...       metrics={"val_acc": [0.8, 0.91]}, number=2)
        Trial(number=2, status='completed', metric=0.91, epochs=2, sample={'lr': 0.1})
        """
        parts = [f"number={self.label}", f"status={str(self.status)!r}"]
        if self.metric is not None:
            parts.append(f"metric={self.metric:.6g}")
        if self.metrics:
            parts.append(f"epochs={self.epochs}")
        sample = repr(self.sample)
        parts.append(f"sample={sample if len(sample) <= 120 else sample[:117] + '...'}")
        if self.status is TrialStatus.FAILED and self.error:
            lines = self.error.strip().splitlines()
            last = lines[-1] if lines else ""
            parts.append(f"error={last if len(last) <= 80 else last[:77] + '...'!r}")
        return f"Trial({', '.join(parts)})"

    def schedule(self) -> Schedule:
        """The hyperparameters this trial's weights were trained with, epoch by epoch: its own
        ``sample`` from epoch 0, unless a strategy forked it from other trials (PBT), in which case
        the lineage recorded in ``info["schedule"]`` (it survives a reload from the store).

        >>> Trial(id=1, sample={"lr": 0.1}, seed=5).schedule()(0)
        {'lr': 0.1}
        """
        stages = self.info.get("schedule")
        if stages:
            return Schedule.from_json(stages)
        return Schedule([Stage(0, dict(self.sample), self.id, self.seed)])

    def record_fork(self, source: "Trial", epoch: int, sample: dict[str, Any]) -> None:
        """This trial continues from ``source``'s state at ``epoch`` with hyperparameters ``sample``:
        its schedule becomes ``source``'s up to ``epoch``, then ``sample``; ``info["exploits"]`` lists
        each fork (epoch, source id and number, the sample taken) for ``tridens show`` and the dashboard."""
        stages = [s for s in source.schedule().to_json() if s["epoch"] < epoch]
        stages.append({"epoch": epoch, "sample": dict(sample), "trial": self.id, "seed": self.seed})
        self.info["schedule"] = stages
        exploits = [e for e in self.info.get("exploits", []) if e["epoch"] < epoch]
        exploits.append({"epoch": epoch, "from": source.id, "from_number": source.label, "sample": dict(sample)})
        self.info["exploits"] = exploits

    def forget_forks(self) -> None:
        """Drop the recorded lineage (a trial trained again from its start)."""
        self.info.pop("schedule", None)
        self.info.pop("exploits", None)


@dataclass
class TrialGroup:
    """Trials a strategy hands over together (a generation, a rung, a batch).

    The engine may run the group's trials in any order or fused; ``max_steps`` caps the number of
    steps (epochs) of each trial, ``None`` meaning the evaluator's full budget.

    ``parents`` (optional, one entry per sample) asks for weight inheritance: the id of the
    finished trial whose trained weights sample ``i`` starts from, for the layers they share, or
    ``None`` for a fresh start. The engine records it as the trial's ``parent``.

    >>> TrialGroup([{"width": 16}, {"width": 32}], parents=[7, None]).parent_of({"width": 16})
    7
    """

    samples: list[dict[str, Any]]
    max_steps: int | None = None
    name: str = ""
    parents: list[int | None] | None = None

    def __post_init__(self) -> None:
        if self.parents is not None and len(self.parents) != len(self.samples):
            raise ValueError(f"The 'parents' parameter of TrialGroup must hold one entry per sample "
                             f"({len(self.samples)}). Got {len(self.parents)} instead.")

    def __len__(self) -> int:
        return len(self.samples)

    def parent_of(self, sample: dict[str, Any]) -> int | None:
        """The parent trial id given for ``sample`` (the same object or an equal dict), or ``None``."""
        if self.parents is None:
            return None
        for i, s in enumerate(self.samples):
            if s is sample:
                return self.parents[i]
        for i, s in enumerate(self.samples):
            if s == sample:
                return self.parents[i]
        return None


def warm_start_parent(warm_start: dict[str, Any], experiment: str | None) -> str:
    """The zoo parent a trial's ``info["warm_start"]`` names, as tables name trials: ``#3`` (its
    number) in ``experiment``, ``search-a #3`` in another experiment, ``zoo:5`` (the entry) for a
    model added to the zoo by hand, ``id 12`` for a trial recorded without its number.

    >>> warm_start_parent({"parent": 4, "parent_experiment": "a", "parent_number": 3}, "b")
    'a #3'
    """
    number, source = warm_start.get("parent_number"), warm_start.get("parent_experiment")
    if number is None:
        parent = warm_start.get("parent")
        return f"id {parent}" if isinstance(parent, int) else str(parent)
    return f"#{number}" if source is None or source == experiment else f"{source} #{number}"
