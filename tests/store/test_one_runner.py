"""One experiment name runs in one process at a time: a second runner on the same store is
refused with one line naming the first (pid, host), and a killed runner blocks nobody."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tridens.store import Store

SCRIPT = Path(__file__).parents[1] / "cli" / "search_script.py"
TRIDENS = [sys.executable, "-m", "tridens.cli"]


def test_a_second_runner_of_the_same_experiment_is_refused(tmp_path):
    db = tmp_path / "runs.db"
    lock = Path(str(db) + ".files") / "cli-search" / ".run.lock"
    first = subprocess.Popen([*TRIDENS, "run", str(SCRIPT), "--db", str(db), "1.0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (lock.exists() and lock.read_text()):
            time.sleep(0.2)
        assert lock.exists(), "the first run never started"
        second = subprocess.run([*TRIDENS, "run", str(SCRIPT), "--db", str(db), "0"], capture_output=True,
                                text=True, timeout=240)
        assert second.returncode == 1
        assert second.stderr.count("\n") == 1, second.stderr
        assert "already running" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr
        assert first.poll() is None  # the first run goes on
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    with Store(db) as store:  # the killed runner's claim went with its process
        store.lock_run("cli-search")
