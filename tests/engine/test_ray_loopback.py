"""The local Ray that the Ray executor starts (``td.executors.Ray(address=None)``) listens on
127.0.0.1 only: during a real run every socket that the driver and its descendants (GCS, raylet
and object manager, runtime-env agent, the hub actor, the workers) listen on is a loopback one."""

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listening(proc: psutil.Process) -> list[tuple[str, int]]:
    try:
        return sorted({(c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet")
                       if c.status == psutil.CONN_LISTEN})
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def test_a_run_on_the_local_ray_listens_on_loopback_only(tmp_path):
    store = tmp_path / "hang.db"
    driver = subprocess.Popen([sys.executable, "-m", "tests.engine.executor_script", "ray", str(store), "hang"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        reported = 0
        while reported < 2 and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.2)
            try:
                with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=30) as conn:
                    reported = conn.execute("SELECT COUNT(*) FROM metrics WHERE name = 'pid'").fetchone()[0]
            except sqlite3.OperationalError:  # the store is not created yet
                pass
        assert reported == 2, driver.stdout.read() if driver.poll() is not None else "no trial reported in time"
        root = psutil.Process(driver.pid)
        tree = [root, *root.children(recursive=True)]
        sockets = {f"{p.pid} {p.name()} {' '.join(p.cmdline())[:200]}": listening(p) for p in tree}
        names = " ".join(sockets)
        for part in ("gcs_server", "raylet", "RuntimeEnvAgent", "HubActor", "run_trial"):  # the processes a run has
            assert part in names, names
        assert sum(len(s) for s in sockets.values()) >= 6, sockets
        outside = {p: [a for a in s if a[0] not in LOOPBACK] for p, s in sockets.items()}
        assert not any(outside.values()), outside
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        for proc in tree[1:]:  # the Ray processes this test's driver started
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_verbose_run_says_it_starts_a_local_ray_before_any_trial_reports(tmp_path):
    """Ray is quiet for seconds while its processes start: a verbose run says so on stderr first,
    then how long the start took, and the run finishes."""
    store = tmp_path / "slow.db"
    run = subprocess.run([sys.executable, "-m", "tests.engine.executor_script", "ray", str(store), "slow", "verbose"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if line.startswith("tridens: ")]
    assert said[:2] == ["tridens: starting a local Ray for 2 worker(s) on 127.0.0.1 (its processes take seconds "
                        "to start)", said[1]], said
    started = said[1]
    assert started.startswith("tridens: local Ray started in ") and started.endswith(" s; starting its workers")
    float(started[len("tridens: local Ray started in "):-len(" s; starting its workers")])  # a duration
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT COUNT(*) FROM trials WHERE status = 'completed'").fetchone()[0] == 6
