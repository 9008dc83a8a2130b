"""A stage-tree experiment run as its own process (tests/xopt/test_stage_store.py kills it with
SIGKILL and runs it again to resume): a grid over step-schedule milestones, decay factors and
epoch budgets, per-architecture seeds, one group. Every training batch appends one byte to
``<store>.batches`` (the transform below), so the test counts what each run trained. The test
imports :class:`Net` from here: one model for the in-process and the subprocess cases.

Usage: python -m tests.xopt.stage_script STORE [SECONDS_PER_BATCH [EXECUTOR]]  (EXECUTOR: inline or process;
on the process pool the workers count their batches through the same file, named in the environment)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

import torch
from torch import nn

import tridens as td


class Net(td.nn.ModelSpace):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


def grid_evaluator(data, epochs, gammas, lr=0.05, transforms: Callable | None = None) -> td.evaluators.Classification:
    """A new evaluator object each time: what one run trained reaches another only through the store."""
    train, val = data
    return td.evaluators.Classification(train, val, batch_size=128, lr=lr, schedule="step",
                                        epochs=td.choice("epochs", epochs), milestones=td.choice("milestones", [[1], [2]]),
                                        gamma=td.choice("gamma", gammas), transforms=transforms)


# set by the command line, through the environment so that pool workers (which import this module) see them
STORE, PAUSE = os.environ.get("STAGE_SCRIPT_STORE", ""), float(os.environ.get("STAGE_SCRIPT_PAUSE", "0"))


def counted(x: torch.Tensor) -> torch.Tensor:
    """The identity, counting the batch in ``<STORE>.batches`` (and slowing it down by PAUSE
    seconds). A module-level function: stored stages need transforms with a stable name."""
    with open(STORE + ".batches", "a") as f:
        f.write("x")
    time.sleep(PAUSE)
    return x


if __name__ == "__main__":
    STORE, PAUSE = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    os.environ["STAGE_SCRIPT_STORE"], os.environ["STAGE_SCRIPT_PAUSE"] = STORE, str(PAUSE)
    executor = td.executors.Process(workers=2) if sys.argv[3:] == ["process"] else td.executors.Inline()
    evaluator = grid_evaluator(td.datasets.digits(), [2, 4], [0.1, 0.5], transforms=counted)
    td.Experiment(Net(), evaluator, td.strategy.GridSearch(batch_size=16), store=STORE, name="tree",
                  options=td.RunOptions(seeds="per-architecture", verbose=False), executor=executor).run()
