"""The store's experiment record (trials travel as :class:`tridens.trial.Trial`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import StoreError
from ..trial import Objective

__all__ = ["ExperimentRecord"]


@dataclass
class ExperimentRecord:
    """One experiment as the store holds it.

    ``config`` is free-form JSON; by convention the engine writes ``space`` (an importable dotted
    path ``"pkg.module:Net"`` or a script path ``"search.py:Net"``), ``evaluator`` and ``strategy``
    (``{"type": dotted path, "params": {...}}``), ``max_trials``, ``seed`` and ``objective``.
    ``status`` is a free string (the engine uses ``created``, ``running``, ``done``, ``failed``).

    >>> ExperimentRecord(id=1, name="mnist", status="created", config={"max_trials": 8}).name
    'mnist'
    """

    id: int
    name: str
    status: str
    config: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0

    def objective(self) -> Objective:
        """The objective ``config`` records (``val_acc``, max when it records none); a stored value
        that is not one raises :class:`~tridens.errors.StoreError` naming the experiment.

        >>> ExperimentRecord(1, "a", "done", {"objective": {"metric": "loss", "mode": "min"}}).objective().mode
        'min'
        """
        stored = self.config.get("objective")
        if stored is None:
            return Objective()
        try:
            return Objective(**stored)
        except (TypeError, ValueError) as err:
            raise StoreError(f"experiment {self.name!r} records the objective {stored!r}, which is not one: "
                             f"{' '.join(str(err).split())}") from err
