"""Shared check: a second process running an experiment name that a live process runs is refused."""

import os
import signal
import subprocess
import time
from pathlib import Path

from tridens.store import Store


def assert_second_runner_refused(first: list[str], second: list[str], db: Path, name: str) -> None:
    """Start ``first``, wait for its run lock on ``name``, run ``second`` to its end and check it exits 1
    with one line naming the first's pid while the first goes on; after the first is killed, its
    claim is gone (a killed runner blocks nobody)."""
    lock = Path(str(db) + ".files") / name / ".run.lock"
    runner = subprocess.Popen(first, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and runner.poll() is None and not (lock.exists() and lock.read_text()):
            time.sleep(0.2)
        assert lock.exists() and runner.poll() is None, "the first run never started"
        refused = subprocess.run(second, capture_output=True, text=True, timeout=240)
        assert refused.returncode == 1, refused.stderr
        assert refused.stderr.count("\n") == 1, refused.stderr
        assert "already running" in refused.stderr and f"pid {runner.pid}" in refused.stderr, refused.stderr
        assert runner.poll() is None  # the first run goes on
    finally:
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait()
    with Store(db) as store:
        store.lock_run(name)
