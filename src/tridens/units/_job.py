"""``Job``: one trial handed to the planner and the executors, with its concrete model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import nn

from ..trial import Trial

__all__ = ["Job"]


@dataclass
class Job:
    """One trial to run: its record, its concrete model (None when the evaluator needs none), the
    group's step cap, when it started (``time.monotonic()``, for ``trial_timeout``), and
    ``start_from``: a member's state (``ExecutionUnit.state_dict``) the trial continues from -- a
    fork of another trial at a step -- or None for a fresh start. ``hparams``: the sample the
    trial trains with from here on when a fork changed its hyperparameters (PBT), else None
    (its ``trial.sample``); :attr:`sample` is the one a unit builds its trainer from, and
    :meth:`config` the training config it trains with, resolved once from that sample.

    >>> from tridens.trial import Trial
    >>> Job(Trial(id=1, sample={"lr": 0.1}, seed=0), model=None).max_steps is None
    True
    """

    trial: Trial
    model: nn.Module | None
    max_steps: int | None = None
    started: float = field(default_factory=time.monotonic)
    start_from: Mapping[str, Any] | None = None
    hparams: dict[str, Any] | None = None
    # (evaluator, sample) the config was resolved for, and the config or the error resolving raised
    _resolved: tuple[Any, Any, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def concrete_model(self) -> nn.Module:
        """:attr:`model`, for a unit that trains it: a job without one (its evaluator needs no
        model) handed to such a unit is a planning error.

        >>> from tridens.trial import Trial
        >>> Job(Trial(id=1, sample={}, seed=0), model=nn.Linear(2, 1)).concrete_model
        Linear(in_features=2, out_features=1, bias=True)
        """
        if self.model is None:
            raise TypeError(f"trial {self.trial.id} has no model (its evaluator needs none); a unit that trains "
                            "models was given it")
        return self.model

    @property
    def sample(self) -> dict[str, Any]:
        """The hyperparameters the trial trains with now."""
        return self.trial.sample if self.hparams is None else self.hparams

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_resolved"] = None   # resolved again where the job is unpickled (it holds the evaluator)
        return state

    def resolve_config(self, evaluator: Any) -> None:
        """Resolve the training config of :attr:`sample` (``evaluator.config``) now, once; an
        invalid sample's error is kept and raised by :meth:`config` (the engine calls this when
        it makes the job; planners and units then only read it)."""
        sample = self.sample
        if self._resolved is not None and self._resolved[0] is evaluator and self._resolved[1] is sample:
            return
        make = getattr(evaluator, "config", None)
        try:
            value: Any = make(sample) if callable(make) else None
        except Exception as err:  # the trial's unit reports it as the trial's failure
            value = err
        self._resolved = (evaluator, sample, value)

    def config(self, evaluator: Any) -> Any:
        """The training config (e.g. a :class:`~tridens.evaluators.TrainConfig`) the trial trains
        with: ``evaluator.config`` of :attr:`sample` -- the fork's hyperparameters after a PBT
        fork -- resolved once per sample; None for an evaluator without configs. Raises what
        resolving raised for an invalid sample.

        >>> import tridens as td
        >>> from tridens.trial import Trial
        >>> ev = td.evaluators.Classification(td.datasets.digits()[0], td.datasets.digits()[1], lr=td.choice("lr", [0.1, 0.5]))
        >>> job = Job(Trial(id=1, sample={"lr": 0.5}, seed=0), model=None)
        >>> job.config(ev).lr, job.config(ev) is job.config(ev)
        (0.5, True)
        """
        self.resolve_config(evaluator)
        assert self._resolved is not None
        value = self._resolved[2]
        if isinstance(value, BaseException):
            raise value
        return value
