"""The driver's side of lockstep training, one for every backend: what a round of members' epochs
means for their trials (:func:`decide_round`), wherever the members trained -- in this process
(:func:`~._lockstep.run_lockstep` with the in-process judge), in forked children, in pool
workers, in Ray tasks.

A round is every member's report of one epoch, in the order the units were planned. It is decided
in three passes over the members' :class:`~._protocol.TrialProtocol`:

1. every report is recorded (with the seconds its epoch took), so a synchronous rule (a
   Hyperband rung, PBT's ranking) sees the whole round before it decides anything;
2. every member's verdict (its timeout, its budget, the strategy's decision);
3. the strategy's forks (PBT) of the members that continue: a fork is kept only when its source
   continues too and does not move itself in the same round.

The backends carry a round to the driver and its :class:`RoundDecision` back; how a fork's
source state reaches the forking member (the same unit, a pipe, Ray's storage) is theirs.

>>> from tridens.trial import Decision, Trial
>>> from tridens.units import Job
>>> from tridens.executors._messages import Report
>>> class Hooks:
...     trial_timeout = None
...     def started(self, trial): pass
...     def record(self, trial, step, metrics): pass
...     def decide(self, trial, step): return Decision.CONTINUE
...     def finish(self, trial, status, **kw): pass
>>> lives = {i: TrialProtocol(Job(Trial(id=i, sample={}, seed=0), None), Hooks(), clock="train") for i in (1, 2)}
>>> decision = decide_round([(lives[1], Report(1, 0, {"acc": 0.5})), (lives[2], Report(2, 0, {"acc": 0.6}, last=True))])
>>> decision.verdicts
{1: <Verdict.CONTINUE: 'continue'>, 2: <Verdict.DONE: 'done'>}
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from ..trial import Fork
from ._messages import Report
from ._protocol import TrialProtocol, Verdict

__all__ = ["RoundDecision", "decide_round"]

log = logging.getLogger("tridens")


@dataclass
class RoundDecision:
    """What one round means: each member's verdict, and the forks of members that continue
    (trial id -> :class:`~tridens.trial.Fork`, each with a source that continues and stays)."""

    verdicts: dict[int, Verdict] = field(default_factory=dict)
    forks: dict[int, Fork] = field(default_factory=dict)


def decide_round(round: Sequence[tuple[TrialProtocol, Report]]) -> RoundDecision:
    """Decide one lockstep round: ``round`` holds each member's protocol and its report, in the
    planned order. A report's ``seconds`` are added to the member's training time (0 where the
    member trained in this process and counted them itself)."""
    for life, report in round:
        if report.seconds:
            life.add_seconds(report.seconds)
        life.record(report.step, report.metrics)
    decision = RoundDecision()
    for life, report in round:
        decision.verdicts[life.trial.id] = life.verdict(report.step, last=report.last)
    wanted: dict[int, Fork] = {}
    for life, report in round:
        tid = life.trial.id
        if decision.verdicts[tid] is Verdict.CONTINUE:
            fork = life.fork(report.step)
            if fork is not None:
                wanted[tid] = fork
    for tid, fork in wanted.items():
        if decision.verdicts.get(fork.source) is not Verdict.CONTINUE or fork.source in wanted:
            log.info("trial %d not forked from trial %d: the source is not training now", tid, fork.source)
            continue
        decision.forks[tid] = fork
    return decision
