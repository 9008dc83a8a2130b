"""The execution-unit protocol: trials of one group that train together, one epoch at a time.

A planner turns a TrialGroup's jobs into units. A unit may train its trials one after another
(:class:`~tridens.units.SeparateUnit`) or fused (:mod:`tridens.xopt`). Every unit answers this
protocol, so an executor's loop, the strategy's stop decisions and the store never see the
difference.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from ..evaluators import StepwiseEvaluator
from ..trial import Objective
from ._job import Job

__all__ = ["ExecutionUnit", "UnitResult", "numbered", "numbered_text"]

_TRIAL_LIST = re.compile(r"\b(trials?(?:\(s\))? \[)([0-9, ]*)\]")
_ONE_TRIAL = re.compile(r"\b(trial )([0-9]+)\b")

# One trial's outcome of an epoch: its metrics (objective first), or the error that failed it.
UnitResult = Mapping[str, float] | BaseException


class ExecutionUnit:
    """Trials trained together. Subclasses implement :meth:`train_epoch`, :meth:`weights`,
    :meth:`limit`, :meth:`epoch` and :meth:`_leave` (release a trial's state), and where they can
    :meth:`state_dict` / :meth:`load_state_dict` (a member's checkpoint), :meth:`shared`,
    :meth:`groups` and :meth:`batching` (what :meth:`describe` reports). Executors use only this
    protocol, never a unit's class.

    ``splittable``: whether a planner may plan the unit's trials again as smaller units (the Ray
    executor does, to give every worker a task). ``memory``: the bytes its planner estimated, when
    it bounded the unit by ``max_unit_memory``.
    """

    kind = "unit"
    splittable = False

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator):
        self.jobs = {job.trial.id: job for job in jobs}
        self.numbers = {job.trial.id: job.trial.label for job in jobs}  # store id -> number in the experiment
        self.evaluator = evaluator
        self.objective: Objective = evaluator.objective
        self.reason = ""
        self.memory: int | None = None

    def active(self) -> list[Job]:
        """The trials still training, in their original order."""
        return list(self.jobs.values())

    def trial_ids(self) -> list[int]:
        """The members: the ids of the trials still training, in their original order."""
        return list(self.jobs)

    def limit(self, trial_id: int) -> int:  # pragma: no cover - abstract
        """How many epochs the trial trains in all (its budget, capped by the group's max_steps)."""
        raise NotImplementedError

    def epoch(self, trial_id: int) -> int:  # pragma: no cover - abstract
        """Epochs the trial has finished."""
        raise NotImplementedError

    def train_epoch(self) -> dict[int, UnitResult]:  # pragma: no cover - abstract
        """Train one more epoch of every active trial that has epochs left, then validate."""
        raise NotImplementedError

    def weights(self, trial_id: int) -> dict[str, Any] | None:  # pragma: no cover - abstract
        """The trial's current weights, as its own model's state_dict would hold them (None
        when the trial has no model)."""
        raise NotImplementedError

    def state_dict(self, trial_id: int) -> dict[str, Any] | None:
        """The member's checkpoint, as its own trainer's ``state_dict()`` would hold it (weights,
        optimizer state, epoch, step, random state), for restarts and forks; None where this unit
        cannot take one (the member then restarts from its first epoch)."""
        return None

    def load_state_dict(self, trial_id: int, state: Mapping[str, Any]) -> None:
        """Continue the member from ``state`` (what :meth:`state_dict` gave). A fused unit trains its
        members from their initial models only: a restarted member trains in a separate unit."""
        raise NotImplementedError(f"a {self.kind} unit cannot load the state of trial {trial_id}: its members "
                                  "start from their initial models (restart it in a separate unit)")

    def fork(self, source: int, job: Job) -> "ExecutionUnit":
        """Start ``job``'s trial from member ``source``'s current state: the same weights,
        optimizer state, step and random state, so it goes on as ``source`` would from here (its
        data order from then on follows its own seed). Returns the unit that trains it: this one
        where it can take a member, else a new separate unit. Stage trees and PBT fork this way.

        >>> child = unit.fork(3, Job(Trial(id=9, sample=sample, seed=seed), model))  # doctest: +SKIP
        """
        from ._separate import SeparateUnit

        state = self.state_dict(source)
        if state is None:
            raise ValueError(f"trial {source} of a {self.kind} unit has no state to fork from")
        unit = SeparateUnit([job], self.evaluator, reason=f"forked from trial {source} of a {self.kind} unit")
        unit.load_state_dict(job.trial.id, reseeded(state, job.trial.seed))
        return unit

    def remove(self, trial_id: int) -> None:
        """The member leaves the unit (stopped, NaN, failed, finished); the others go on undisturbed."""
        self.drop(trial_id)

    def drop(self, trial_id: int) -> None:
        """The trial leaves the unit (finished, stopped or failed); the others go on undisturbed."""
        if trial_id in self.jobs:
            self._leave(trial_id)
            del self.jobs[trial_id]

    def _leave(self, trial_id: int) -> None:
        """Release the trial's state."""

    def memory_estimate(self) -> int:
        """Estimated bytes the unit holds while it trains: its planner's estimate where it made one,
        else its members' weights, gradients and two optimizer states per parameter, and buffers
        (activations not counted)."""
        if self.memory is not None:
            return self.memory
        total = 0
        for job in self.jobs.values():
            if job.model is not None:
                total += 4 * sum(p.numel() * p.element_size() for p in job.model.parameters())
                total += sum(b.numel() * b.element_size() for b in job.model.buffers())
        return total

    def split(self) -> "list[ExecutionUnit] | None":
        """Before its first epoch, this unit's members as two units of about equal work, built from
        the members as they are (no planning again); None when it cannot (the default: an executor
        that wants smaller units plans the trials again, :func:`tridens.engine.spread_units`)."""
        return None

    def groups(self) -> list[list[int]]:
        """Members that train as one (one vectorized model, one joint step), by trial id."""
        return [[trial_id] for trial_id in self.jobs]

    def shared(self) -> list[str]:
        """What the members share, one phrase each (a data pipeline, a frozen prefix, tensors)."""
        return []

    def batching(self) -> str:
        """``"force"`` when members train as one vectorized model, ``"auto"`` while that is decided
        on the first steps, ``"off"`` otherwise."""
        return "off"

    def speedups(self) -> list[dict[str, Any]]:
        """Members fused (or not) on a measured speed-up, one entry per group: ``{"trials",
        "speedup", "fused"}`` (none by default). The dashboard tells the seconds saved from them."""
        return []

    def measurements(self) -> list[Any]:
        """What this unit measured while it trained, as data (:class:`~tridens.units.Measurement`,
        also recorded in the run's :class:`~tridens.units.PlanContext`): a process that trained it
        elsewhere hands these back to the driver (none by default)."""
        return []

    def describe(self) -> dict[str, Any]:
        """The unit as plain data (JSON) for logs, the store and a dashboard: its ``kind``, its
        ``trials`` and ``groups`` (by number in the experiment, as a user reads trials; ``ids``: the
        same trials by store id), ``reason`` (why fused, or why not), ``shared`` parts, ``memory``
        (bytes), ``batching``, ``splittable``, ``speedups`` (:meth:`speedups`, by number) and
        ``text`` (:meth:`summary`). Planners name trials in their text by store id, as ``trial 3``
        and ``trials [3, 4]``; the record shows them by number (:func:`numbered_text`).

        >>> unit.describe()["kind"], unit.describe()["trials"]  # doctest: +SKIP
        ('batched', [2, 3, 4])
        """
        numbers = self.trial_numbers()
        ids = self.trial_ids()
        return {"kind": self.kind, "trials": [numbers.get(t, t) for t in ids], "ids": ids,
                "groups": [[numbers.get(t, t) for t in group] for group in self.groups()],
                "reason": numbered_text(self.reason, numbers), "shared": self.shared(),
                "memory": self.memory_estimate(), "batching": self.batching(), "splittable": self.splittable,
                "speedups": [numbered(e, numbers) for e in self.speedups()],
                "text": numbered_text(self.summary(), numbers)}

    def trial_numbers(self) -> dict[int, int]:
        """Each member's number in its experiment, by store id (members that left included)."""
        self.numbers.update({job.trial.id: job.trial.label for job in self.jobs.values()})
        return self.numbers

    def summary(self) -> str:
        """One log line: what this unit trains and why (anything not fused says why not)."""
        ids = ", ".join(str(i) for i in self.jobs)
        return f"{self.kind} unit of {len(self.jobs)} trial(s) [{ids}]" + (f": {self.reason}" if self.reason else "")

    def _limit_of(self, job: Job, epochs: int) -> int:
        return epochs if job.max_steps is None else min(epochs, job.max_steps)


def reseeded(state: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """A trainer checkpoint that a trainer with ``seed`` accepts (a fork to a trial with its own seed)."""
    return {**state, "seed": seed} if "seed" in state else dict(state)


def numbered(entry: Mapping[str, Any], numbers: Mapping[int, int]) -> dict[str, Any]:
    """A decision record (``{"trials": [store ids], ...}``, :meth:`ExecutionUnit.speedups`) with its
    trials by number in the experiment.

    >>> numbered({"trials": [7, 8], "speedup": 1.5}, {7: 0, 8: 1})
    {'trials': [0, 1], 'speedup': 1.5}
    """
    return {**entry, "trials": [numbers.get(t, t) for t in entry.get("trials") or []]}


def numbered_text(text: str, numbers: Mapping[int, int]) -> str:
    """``text`` with the trials it names by store id (``trial 7``, ``trials [7, 8]``, ``trial(s) [7]``)
    named by their number in the experiment instead, as every table shows them; ids ``numbers``
    does not hold stay as they are.

    >>> numbered_text("trials [7, 8] as one batched model; forked from trial 8", {7: 0, 8: 1})
    'trials [0, 1] as one batched model; forked from trial 1'
    """
    if not text or not numbers:
        return text

    def one(match: re.Match[str]) -> str:
        return match.group(1) + str(numbers.get(int(match.group(2)), match.group(2)))

    def many(match: re.Match[str]) -> str:
        items = [i.strip() for i in match.group(2).split(",") if i.strip()]
        return match.group(1) + ", ".join(str(numbers.get(int(i), i)) for i in items) + "]"

    return _ONE_TRIAL.sub(one, _TRIAL_LIST.sub(many, text))
