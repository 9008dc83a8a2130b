"""The executor's base: :class:`Executor` (what a new executor implements) and the
:class:`RunContext` an experiment gives it before its first group."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Sequence


from ..evaluators import Evaluator
from ..units import Job, PlanContext
from ._protocol import GroupHooks

__all__ = ["Executor", "RunContext", "run_context"]

@dataclass(frozen=True)
class RunContext:
    """What an experiment tells its executor before the first group: its name, where workers may
    write checkpoints (a folder beside the store unless the executor has its own), whether to
    fuse trials (``optimize``: True, False or a :class:`tridens.xopt.Settings`), the Fluid
    ``allocation`` policy (None: one trial per worker), whether the strategy ``forks`` members,
    and the run's :class:`~tridens.units.PlanContext` (``plan``: memory bound, decisions measured
    so far, stage archive), which every planning of the run is given.

    >>> RunContext(experiment="mnist").optimize
    True
    """

    experiment: str = "experiment"
    storage: str | None = None
    optimize: Any = True
    allocation: Any = None
    forks: bool = False   # the strategy forks running trials (PBT): a group's members train at once, in lockstep
    plan: PlanContext = field(default_factory=PlanContext)
    verbose: bool = False  # the executor says on stderr what it does while it starts (workers, a local Ray)

    def say(self, text: str) -> None:
        """One line on stderr when the run is verbose: what an executor does before trials report."""
        if self.verbose:
            print(f"tridens: {text}", file=sys.stderr, flush=True)


class Executor:
    """Runs the jobs of one TrialGroup. :meth:`start` is called once per run, before the first
    group; :meth:`close` at its end. ``parallelism`` is how many trials run at once;
    ``forks_members``: whether it carries out a strategy's forks (:meth:`Strategy.fork`, PBT)."""

    parallelism = 1
    forks_members = False

    def start(self, context: RunContext) -> None:
        """Take the run's settings (see :class:`RunContext`)."""
        self.context = context

    def run_group(self, jobs: Sequence[Job], evaluator: Evaluator, hooks: GroupHooks) -> None:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Release workers."""


def run_context(executor: Executor) -> RunContext:
    """The run's context given to ``executor`` (a default one before :meth:`Executor.start`)."""
    return getattr(executor, "context", None) or RunContext()
