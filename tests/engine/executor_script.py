"""A driver for the executor conformance suite's subprocess cases (a real process to kill):

    python -m tests.engine.executor_script EXECUTOR STORE SCENARIO [verbose]

EXECUTOR is ``inline``, ``process`` or ``ray``; SCENARIO names the user loop (below); ``verbose``
runs with the progress table and the executor's start messages. The loops are at module level so
that pool workers and Ray workers import them.
"""

import os
import sys
import time

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn


class OneMLP(tnn.ModelSpace):
    """One architecture: the samples differ only in the loop's ``x``."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


TRIALS = {"crash": 4, "slow": 6, "hang": 2}
ONESHOT_EPOCHS = 6


def crash_on_x_2(model, x):
    """x=2 kills the process that runs it (``os._exit``), whichever process that is."""
    td.report({"value": float(x), "pid": os.getpid()}, step=0)
    if x == 2:
        os._exit(3)
    return float(x)


def slow_steps(model, x):
    """Four steps of 0.3 s each: long enough to be killed in the middle of the run."""
    for step in range(4):
        time.sleep(0.3)
        td.report({"value": x * (step + 1), "pid": os.getpid()}, step=step)


def hang(model, x):
    """Reports its process id, then hangs without reporting again."""
    td.report({"value": float(x), "pid": os.getpid()}, step=0)
    time.sleep(600)


LOOPS = {"crash": crash_on_x_2, "slow": slow_steps, "hang": hang}


def executor(kind: str, store: str):
    if kind == "inline":
        return td.executors.Inline()
    if kind == "process":
        return td.executors.Process(workers=2)
    return td.executors.Ray(workers=2, storage=store + ".ray")


def oneshot(kind: str, store: str) -> None:
    """A one-shot search (SPOS over the one-shot tests' DigitsCNN, ``ONESHOT_EPOCHS`` supernet epochs)."""
    from tests.oneshot.spaces import DigitsCNN

    torch.set_num_threads(1)  # the same float results in every process
    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, epochs=1, batch_size=64, optimizer="adam", lr=0.01)
    td.Experiment(DigitsCNN(), evaluator, td.oneshot.RandomOneShot(samples=2, search="random", epochs=ONESHOT_EPOCHS),
                  store=store, name="oneshot", executor=executor(kind, store), options=td.RunOptions(verbose=False)).run()


def main() -> None:
    kind, store, scenario = sys.argv[1:4]
    verbose = sys.argv[4:5] == ["verbose"]
    if scenario == "oneshot":
        oneshot(kind, store)
        return
    evaluator = td.evaluators.FunctionalEvaluator(LOOPS[scenario], x=td.choice("x", list(range(TRIALS[scenario]))))
    td.Experiment(OneMLP(), evaluator, td.strategy.GridSearch(), budget=TRIALS[scenario], store=store,
                  name=scenario, executor=executor(kind, store), options=td.RunOptions(verbose=verbose)).run()


if __name__ == "__main__":
    main()
