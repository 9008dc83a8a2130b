"""A plain random search for the resume test: `python resume_sequence_script.py DB PAUSE`."""

import sys
import time

import tridens as td


def score(x, y, pause):
    time.sleep(pause)
    return float(x) + y


if __name__ == "__main__":
    db, pause = sys.argv[1], float(sys.argv[2])
    evaluator = td.evaluators.FunctionalEvaluator(score, x=td.choice("x", list(range(1000))),
                                                  y=td.uniform("y", 0.0, 1.0), pause=pause)
    td.Experiment(None, evaluator, td.strategy.Random(batch_size=4), max_trials=16, seed=5, store=db,
                  name="sequence", verbose=False).run()
