"""Definitions in ``__main__`` (``python -c``, a script without a ``__main__`` guard, a notebook)
reach the process pool's workers by value: an evaluator function, a space and a dataset defined
there train, and the workers never run the script again. Real ``python`` subprocesses."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import tridens as td

ROOT = Path(__file__).resolve().parents[2]

_DEFINITIONS = '''
import torch
from torch import nn
import tridens as td
print("the script ran", flush=True)

class Digits(torch.utils.data.Dataset):
    def __init__(self, base):
        self.base = base
    def __len__(self):
        return len(self.base)
    def __getitem__(self, i):
        return self.base[i]

class Net(td.nn.ModelSpace):
    def __init__(self):
        super().__init__()
        width = td.choice("width", [8, 16])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
    def forward(self, x):
        return self.body(x)

SCALE = 3.0

def loop(model, x):
    for step in range(2):
        td.report({"value": SCALE * x + step}, step=step)
'''


def _run(args, store):
    return subprocess.run([sys.executable, *args], cwd=store.parent, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def _statuses(store, name):
    with td.store.Store(store, readonly=True) as db:
        return {t.label: (t.status.value, t.metric) for t in db.trials(name)}


def test_a_function_and_a_space_defined_in_python_c_train_on_the_pool(tmp_path):
    store = tmp_path / "c.db"
    code = _DEFINITIONS + textwrap.dedent(f'''
        evaluator = td.evaluators.FunctionalEvaluator(loop, x=td.choice("x", [1, 2]))
        td.Experiment(Net(), evaluator, td.strategy.GridSearch(), store={str(store)!r}, name="c", verbose=False,
                      executor=td.executors.Process(workers=2)).run()
    ''')
    done = _run(["-c", code], store)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    trials = _statuses(store, "c")
    assert len(trials) == 4 and all(status == "completed" for status, _ in trials.values()), trials
    assert sorted(metric for _, metric in trials.values()) == [4.0, 4.0, 7.0, 7.0]


def test_a_script_without_a_main_guard_trains_its_dataset_and_space_on_the_pool_and_runs_once(tmp_path):
    store = tmp_path / "s.db"
    script = tmp_path / "search.py"
    script.write_text(_DEFINITIONS + textwrap.dedent(f'''
        train, val = td.datasets.digits()
        evaluator = td.evaluators.Classification(Digits(train), Digits(val), epochs=1, batch_size=128,
                                                 lr=td.choice("lr", [0.01, 0.05]))
        td.Experiment(Net(), evaluator, td.strategy.GridSearch(), store={str(store)!r}, name="s", verbose=False,
                      executor=td.executors.Process(workers=2)).run()
    '''))
    done = _run([str(script)], store)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.count("the script ran") == 1, done.stdout   # the workers did not run it again
    trials = _statuses(store, "s")
    assert len(trials) == 4 and all(status == "completed" for status, _ in trials.values()), trials


def test_a_lambda_given_to_the_pool_travels_by_value(tmp_path):
    evaluator = td.evaluators.FunctionalEvaluator(lambda x: float(x) * 2, x=td.choice("x", [1, 2]))
    exp = td.Experiment(None, evaluator, td.strategy.GridSearch(), store=tmp_path / "l.db", name="l",
                        options=td.RunOptions(verbose=False), executor=td.executors.Process(workers=1))
    trials = exp.run().trials()
    assert sorted((t.status.value, t.metric) for t in trials) == [("completed", 2.0), ("completed", 4.0)]
