"""Searches the fault tests run in real subprocesses (to signal, to fill a disk under):

    python -m tests.faults.fault_script SCENARIO EXECUTOR STORE

The loops are at module level so that pool workers import them. ``MARK`` in the environment: a
folder where each step of a trial leaves a file (the test waits for one before it signals).
"""

import os
import sys
import time

import tridens as td


def steps(x):
    """Four steps of 0.2 s each; every step leaves a mark for the test."""
    mark = os.environ.get("MARK")
    for step in range(4):
        time.sleep(0.2)
        if mark:
            open(os.path.join(mark, f"{x}-{step}-{os.getpid()}"), "w").close()
        td.report({"value": float(x * 10 + step)}, step=step)
    return float(x * 10 + 3)


def executor(kind):
    return td.executors.Inline() if kind == "inline" else td.executors.Process(workers=2)


def main() -> None:
    scenario, kind, store = sys.argv[1:4]
    if scenario == "steps":
        evaluator = td.evaluators.FunctionalEvaluator(steps, x=td.choice("x", list(range(8))))
        td.Experiment(None, evaluator, td.strategy.GridSearch(), max_trials=8, store=store, name="steps",
                      executor=executor(kind), verbose=False).run()


if __name__ == "__main__":
    main()
