"""The callback protocol of :class:`tridens.Experiment`: hooks called as the run writes the store."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..trial import Trial

__all__ = ["Callback", "trial_name"]


def trial_name(trial: Trial) -> str:
    """How a logger names a trial: its number in the experiment (as tables show it) when the
    record carries one, else its store id.

    >>> trial_name(Trial(id=7, sample={}, seed=0))
    '7'
    """
    number = getattr(trial, "number", None)
    return str(trial.id if number is None else number)


class Callback:
    """Receives what a run records, after the store has it; every hook does nothing by default.

    Pass instances to ``td.Experiment(..., callbacks=[...])``. Hooks run in the process that runs
    the experiment, in this order: :meth:`on_experiment_start` once, :meth:`on_trial_step` after
    each step (epoch) a trial reports, :meth:`on_trial_end` when a trial finishes (completed,
    stopped, failed), :meth:`on_experiment_end` when the run ends normally. A hook that raises is
    logged and the run goes on (the store already holds the data).

    >>> class PrintBest(Callback):
    ...     def on_experiment_end(self, name, best, trials):
    ...         print(name, None if best is None else best.metric)
    """

    def on_experiment_start(self, name: str, config: Mapping[str, Any]) -> None:
        """The run of experiment ``name`` starts; ``config`` is what the store records (objective, ...)."""

    def on_trial_step(self, trial: Trial, step: int, metrics: Mapping[str, float]) -> None:
        """``trial`` reported ``metrics`` (name -> value) at ``step``."""

    def on_trial_end(self, trial: Trial) -> None:
        """``trial`` finished: ``.status``, ``.metric``, ``.error`` and ``.checkpoint`` are final."""

    def on_experiment_end(self, name: str, best: Trial | None, trials: Sequence[Trial]) -> None:
        """The run ended; ``best`` is the experiment's best trial (None before any), ``trials``
        those finished in this run."""

    def close(self) -> None:
        """Release files and connections (called after :meth:`on_experiment_end`, or when the run fails)."""
