"""A plain random search for the resume test: `python resume_sequence_script.py DB PAUSE`."""

import sys
import time

import tridens as td


PAUSE = 0.0  # seconds per trial: not an evaluator setting, so the resumed run has the same evaluator


def score(x, y):
    time.sleep(PAUSE)
    return float(x) + y


if __name__ == "__main__":
    db, PAUSE = sys.argv[1], float(sys.argv[2])
    evaluator = td.evaluators.FunctionalEvaluator(score, x=td.choice("x", list(range(1000))),
                                                  y=td.uniform("y", 0.0, 1.0))
    td.Experiment(None, evaluator, td.strategy.Random(batch_size=4), budget=16,
                  options=td.RunOptions(seed=5, verbose=False), store=db, name="sequence").run()
