"""The messages between the driver and the processes that train its trials (pool workers, forked
children, Ray tasks), as small classes: one module for every backend.

The driver tells a process what to train (:class:`RunTrial`, :class:`Place`, :class:`RunUnit`, the
evaluator once: :class:`ShipEvaluator`) and answers it (:class:`Answer` to a :class:`Report`,
:class:`Verdicts` to a :class:`Round`); the process says that training began (:class:`Started`),
reports steps, and says how each trial left (:class:`Left`, with its :class:`Outcome`). A Ray
task's message travels in a :class:`Posted` envelope naming its attempt and worker.

>>> Left(3, Outcome("error", error="boom")).outcome.kind
'error'
>>> Round([Report(1, step=0, metrics={"val_acc": 0.5})]).reports[0].last
False
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Outcome", "ShipEvaluator", "RunTrial", "Place", "RunUnit", "Answer", "Verdicts",
           "ArchiveAnswer", "Quit", "Started", "Report", "Round", "Profile", "Left", "Yielded", "Closed", "Forked",
           "State", "ArchiveCall", "LogRecord", "Measured", "End", "Posted"]


@dataclass(frozen=True)
class Outcome:
    """How a trial left the process that trained it: ``kind`` is ``"done"`` (or ``"stopped"``:
    its final ``value``, None for the last recorded one, and ``weights``: ``torch.save`` bytes
    through a pipe, a file under Ray's storage), ``"error"`` (``error``: the text), ``"dropped"``
    (past its timeout: failed on the driver already), ``"yielded"`` (Fluid: it moves to another
    share) or ``"fault"`` (``error``: a storage fault's line; the run stops, the trial stays
    unfinished). ``info``: what its unit wrote into ``trial.info`` (the stages it went through)."""

    kind: str
    value: float | None = None
    weights: Any = None
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


# -- driver -> process -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShipEvaluator:
    """The evaluator, pickled (:func:`~._execution.worker_payload`), once per worker; later messages name it by ``token``."""

    token: int
    payload: bytes


@dataclass(frozen=True)
class RunTrial:
    """Run one whole trial (a user's loop, or a step-wise trial alone) in a pool worker."""

    trial_id: int
    token: int
    model: bytes
    sample: dict[str, Any]
    seed: int
    max_steps: int | None
    state: bytes | None = None   # the trainer state it starts from (a fork)


@dataclass(frozen=True)
class Place:
    """A Fluid placement on a pool worker: host the trial (packed with others, ``world`` 1) or run
    rank ``rank`` of its ``world`` data-parallel ranks (gloo on ``port``). ``measure``: time its
    first steps (:class:`Profile`)."""

    trial_id: int
    token: int
    model: bytes
    sample: dict[str, Any]
    seed: int
    max_steps: int | None
    state: bytes | None
    measure: bool
    rank: int = 0
    world: int = 1
    port: int | None = None


@dataclass(frozen=True)
class RunUnit:
    """Trials that train together in one pool worker, in lockstep: ``members`` (trial, model bytes,
    max_steps, state bytes), the run's xopt settings as plain data (None: separately), the
    optimizations to plan with, the experiment whose stage store the worker reaches through the
    driver, where a population's rounds are kept (``(storage root, experiment)``, None: not kept),
    and whether the members go on from their last kept rounds (``resume``: a retry after a death)."""

    token: int
    members: list[tuple[Any, bytes, int | None, bytes | None]]
    settings: dict[str, Any] | None
    optimizations: tuple[str, ...]
    experiment: str | None
    storage: tuple[str, str] | None = None
    resume: bool = False


@dataclass(frozen=True)
class Answer:
    """The verdict (a :class:`~._protocol.Verdict` value) for a trial's :class:`Report`."""

    trial_id: int
    verdict: Any


@dataclass(frozen=True)
class Verdicts:
    """The answer to a :class:`Round`: each member's verdict value, and the forks (PBT): ``(trial,
    source, sample, handed)``, ``handed`` the source's (seed, sample, model, state) when it trains elsewhere."""

    answers: dict[int, str]
    forks: list[tuple[Any, ...]] = field(default_factory=list)


@dataclass(frozen=True)
class ArchiveAnswer:
    """The result of an :class:`ArchiveCall`."""

    result: Any


@dataclass(frozen=True)
class Quit:
    """The worker exits."""


# -- process -> driver -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    """Training began (the timeout counts from here): of ``trial_id``, or of every member of the
    process's unit (None). ``resources``: what Ray assigned the task; ``info``: what the driver
    notes in the trial's ``info`` (where it runs: a Ray task's pid, node and attempt)."""

    trial_id: int | None = None
    resources: dict[str, Any] | None = None
    info: dict[str, Any] | None = None


@dataclass(frozen=True)
class Report:
    """One step's metrics; ``seconds`` spent training it; ``last``: the last step of its budget."""

    trial_id: int
    step: int
    metrics: dict[str, float]
    seconds: float = 0.0
    last: bool = False


@dataclass(frozen=True)
class Round:
    """Every member's report of one lockstep round, answered with :class:`Verdicts`."""

    reports: list[Report]


@dataclass(frozen=True)
class Profile:
    """(Fluid) the trial's measured seconds per step, steps per epoch and epochs."""

    trial_id: int
    step_time: float
    per_epoch: int | None
    epochs: int | None


@dataclass(frozen=True)
class Left:
    """A trial left the process, with its :class:`Outcome`."""

    trial_id: int
    outcome: Outcome


@dataclass(frozen=True)
class Yielded:
    """(Fluid) the trial stopped at an epoch boundary to move to another share; ``state``: its trainer's checkpoint."""

    trial_id: int
    state: bytes | None


@dataclass(frozen=True)
class Closed:
    """(Fluid) a data-parallel rank tore its gloo group down: its worker is free."""

    trial_id: int


@dataclass(frozen=True)
class Forked:
    """Member ``trial_id`` continues from ``source``'s state after ``step`` with ``sample``."""

    trial_id: int
    source: int
    step: int
    sample: dict[str, Any]


@dataclass(frozen=True)
class State:
    """Member ``trial_id``'s trainer state (``torch.save`` bytes): a data-parallel rank's, each epoch."""

    trial_id: int
    payload: bytes | None


@dataclass(frozen=True)
class ArchiveCall:
    """A stage tree's call of the driver's stage store (:mod:`._stage_relay`); on Ray it names a
    member (``trial_id``: which task calls)."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    trial_id: int | None = None


@dataclass(frozen=True)
class LogRecord:
    """A log record of a forked child, for the driver's handlers."""

    record: Any


@dataclass(frozen=True)
class Measured:
    """What a forked child's units measured (:meth:`~tridens.units.ExecutionUnit.measurements`)."""

    measurements: list[Any]


@dataclass(frozen=True)
class End:
    """The process's unit ended: a member without an outcome by now has none."""


@dataclass(frozen=True)
class Posted:
    """A Ray task's message, as posted to the hub: which ``attempt`` (a task started again after
    its worker died, or at a new Fluid share, counts up) and which ``worker`` (pid, node) sent it;
    ``key``: what its answer comes back under (None: it waits for none)."""

    attempt: int
    worker: tuple[int, str]
    message: Any
    key: Any = None
