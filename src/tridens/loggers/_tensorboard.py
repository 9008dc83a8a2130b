"""TensorBoard logging: one run (folder) per trial, its per-step metrics as scalars and its
hyperparameters in TensorBoard's HParams plugin."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..trial import Trial
from ._base import Callback, trial_name

__all__ = ["TensorBoard"]

BEST_TAG = "tridens/best"  # 1 for the experiment's best trial, 0 for the others


def _hparam_value(value: Any) -> Any:
    """What the HParams plugin accepts: numbers, strings and bools; anything else as JSON text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, sort_keys=True)


class TensorBoard(Callback):
    """Write each trial to ``<log_dir>/<experiment>/trial-<number>`` for TensorBoard.

    Per step, every reported metric is a scalar (``val_acc``, ``train_loss``, ...). When the trial
    ends, its sample goes to the HParams plugin with its final metrics, plus ``tridens/best``
    (1 for the experiment's best trial when the run ends, 0 otherwise) and ``tridens/status``
    as text. Needs ``pip install 'tridens[tensorboard]'``.

    >>> exp = td.Experiment(space, evaluator, callbacks=[td.loggers.TensorBoard("tb")])  # doctest: +SKIP
    >>> # then: tensorboard --logdir tb
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = log_dir
        self._writers: dict[int, Any] = {}
        self._root: Path | None = None

    def _writer(self, trial: Trial) -> Any:
        writer = self._writers.get(trial.id)
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("td.loggers.TensorBoard needs TensorBoard: pip install 'tridens[tensorboard]'") from err
            root = self._root if self._root is not None else Path(self.log_dir)
            writer = SummaryWriter(log_dir=str(root / f"trial-{trial_name(trial)}"))
            self._writers[trial.id] = writer
        return writer

    def on_experiment_start(self, name: str, config: Mapping[str, Any]) -> None:
        self._root = Path(self.log_dir) / name

    def on_trial_step(self, trial: Trial, step: int, metrics: Mapping[str, float]) -> None:
        writer = self._writer(trial)
        for key, value in metrics.items():
            writer.add_scalar(key, float(value), step)

    def on_trial_end(self, trial: Trial) -> None:
        from torch.utils.tensorboard.summary import hparams

        writer = self._writer(trial)
        final = {k: float(v[-1]) for k, v in trial.metrics.items() if v and math.isfinite(float(v[-1]))}
        exp, ssi, sei = hparams({k: _hparam_value(v) for k, v in trial.sample.items()},
                                {**final, BEST_TAG: 0.0})
        for summary in (exp, ssi, sei):
            writer.file_writer.add_summary(summary)
        writer.add_scalar(BEST_TAG, 0.0, 0)
        writer.add_text("tridens/status", f"{trial.status.value}" + (f": {trial.error.strip().splitlines()[-1]}"
                                                                     if trial.error else ""))
        writer.close()
        self._writers.pop(trial.id, None)

    def on_experiment_end(self, name: str, best: Trial | None, trials: Sequence[Trial]) -> None:
        if best is None:
            return
        writer = self._writer(best)
        writer.add_scalar(BEST_TAG, 1.0, 1)  # a later step than the 0 written at the trial's end
        writer.add_text("tridens/best", f"best trial of {name}: {best.metric}")
        writer.close()
        self._writers.pop(best.id, None)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
