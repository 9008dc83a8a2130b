"""The store under bad conditions: corrupt, locked, read-only, missing directory, a writer killed
with SIGKILL, readers while a writer writes. Real files and real processes throughout."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from tridens.errors import StoreError
from tridens.store import Store
from tridens.trial import Trial, TrialStatus

WRITER = str(Path(__file__).with_name("_store_writer.py"))


def one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def make_store(path: Path, n: int = 3) -> None:
    with Store(path) as s:
        s.create_experiment("e")
        for i in range(n):
            s.add_trial("e", Trial(id=-1, sample={"pad": "x" * 300, "i": i}, seed=i))


# -- corrupt, missing directory ---------------------------------------------------------------------

def test_garbage_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes, not a database\n" * 200)
    with pytest.raises(StoreError) as err:
        Store(path)
    msg = one_line(err)
    assert msg.startswith(f"{path} is not a tridens store or is corrupt") and "file is not a database" in msg
    assert path.read_bytes().startswith(b"these are my notes")


def test_damaged_pages_raise_store_error_naming_the_file(tmp_path):
    path = tmp_path / "t.db"
    make_store(path, n=200)
    data = bytearray(path.read_bytes())
    data[4096 * 2:] = b"\x5a" * (len(data) - 4096 * 2)  # keep the header and first pages, wreck the rest
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError) as err:
        s = Store(path)
        s.trials("e")
    msg = one_line(err)
    assert str(path) in msg and "corrupt" in msg


def test_missing_directory(tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "t.db"
    with pytest.raises(StoreError) as err:
        Store(path)
    assert one_line(err) == (f"cannot open the store {path}: its directory {path.parent} does not exist; "
                             f"create it first or pass another path")
    assert not path.parent.exists()


# -- locks ------------------------------------------------------------------------------------------

LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE experiments SET status = 'held'")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


def test_locked_by_another_process_times_out_then_recovers(tmp_path):
    path = tmp_path / "t.db"
    make_store(path)
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout.readline().strip() == "locked"
        s = Store(path, timeout=0.2)  # opening and reading never wait for a writer (WAL)
        assert len(s.trials("e")) == 3 and s.get_experiment("e").status == "created"
        with pytest.raises(StoreError) as err:
            s.add_trial("e", Trial(id=-1, sample={}, seed=0))
        assert one_line(err).startswith(f"the store {path} is locked by another process or connection "
                                        f"(waited 0.2 s while adding a trial to experiment 'e')")
        with pytest.raises(StoreError, match="is locked"):
            with s.transaction():
                pass
    finally:
        locker.stdin.close()
        locker.wait(timeout=30)
    assert s.add_trial("e", Trial(id=-1, sample={}, seed=0)).id == 4
    s.close()


def test_locked_by_another_connection(tmp_path):
    path = tmp_path / "t.db"
    make_store(path)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    with Store(path, timeout=0) as s:
        with pytest.raises(StoreError, match=r"is locked .*waited 0 s while adding metrics of trial 1"):
            s.add_metrics(1, 0, {"a": 1.0, "b": 2.0})
        other.execute("ROLLBACK")
        s.add_metrics(1, 0, {"a": 1.0, "b": 2.0})
        assert s.trial(1).metrics == {"a": [1.0], "b": [2.0]}
    other.close()


# -- read-only directory ----------------------------------------------------------------------------

@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """Make a directory or file unwritable for this process: chmod as a user; as root (which ignores
    modes) the immutable attribute via chattr, or skip where the file system has none."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("running as root without chattr: cannot make a read-only directory")
    done = subprocess.run([chattr, "+i", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"running as root and chattr +i failed here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)


def test_store_in_read_only_directory(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "t.db"
    make_store(path)
    with read_only(directory):
        assert not os.access(directory, os.W_OK)
        for target in (path, directory / "new.db"):
            with pytest.raises(StoreError) as err:
                Store(target)
            assert one_line(err).startswith(f"cannot write the store {target}: its directory {directory} is read-only")
        with Store(path, readonly=True) as ro:  # reading still works
            assert [t.seed for t in ro.trials("e")] == [0, 1, 2]
    assert sorted(p.name for p in directory.iterdir()) == ["t.db"]


# -- a writer killed mid-run, readers during writes ---------------------------------------------------

def start_writer(path: Path, n: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, WRITER, str(path), str(n)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_kill_9_mid_run_keeps_every_committed_trial(tmp_path):
    path = tmp_path / "crash.db"
    proc = start_writer(path, -1)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    done: dict[int, int] = {}
    try:
        for line in proc.stdout:
            _, tid, i = line.split()
            done[int(tid)] = int(i)
            if len(done) == 40:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # while it is writing the next trials
        proc.wait(timeout=30)
    for line in proc.stdout:  # lines it printed before dying were committed too
        _, tid, i = line.split()
        done[int(tid)] = int(i)
    proc.stdout.close()
    proc.stdin.close()
    assert proc.returncode == -signal.SIGKILL and len(done) >= 40

    with Store(path) as s:
        assert s._connection().execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        trials = {t.id: t for t in s.trials("run")}
        for tid, i in done.items():
            t = trials[tid]
            assert t.status is TrialStatus.COMPLETED and t.metric == float(i) and t.sample["i"] == i
            assert t.metrics == {"acc": [i, i + 0.1, i + 0.2], "loss": [float(i)] * 3}
            state = s.load_checkpoint(t.checkpoint)
            assert state["i"] == i and state["w"].shape == (256,) and float(state["w"][0]) == i
        unfinished = [t for t in trials.values() if t.id not in done]
        assert len(unfinished) <= 2  # the trial in flight (and one committed after the last line read)
        assert all(t.status in (TrialStatus.RUNNING, TrialStatus.PENDING, TrialStatus.COMPLETED) for t in unfinished)
        # checkpoint files are whole or absent: at most one temp file of the interrupted save
        files = list((tmp_path / "crash.db.files" / "run").iterdir())
        assert len([f for f in files if f.name.endswith(".tmp")]) <= 1
        for f in files:
            if not f.name.endswith(".tmp"):
                assert s.load_checkpoint(f)["w"].shape == (256,)
        # and the store keeps working after the crash
        s.add_trial("run", Trial(id=-1, sample={"i": -1}, seed=0))


def test_concurrent_readers_while_a_writer_writes(tmp_path):
    path = tmp_path / "wal.db"
    n = 100
    proc = start_writer(path, n)
    errors: list[BaseException] = []
    seen: list[set[int]] = [set(), set()]
    stop = threading.Event()

    def read(k: int) -> None:
        try:
            with Store(path, timeout=30) as s:
                last = 0
                while True:
                    finished = stop.is_set()
                    trials = s.trials("run")
                    assert len(trials) >= last
                    last = len(trials)
                    seen[k].add(last)
                    for t in trials:  # a snapshot is consistent: completed means metrics and checkpoint
                        if t.status is TrialStatus.COMPLETED:
                            assert len(t.metrics["acc"]) == 3 and t.checkpoint is not None
                    if finished:
                        return
                    time.sleep(0.005)  # leave the two cores to the writer now and then
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    readers = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for r in readers:
        r.start()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    lines = proc.stdout.read().split("\n")
    assert proc.wait(timeout=60) == 0
    stop.set()
    for r in readers:
        r.join(timeout=60)
    proc.stdin.close()
    proc.stdout.close()
    assert not errors, errors
    assert len([x for x in lines if x.startswith("done")]) == n
    assert all(max(s) == n for s in seen)
    assert any(len(s) > 2 for s in seen)  # the readers did read while the writer wrote


def test_read_only_store_file(tmp_path):
    path = tmp_path / "t.db"
    make_store(path)
    with read_only(path):
        with pytest.raises(StoreError) as err:
            Store(path)
        assert one_line(err).startswith(f"cannot write the store {path}: the file is read-only")
        with Store(path, readonly=True) as ro:
            assert len(ro.trials("e")) == 3
