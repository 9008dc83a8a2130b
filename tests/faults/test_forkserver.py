"""The process that starts pool workers (multiprocessing's forkserver) killed with SIGKILL: a run
starts a new one and finishes every trial; killed again each time, the run stops with one line,
finished trials kept, and the next run completes the rest. Real subprocesses, real kills."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tridens as td

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the forkserver's pid")


def _forkservers(driver: int) -> list[int]:
    """The driver's child processes that are multiprocessing's forkserver."""
    found = []
    for task in Path(f"/proc/{driver}/task").glob("*/children"):
        for pid in task.read_text().split():
            try:
                if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def _run(store, mark, kill, scenario="steps"):
    """One run of the 8-trial search on two pool workers; ``kill(driver, proc)`` runs beside it."""
    for f in mark.iterdir():
        f.unlink()
    proc = subprocess.Popen([sys.executable, "-m", "tests.faults.fault_script", scenario, "process", str(store)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "MARK": str(mark)})
    killed: list[int] = []
    killer = threading.Thread(target=kill, args=(proc, killed), daemon=True) if kill else None
    if killer:
        killer.start()
    out, _ = proc.communicate(timeout=300)
    if killer:
        killer.join(10)
    return proc.returncode, out, killed


def _every_forkserver(proc, killed):
    """SIGKILL every forkserver the driver starts, as soon as it is seen, until the driver ends."""
    while proc.poll() is None:
        for pid in _forkservers(proc.pid):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.01)


def _once_while_training(mark):
    def kill(proc, killed):
        """SIGKILL the forkserver once a trial has trained a step on a worker it started."""
        while proc.poll() is None and not any(mark.iterdir()):
            time.sleep(0.05)
        for pid in _forkservers(proc.pid):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return kill


def _runs(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not: once its forkserver died, nobody
    but init may reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _trials(store):
    with td.store.Store(store, readonly=True) as db:
        return db.trials("steps")


def test_a_forkserver_killed_at_every_start_stops_the_run_with_one_line_and_the_next_run_completes(tmp_path):
    store, mark = tmp_path / "t.db", tmp_path / "marks"
    mark.mkdir()
    code, out, killed = _run(store, mark, _every_forkserver)
    assert killed and code != 0
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("tridens: error:")]
    assert len(errors) == 1 and "forkserver" in errors[0] and "run again on the next run" in errors[0], out
    assert not any(t.status is td.TrialStatus.FAILED for t in _trials(store))
    code, out, _ = _run(store, mark, None)
    assert code == 0, out
    trials = _trials(store)
    assert len(trials) == 8 and all(t.status is td.TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
    assert sorted(t.metric for t in trials) == [float(x * 10 + 3) for x in range(8)]


def test_a_forkserver_killed_while_its_workers_train_costs_no_trial(tmp_path):
    store, mark = tmp_path / "t.db", tmp_path / "marks"
    mark.mkdir()
    code, out, killed = _run(store, mark, _once_while_training(mark))
    assert killed and code == 0, out
    assert "Traceback" not in out, out
    trials = _trials(store)
    assert len(trials) == 8 and all(t.status is td.TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
    assert sorted(t.metric for t in trials) == [float(x * 10 + 3) for x in range(8)]


def test_a_hung_trial_on_a_worker_whose_forkserver_died_is_killed_at_its_timeout(tmp_path):
    """The forkserver dies while trial x=0 hangs on its worker: at trial_timeout that worker is
    killed (while the run goes on), the trial fails alone with the timeout line, the others
    complete, and the run ends."""
    store, mark = tmp_path / "t.db", tmp_path / "marks"
    mark.mkdir()
    hung: dict[str, object] = {}

    def kill(proc, killed):
        while proc.poll() is None and not any(f.name.startswith("0-0-") for f in mark.iterdir()):
            time.sleep(0.05)
        if proc.poll() is not None:
            return
        pid = int(next(f for f in mark.iterdir() if f.name.startswith("0-0-")).name.split("-")[2])
        for server in _forkservers(proc.pid):
            os.kill(server, signal.SIGKILL)
            killed.append(server)
        while proc.poll() is None and _runs(pid):
            time.sleep(0.05)
        hung.update(pid=pid, gone_while_running=proc.poll() is None)

    code, out, killed = _run(store, mark, kill, scenario="hangs")
    assert killed and code == 0, out
    assert "Traceback" not in out, out
    assert hung.get("gone_while_running") is True, (hung, out)   # killed at its timeout, not when the run ended
    with td.store.Store(store, readonly=True) as db:
        trials = {t.sample["x"]: t for t in db.trials("hangs")}
    assert trials[0].status is td.TrialStatus.FAILED and "exceeded trial_timeout=4" in trials[0].error, trials[0].error
    assert len(trials[0].error.strip().splitlines()) == 1
    assert all(trials[x].status is td.TrialStatus.COMPLETED for x in (1, 2, 3)), [t.error for t in trials.values()]
