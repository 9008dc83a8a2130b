"""A one-shot experiment runs in one process at a time, as a multi-trial one does: a second
process running the same name on the same store is refused with one line naming the first."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tridens.store import Store

SCRIPT = Path(__file__).with_name("resume_script.py")


def test_a_second_runner_of_a_one_shot_experiment_is_refused(tmp_path):
    db = tmp_path / "oneshot.db"
    lock = Path(str(db) + ".files") / "resume" / ".run.lock"
    first = subprocess.Popen([sys.executable, str(SCRIPT), str(db), "50"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and first.poll() is None and not (lock.exists() and lock.read_text()):
            time.sleep(0.2)
        assert lock.exists() and first.poll() is None, "the first run never started"
        second = subprocess.run([sys.executable, "-m", "tridens.cli", "run", str(SCRIPT), str(db), "50"],
                                capture_output=True, text=True, timeout=240)
        assert second.returncode == 1, second.stderr
        assert second.stderr.count("\n") == 1, second.stderr
        assert "already running" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr
        assert first.poll() is None  # the first run goes on
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    with Store(db) as store:  # the killed runner's claim went with its process
        store.lock_run("resume")
