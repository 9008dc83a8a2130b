"""Executors: where an experiment's trials train, as objects passed to ``td.Experiment(executor=...)``.

* :class:`Inline` -- in this process (the default);
* :class:`Process` -- a pool of ``workers`` long-lived worker processes;
* :class:`Ray` -- Ray tasks on a local Ray or a cluster (``pip install 'ray==2.58.0'``).

Every executor drives each trial through the one trial protocol
(:class:`tridens.engine.TrialProtocol`) and its units through the unit protocol
(:class:`tridens.units.ExecutionUnit`); :class:`Executor` is the base a new executor implements.

>>> import tridens as td
>>> td.executors.Process(workers=4).workers
4
>>> exp = td.Experiment(space, evaluator, executor=td.executors.Ray(address=None, storage="runs/",
...                     max_retries=2), allocation="dynamic")                          # doctest: +SKIP
"""

from typing import Any

from ..engine import Executor, InlineExecutor as Inline, ProcessExecutor as Process, RunContext

__all__ = ["Executor", "RunContext", "Inline", "Process", "Ray"]


def __getattr__(name: str) -> Any:
    if name == "Ray":  # Ray is optional: imported when asked for
        from ..engine import RayExecutor

        return RayExecutor
    raise AttributeError(f"module 'tridens.executors' has no attribute {name!r}")
