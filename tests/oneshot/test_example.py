"""examples/oneshot_nas.py runs as a user would run it."""

import os
import subprocess
import sys
from pathlib import Path

import tridens as td

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "oneshot_nas.py"


def test_oneshot_example_prints_and_stores_the_architectures(tmp_path):
    store = tmp_path / "oneshot.db"
    res = subprocess.run([sys.executable, str(EXAMPLE), "--strategy", "darts", "--epochs", "1", "--samples", "3",
                          "--retrain", "--store", str(store)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "architecture weights (softmax of alpha):" in res.stdout and "retrained" in res.stdout
    trials = td.Experiment.load(store, "oneshot-darts").trials()
    roles = sorted(t.info["oneshot"]["role"] for t in trials)
    assert roles == ["retrain", "subnet", "subnet", "subnet", "supernet"]
