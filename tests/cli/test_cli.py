import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tridens.cli import main
from tridens.store import Store
from tridens.trial import TrialStatus

HERE = Path(__file__).parent
SCRIPT = HERE / "search_script.py"
TRIDENS = [sys.executable, "-m", "tridens.cli"]


def tridens(*args, cwd=None, check=True, timeout=300):
    proc = subprocess.run([*TRIDENS, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"tridens {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def tridens_here(capsys):
    """``tridens_here(*args)``: a ``tridens`` command run in this process, for tests about what it
    prints; its exit code, stdout and stderr as a CompletedProcess."""
    def run(*args, check=True):
        argv = [*map(str, args)]
        code = main(argv)
        out = capsys.readouterr()
        if check and code != 0:
            raise AssertionError(f"tridens {' '.join(argv)} exited {code}:\n{out.out}\n{out.err}")
        return subprocess.CompletedProcess(argv, code, out.out, out.err)
    return run


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One finished search, run once through `tridens run`; tests that change it work on a copy."""
    db = tmp_path_factory.mktemp("searched") / "runs.db"
    out = tridens("run", SCRIPT, "--db", db)
    assert "best" in out.stdout
    return db


def _copy_store(db, target_dir):
    import shutil

    target = target_dir / db.name
    shutil.copy(db, target)
    if Path(str(db) + ".files").exists():
        shutil.copytree(str(db) + ".files", str(target) + ".files")
    return target


def _counted(trials):
    return [t for t in trials if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED, TrialStatus.FAILED)]


def test_run_ls_show_top_export(tmp_path, searched, tridens_here):
    db = searched
    assert "cli-search" in tridens_here("ls", "--db", db).stdout
    show = tridens_here("show", "cli-search", "--db", db).stdout
    assert "completed" in show and "hidden" in show
    top = tridens_here("top", "cli-search", "-k", "3", "--db", db).stdout
    assert "top 3" in top
    target = tmp_path / "export"
    tridens_here("export", "cli-search", "--top", "2", "--to", target, "--db", db, "--trust-code")  # our own script
    exported = sorted(p.name for p in target.iterdir())
    assert len(exported) == 2 and all((target / p / "weights.pt").exists() for p in exported)
    # the exported model loads in a fresh interpreter that never saw the script
    code = (f"import tridens as td, torch; m = td.load({str(target / exported[0])!r}, prefer='program'); "
            "print(m(torch.zeros(3, 1, 8, 8)).shape)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "torch.Size([3, 10])" in res.stdout, res.stderr


def test_reading_a_store_does_not_import_torch(searched):
    """ls, show and top answer from the store alone: importing PyTorch would take them 1.5 s."""
    code = ("import sys; from tridens.cli import main\n"
            "for args in (['ls'], ['show', 'cli-search'], ['top', 'cli-search'], ['show', 'cli-search', '0']):\n"
            f"    assert main([*args, '--db', {str(searched)!r}]) == 0\n"
            "print('torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "False"


def test_kill_then_resume_completes_the_budget_without_retraining(tmp_path):
    db = tmp_path / "crash.db"
    env = {**os.environ, "TRIDENS_DB": str(db)}
    proc = subprocess.Popen([*TRIDENS, "run", str(SCRIPT), "--db", str(db), "0.4"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    before = []
    while time.time() < deadline:
        time.sleep(0.3)
        if db.exists():
            try:
                with Store(db, readonly=True) as store:
                    before = [t for t in store.trials("cli-search") if t.status is TrialStatus.COMPLETED]
            except Exception:
                continue
            if len(before) >= 2:
                break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(before) >= 2, "the run never finished two trials"
    with Store(db, readonly=True) as store:
        snapshot = {t.id: (t.finished_at, t.metrics) for t in store.trials("cli-search") if t.status is TrialStatus.COMPLETED}
    tridens("resume", "cli-search", "--db", db, "--script", SCRIPT)  # confirms the recorded script is ours
    with Store(db, readonly=True) as store:
        trials = store.trials("cli-search")
        record = store.get_experiment("cli-search")
    assert record.status == "done"
    assert len(_counted(trials)) == 6
    for t in trials:
        if t.id in snapshot:  # finished before the kill: kept as they were, not retrained
            assert (t.finished_at, t.metrics) == snapshot[t.id]
    assert all(t.status.finished for t in trials)
    trained = [t for t in trials if t.status is TrialStatus.COMPLETED]
    keys = [(t.fingerprint, t.sample["lr"]) for t in trained]
    assert len(keys) == len(set(keys)), "a model was trained twice"


def test_script_without_experiment(tmp_path):
    script = tmp_path / "nothing.py"
    script.write_text("print('hello')\n")
    res = tridens("run", script, "--db", tmp_path / "x.db", check=False)
    assert res.returncode != 0
    assert res.stderr.strip().count("\n") == 0 and "started no experiment" in res.stderr


def test_unknown_strategy(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(SCRIPT.read_text().replace("td.strategy.Random()", "'evolutoin'"))
    db = tmp_path / "x.db"
    res = tridens("run", script, "--db", db, check=False)
    assert res.returncode != 0 and "'evolutoin'" in res.stderr and "regularized-evolution" in res.stderr
    assert res.stderr.strip().count("\n") == 0


def test_evaluator_that_reports_nothing(tmp_path):
    script = tmp_path / "silent.py"
    source = SCRIPT.read_text().replace("td.report(acc, step=epoch)", "pass").replace("budget=6", "budget=2")
    script.write_text(source)
    res = tridens("run", script, "--db", tmp_path / "x.db", check=False)
    assert res.returncode != 0 and "reported nothing" in res.stderr
    with Store(tmp_path / "x.db", readonly=True) as store:  # the failures themselves are stored
        assert all(t.status is TrialStatus.FAILED for t in store.trials("cli-search"))


def test_unknown_experiment_and_missing_store(tmp_path, searched, tridens_here):
    db = searched
    res = tridens_here("show", "nope", "--db", db, check=False)
    assert res.returncode != 0 and "'nope'" in res.stderr and "cli-search" in res.stderr
    res = tridens_here("ls", "--db", tmp_path / "absent.db", check=False)
    assert res.returncode != 0 and "absent.db" in res.stderr


def test_newer_schema_and_locked_database_keep_data(tmp_path, searched, tridens_here):
    db = _copy_store(searched, tmp_path)
    with Store(db, readonly=True) as store:
        n = len(store.trials("cli-search"))
    # locked: another connection holds the write lock
    holder = sqlite3.connect(db)
    holder.execute("BEGIN IMMEDIATE")
    res = subprocess.run([*TRIDENS, "run", str(SCRIPT), "--db", str(db)], capture_output=True, text=True, timeout=300)
    holder.rollback()
    holder.close()
    assert res.returncode != 0 and "runs.db" in res.stderr and "lock" in res.stderr.lower()
    # newer schema: refuse, name the file, touch nothing
    conn = sqlite3.connect(db)
    conn.execute("UPDATE schema_version SET version = version + 10") if _has_table(conn, "schema_version") else None
    conn.commit()
    conn.close()
    res = tridens_here("ls", "--db", db, check=False)
    assert res.returncode != 0 and "runs.db" in res.stderr and "newer" in res.stderr.lower()
    conn = sqlite3.connect(db)
    conn.execute("UPDATE schema_version SET version = version - 10")
    conn.commit()
    conn.close()
    with Store(db, readonly=True) as store:
        assert len(store.trials("cli-search")) == n


def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode != 0:
        os.chmod(ro, 0o555)
        if os.access(ro, os.W_OK):
            pytest.skip("cannot make a read-only directory here")
    try:
        res = tridens("run", SCRIPT, "--db", ro / "runs.db", check=False)
        assert res.returncode != 0 and "runs.db" in res.stderr
        assert res.stderr.strip().count("\n") == 0
    finally:
        subprocess.run(["chattr", "-i", str(ro)], capture_output=True)
        os.chmod(ro, 0o755)


def _has_table(conn, name):
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone() is not None


def test_show_and_ls_print_stored_text_verbatim(tmp_path, tridens_here):
    """Stored reprs are not rich markup: ``digits:train:`` stays text (not a train emoji), ``[/x]``
    is printed, not rejected as a closing tag."""
    db = tmp_path / "runs.db"
    evaluator = "Classification(train=ImageDataset('digits:train:val_fraction=0.2'), lr=Choice('lr', [0.1]))"
    with Store(db) as store:
        store.create_experiment("odd-name", {"evaluator": {"type": "Classification", "repr": evaluator},
                                                  "strategy": {"type": "Random", "repr": "Random([/x] :smile:)"},
                                                  "objective": {"metric": "val_acc", "mode": "max"}})
    show = tridens_here("show", "odd-name", "--db", db).stdout
    flat = "".join(show.split())  # rich wraps long lines
    assert "digits:train:val_fraction" in flat and "\U0001f68b" not in show
    assert "Random([/x]:smile:)" in flat and "odd-name" in tridens_here("ls", "--db", db).stdout
