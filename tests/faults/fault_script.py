"""Searches the fault tests run in real subprocesses (to signal, to fill a disk under):

    python -m tests.faults.fault_script SCENARIO EXECUTOR STORE

The loops are at module level so that pool workers import them. ``MARK`` in the environment: a
folder where each step of a trial leaves a file (the test waits for one before it signals).
"""

import os
import sys
import time

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn


def steps(x):
    """Four steps of 0.2 s each; every step leaves a mark for the test."""
    mark = os.environ.get("MARK")
    for step in range(4):
        time.sleep(0.2)
        if mark:
            open(os.path.join(mark, f"{x}-{step}-{os.getpid()}"), "w").close()
        td.report({"value": float(x * 10 + step)}, step=step)
    return float(x * 10 + 3)


def hangs(x):
    """Like :func:`steps`, but trial x=0 hangs after its first step (the test kills the forkserver
    meanwhile; trial_timeout must end it)."""
    mark = os.environ.get("MARK")
    for step in range(4):
        if mark:
            open(os.path.join(mark, f"{x}-{step}-{os.getpid()}"), "w").close()
        td.report({"value": float(x * 10 + step)}, step=step)
        if x == 0:
            time.sleep(3600)
        time.sleep(0.2)
    return float(x * 10 + 3)


class Wide(tnn.ModelSpace):
    """One architecture with ~150 KB of weights: a checkpoint that a nearly full disk cannot take."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def fill_the_disk_once(room):
    """Fills the disk of the folder ``FILL`` (once: a marker remembers it), leaving ``room`` bytes
    free: the store's next write meets a full disk."""
    folder = os.environ["FILL"]
    marker = os.path.join(folder, "filled")
    if os.path.exists(marker):
        return
    open(marker, "w").close()
    filler = os.path.join(folder, "filler")
    try:
        with open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    except OSError:
        pass
    os.truncate(filler, max(0, os.path.getsize(filler) - room))


def fills_the_disk(model, x, room):
    """Trial x=1 fills the disk once, leaving ``room`` bytes free, then reports: the store's next
    write (its metrics with no room, the checkpoint with a little) meets a full disk."""
    if x == 1:
        fill_the_disk_once(room)
    td.report({"value": float(x)}, step=0)
    return float(x)


class FillsTheDiskOnce(td.loggers.Callback):
    """A callback that fills the disk of the folder ``FILL`` at the supernet's first epoch (once:
    a marker remembers it), leaving ``room`` bytes: the store's next write meets a full disk."""

    def __init__(self, room):
        self.room = room

    def on_trial_step(self, trial, step, metrics):
        fill_the_disk_once(self.room)


def executor(kind):
    return td.executors.Inline() if kind == "inline" else td.executors.Process(workers=2)


def main() -> None:
    scenario, kind, store = sys.argv[1:4]
    if scenario == "steps":
        evaluator = td.evaluators.FunctionalEvaluator(steps, x=td.choice("x", list(range(8))))
        td.Experiment(None, evaluator, td.strategy.GridSearch(), budget=8, store=store, name="steps",
                      executor=executor(kind), options=td.RunOptions(verbose=False)).run()
    elif scenario == "hangs":   # trial x=0 hangs after its first report; trial_timeout=4 s
        evaluator = td.evaluators.FunctionalEvaluator(hangs, x=td.choice("x", list(range(4))))
        td.Experiment(None, evaluator, td.strategy.GridSearch(), budget=td.Budget(max_trials=4, trial_timeout=4),
                      store=store, name="hangs", executor=executor(kind), options=td.RunOptions(verbose=False)).run()
    elif scenario.startswith("oneshot-fill-"):   # oneshot-fill-<room in bytes>
        from tests.oneshot.spaces import DigitsCNN

        train, val = td.datasets.digits()
        evaluator = td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="adam", lr=0.01)
        td.Experiment(DigitsCNN(), evaluator, td.oneshot.RandomOneShot(samples=2, search="random"), store=store,
                      name="oneshot", executor=executor(kind), options=td.RunOptions(verbose=False),
                      callbacks=[FillsTheDiskOnce(int(scenario.split("-")[2]))]).run()
    elif scenario == "pbt":   # a population of 4 on the pool: each member's state kept per round
        train, val = td.datasets.digits()
        evaluator = td.evaluators.Classification(train=train, val=val, epochs=3, batch_size=128, optimizer="sgd",
                                                 lr=td.loguniform("lr", 1e-3, 0.5))
        td.Experiment(Wide(), evaluator, td.strategy.PBT(population=4, interval=1, hyperparams=["lr"]), store=store,
                      name="pbt", executor=executor(kind), budget=td.Budget(max_trials=4),
                      options=td.RunOptions(verbose=False)).run()
    elif scenario.startswith("fill-"):   # fill-<room in bytes>
        evaluator = td.evaluators.FunctionalEvaluator(fills_the_disk, x=td.choice("x", [0, 1, 2, 3]),
                                                      room=int(scenario.split("-")[1]))
        td.Experiment(Wide(), evaluator, td.strategy.GridSearch(), budget=4, store=store, name="fill",
                      executor=executor(kind), options=td.RunOptions(verbose=False)).run()


if __name__ == "__main__":
    main()
