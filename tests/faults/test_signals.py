"""SIGTERM stops a run as Ctrl-C does: one line, the running trials interrupted (not counted as
crashes), so a job preempted any number of times resumes to the end. Real subprocesses."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tridens as td

ROOT = Path(__file__).resolve().parents[2]


def _run(kind, store, mark, *, terminate):
    """One run of the 8-trial search; with ``terminate``, SIGTERM once a trial has trained a step
    (to the driver, or with the process pool to its whole process group, as a batch scheduler does)."""
    for f in mark.iterdir():
        f.unlink()
    proc = subprocess.Popen([sys.executable, "-m", "tests.faults.fault_script", "steps", kind, str(store)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "MARK": str(mark)})
    if terminate:
        deadline = time.monotonic() + 120
        while not any(mark.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[0]
        if kind == "inline":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


@pytest.mark.parametrize("kind", ["inline", "process"])
def test_a_run_preempted_twice_by_sigterm_resumes_to_completion(tmp_path, kind):
    store, mark = tmp_path / "t.db", tmp_path / "marks"
    mark.mkdir()
    for _ in range(2):
        code, out = _run(kind, store, mark, terminate=True)
        assert code != 0
        lines = [line for line in out.splitlines() if line.strip()]
        assert len(lines) == 1 and "SIGTERM" in lines[0] and "interrupted" in lines[0], out
        assert "Traceback" not in out
        with td.store.Store(store, readonly=True) as db:
            trials = db.trials("steps")
            assert not any(t.status is td.TrialStatus.FAILED for t in trials), [t.error for t in trials]
            assert all(t.info.get("deaths", 0) == 0 for t in trials)
    code, out = _run(kind, store, mark, terminate=False)
    assert code == 0, out
    with td.store.Store(store, readonly=True) as db:
        trials = db.trials("steps")
        assert len(trials) == 8 and all(t.status is td.TrialStatus.COMPLETED for t in trials)
        assert sorted(t.metric for t in trials) == [float(x * 10 + 3) for x in range(8)]
