"""PBT on digits for the kill-and-resume test: `python pbt_script.py DB PAUSE [process|ray]` (PAUSE
seconds after every recorded epoch, so that a kill lands inside the second population; ``process``:
on the process pool, the population over two workers; ``ray``: over two Ray tasks of a local Ray,
checkpoints under ``DB``'s folder)."""

import sys
import time

from torch import nn

import tridens as td


class MLP(td.nn.ModelSpace):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


class Pause(td.loggers.Callback):
    def __init__(self, seconds):
        self.seconds = seconds

    def on_trial_step(self, trial, step, metrics):
        time.sleep(self.seconds)


def evaluator():
    train, val = td.datasets.digits()
    return td.evaluators.Classification(
        train, val, epochs=6, batch_size=64, optimizer="sgd", lr=td.loguniform("lr", 1e-3, 0.5),
        momentum=td.uniform("momentum", 0.0, 0.95), weight_decay=td.choice("weight_decay", [0.0, 1e-4, 1e-3]))


if __name__ == "__main__":
    db, pause = sys.argv[1], float(sys.argv[2])
    kind = sys.argv[3] if len(sys.argv) > 3 else "inline"
    executor = {"process": lambda: td.executors.Process(workers=2),
                "ray": lambda: td.executors.Ray(workers=2, storage=db + ".ray"),
                "inline": td.executors.Inline}[kind]()
    td.Experiment(MLP(), evaluator(), td.strategy.PBT(population=4, interval=2), budget=8,
                  options=td.RunOptions(seed=3, verbose=False), store=db, name="pbt", callbacks=[Pause(pause)],
                  executor=executor).run()
