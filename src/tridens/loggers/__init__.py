"""Send what an experiment records to the trackers users already have, and read it into Optuna.

``td.Experiment(..., callbacks=[td.loggers.TensorBoard("tb"), td.loggers.MLflow("sqlite:///mlflow.db")])``
logs each trial as a run (hyperparameters, per-step metrics, the best marked);
:func:`export_optuna` writes an experiment as an Optuna study. TensorBoard and MLflow are optional
extras (``pip install 'tridens[tensorboard]'``, ``'tridens[mlflow]'``), imported when a run starts.

>>> from tridens.loggers import Callback, TensorBoard, MLflow
>>> TensorBoard("runs/tb").log_dir
'runs/tb'
"""

from ._base import Callback, trial_name
from ._mlflow import MLflow
from ._optuna import export_optuna, infer_distributions, optuna_trials
from ._tensorboard import TensorBoard

__all__ = ["Callback", "trial_name", "TensorBoard", "MLflow", "export_optuna", "optuna_trials", "infer_distributions"]
