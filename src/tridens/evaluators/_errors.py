"""Errors raised while evaluating a trial, and the exception that stops a user's loop."""

from __future__ import annotations

from ..errors import TridensError

__all__ = ["InvalidParameter", "TrialFailed", "NonFiniteLoss", "NothingReported", "TrialStopped"]


class InvalidParameter(TridensError, ValueError):
    """An evaluator parameter (given directly or resolved from a sample) breaks its constraint.

    Raised when training starts, never by a constructor (which only stores its parameters).
    """


class TrialFailed(TridensError, RuntimeError):
    """The trial itself failed (its model diverged, its loop reported nothing...).

    The engine marks such a trial ``FAILED`` with this message; the search goes on.
    """


class NonFiniteLoss(TrialFailed):
    """The training loss became NaN or infinite.

    ``epoch`` and ``batch`` are 0-based (the batch within the epoch); ``step`` counts optimizer
    steps since the start of training.
    """

    def __init__(self, message: str, *, epoch: int, batch: int, step: int, value: float):
        super().__init__(message)
        self.epoch, self.batch, self.step, self.value = epoch, batch, step, value

    @classmethod
    def at(cls, owner: str, value: float, *, epoch: int, batch: int, step: int, lr: float) -> "NonFiniteLoss":
        """The error of a training loss that became ``value`` (one message wherever training runs)."""
        return cls(f"the training loss of {owner} became {value} at epoch {epoch}, batch {batch} "
                   f"(optimizer step {step}, lr {lr:.6g}); the trial failed. A lower 'lr' usually helps.",
                   epoch=epoch, batch=batch, step=step, value=value)


class NothingReported(TrialFailed):
    """A :class:`FunctionalEvaluator`'s function neither reported a value nor returned one."""


class TrialStopped(TridensError):
    """Raised by :func:`tridens.report` when the strategy answered STOP.

    :class:`FunctionalEvaluator` catches it around the user's function: let it propagate (don't
    catch it in a training loop) and the trial ends with its last reported value.
    """
