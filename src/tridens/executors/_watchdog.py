"""The watchdog of trials that train in another process (a pool worker, a forked child, a Ray task):
what the driver concludes when that process goes silent, dies, or ends, written once for every
backend.

* :func:`check_silence`: a process silent inside an epoch for longer than ``trial_timeout`` (plus
  :data:`~._protocol.SILENCE_GRACE`) hangs: it is killed and each of its trials fails with the one
  timeout message;
* :func:`check_overtime`: a user's loop running past ``trial_timeout`` (the wall clock, whether it
  reports or not) is killed and times out;
* :func:`death_error`: the one message of a trial whose process died;
* :func:`settle`: the one decoder of a trial's :class:`~._messages.Outcome` (an error, or its final
  value and weights) into its protocol.

A message meant for several trials is a template naming ``{trial}``; :func:`for_trial` fills it.

>>> death_error("worker process", "exit code -9")
'the worker process of trial {trial} died (exit code -9)'
>>> for_trial(death_error("forked process", "exit code 3", times=2), 7)
'the forked process of trial 7 died 2 time(s) (exit code 3)'
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from ._messages import Outcome
from ._protocol import TrialProtocol, timeout_error

__all__ = ["check_silence", "check_overtime", "death_error", "ended_error", "for_trial", "settle"]


def for_trial(template: str, trial: Any) -> str:
    """``template`` with ``{trial}`` replaced by ``trial`` (its label, or as given)."""
    return template.replace("{trial}", str(getattr(trial, "label", trial)))


def check_silence(lives: Iterable[TrialProtocol], since: float, kill: Callable[[str], None]) -> bool:
    """The hang check: when the process training ``lives`` has said nothing since ``since``
    (``time.monotonic()``) for longer than their ``trial_timeout`` plus the grace, ``kill`` it with
    the timeout message (a template naming ``{trial}``: :func:`for_trial`). True when it was killed."""
    lives = list(lives)
    if not any(life.silent_too_long(since) for life in lives):
        return False
    timeout = lives[0].hooks.trial_timeout or 0.0
    kill(timeout_error("{trial}", timeout, "inside an epoch and was killed"))
    return True


def check_overtime(life: TrialProtocol, kill: Callable[[], None]) -> bool:
    """A user's loop past ``trial_timeout`` on the wall clock (reporting or not): ``kill`` its
    process, then the trial times out. True when it was killed."""
    if not life.over_time():
        return False
    kill()
    life.time_out("and was killed")
    return True


def death_error(process: str, detail: str, times: int = 1, limit: str = "") -> str:
    """The message of a trial whose ``process`` (``"worker process"``, ``"forked process"``, ``"worker"``)
    died ``times`` times; ``detail``: its exit code or what the cluster said; ``limit``: the setting
    that allows no more restarts (``"max_retries=2"``), named when given (a template naming ``{trial}``).

    >>> death_error("worker", "RayActorError on node 10.0.0.2", times=3, limit="max_retries=2")
    'the worker of trial {trial} died 3 time(s) (max_retries=2 allows no more restarts; last: RayActorError on node 10.0.0.2)'
    """
    counted = "" if times == 1 else f" {times} time(s)"
    if limit:
        detail = f"{limit} allows no more restarts; last: {detail}"
    return f"the {process} of trial {{trial}} died{counted} ({detail})"


def ended_error(where: str) -> str:
    """The message of a trial whose unit ended ``where`` (``"in its worker"``) without its outcome
    (a template naming ``{trial}``)."""
    return f"the unit of trial {{trial}} ended {where} without an outcome for it"


def settle(life: TrialProtocol | None, outcome: Outcome, load: Callable[[Any], Any]) -> None:
    """The trial's outcome from the process that trained it, into its protocol (None: a trial that
    left already, nothing to do): what the unit wrote
    into ``trial.info`` first, then failed with the error, or finished with the value (None: the
    last recorded) and the weights (``load`` turns the outcome's ``weights`` -- bytes through a
    pipe, a file under Ray's storage -- into a state dict). A trial dropped there (past its
    timeout) was failed here already."""
    if life is None or outcome.kind in ("dropped", "yielded"):
        return
    life.trial.info.update(outcome.info or {})
    if outcome.kind == "error":
        life.fail(outcome.error or "")
        return
    life.finish(outcome.value, None if outcome.weights is None else load(outcome.weights))
