"""Storage faults never fail a trial for good: a full disk under the store's metrics or a
checkpoint stops the run with one line saying "disk full", the trial runs again once there is
space; a store file deleted or replaced mid-run stops the run with one line."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tridens as td

ROOT = Path(__file__).resolve().parents[2]


def _removes_the_store(x, db, how):
    if x == 1:
        if how == "deleted":
            os.remove(db)
        else:
            shutil.copy(db, db + ".copy")
            os.replace(db + ".copy", db)
    td.report({"value": float(x)}, step=0)
    return float(x)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_store_deleted_or_replaced_mid_run_stops_the_run_with_one_line(tmp_path, how):
    db = tmp_path / "t.db"
    evaluator = td.evaluators.FunctionalEvaluator(_removes_the_store, x=td.choice("x", [0, 1, 2, 3]), db=str(db), how=how)
    exp = td.Experiment(None, evaluator, td.strategy.GridSearch(), budget=4, store=str(db), name="gone",
                        options=td.RunOptions(verbose=False))
    with pytest.raises(td.store.StorageFault, match=how) as info:
        exp.run()
    assert "\n" not in str(info.value) and str(db) in str(info.value)


def _mountable():
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _mountable(),
                    reason="needs a private small tmpfs (unshare -rm and mount)")
@pytest.mark.parametrize("room", [0, 96 * 1024], ids=["metrics", "checkpoint"])
def test_a_full_disk_stops_the_run_with_one_line_and_the_trial_runs_again_once_there_is_space(tmp_path, room):
    """On a 6 MB tmpfs of its own: trial 1 fills the disk; the run stops saying "disk full";
    the filler is removed (space freed) and the next run completes every trial, trial 1 included."""
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    run = f"{sys.executable} -m tests.faults.fault_script fill-{room} inline {disk}/t.db"
    script = (f"mount -t tmpfs -o size=6m tmpfs {disk} || exit 99\n"
              f"{run} > {out}/first.txt 2>&1; echo $? > {out}/first.rc\n"
              f"rm -f {disk}/filler\n"
              f"{run} > {out}/second.txt 2>&1; echo $? > {out}/second.rc\n"
              f"cp {disk}/t.db {out}/t.db\n")
    subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "FILL": str(disk)})
    first = (out / "first.txt").read_text()
    assert (out / "first.rc").read_text().strip() != "0"
    lines = [line for line in first.splitlines() if line.strip()]
    assert len(lines) == 1 and "disk full" in lines[0], first
    assert (out / "second.rc").read_text().strip() == "0", (out / "second.txt").read_text()
    with td.store.Store(out / "t.db", readonly=True) as db:
        trials = db.trials("fill")
    assert len(trials) == 4 and all(t.status is td.TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
    assert sorted(t.metric for t in trials) == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _mountable(),
                    reason="needs a private small tmpfs (unshare -rm and mount)")
def test_a_run_stopped_by_a_full_disk_again_and_again_charges_no_death(tmp_path):
    """The disk fills under trial 1 in two runs in a row, each time before the run can mark its
    trials interrupted: a stop on a storage fault is no crash of the trial's process, so the third
    run (space freed) still trains trial 1 and completes every trial."""
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    run = f"{sys.executable} -m tests.faults.fault_script fill-0 inline {disk}/t.db"
    script = (f"mount -t tmpfs -o size=6m tmpfs {disk} || exit 99\n"
              f"{run} > {out}/1.txt 2>&1; echo $? > {out}/1.rc\n"
              f"rm -f {disk}/filler {disk}/filled\n"          # the disk fills again in the next run
              f"{run} > {out}/2.txt 2>&1; echo $? > {out}/2.rc\n"
              f"rm -f {disk}/filler\n"
              f"{run} > {out}/3.txt 2>&1; echo $? > {out}/3.rc\n"
              f"cp {disk}/t.db {out}/t.db\n")
    subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "FILL": str(disk)})
    for stopped in ("1", "2"):
        text = (out / f"{stopped}.txt").read_text()
        assert (out / f"{stopped}.rc").read_text().strip() != "0" and "disk full" in text, text
    assert (out / "3.rc").read_text().strip() == "0", (out / "3.txt").read_text()
    with td.store.Store(out / "t.db", readonly=True) as db:
        trials = db.trials("fill")
    assert len(trials) == 4 and all(t.status is td.TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
    assert all(not t.info.get("deaths") for t in trials), [t.info.get("deaths") for t in trials]


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _mountable(),
                    reason="needs a private small tmpfs (unshare -rm and mount)")
@pytest.mark.parametrize("kind", ["inline", "process"])
def test_a_full_disk_stops_a_one_shot_run_with_one_line_and_the_next_run_finishes_it(tmp_path, kind):
    """On a 6 MB tmpfs of its own: the disk fills after the supernet's first epoch; the run stops
    saying "disk full" in one line (no traceback); once there is space the next run finishes the
    same supernet and scores its subnets."""
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    run = f"{sys.executable} -m tests.faults.fault_script oneshot-fill-0 {kind} {disk}/t.db"
    script = (f"mount -t tmpfs -o size=6m tmpfs {disk} || exit 99\n"
              f"{run} > {out}/first.txt 2>&1; echo $? > {out}/first.rc\n"
              f"rm -f {disk}/filler\n"
              f"{run} > {out}/second.txt 2>&1; echo $? > {out}/second.rc\n"
              f"cp {disk}/t.db {out}/t.db\n")
    subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "FILL": str(disk)})
    first = (out / "first.txt").read_text()
    assert (out / "first.rc").read_text().strip() != "0"
    lines = [line for line in first.splitlines() if line.strip()]
    assert len(lines) == 1 and "disk full" in lines[0] and "Traceback" not in first, first
    assert (out / "second.rc").read_text().strip() == "0", (out / "second.txt").read_text()
    with td.store.Store(out / "t.db", readonly=True) as db:
        trials = db.trials("oneshot")
    roles = [t.info["oneshot"]["role"] for t in trials]
    assert roles == ["supernet", "subnet", "subnet"], roles  # the same supernet, finished by the second run
    assert all(t.status is td.TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
    assert len(trials[0].metrics["train_loss"]) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _mountable(),
                    reason="needs a private small tmpfs (unshare -rm and mount)")
def test_a_full_disk_under_the_pool_members_rounds_stops_the_run_and_fails_no_member(tmp_path):
    """PBT on the process pool keeps each member's state per round in the run's storage (beside
    the store, ``t.db.ray``), here a full 4 MB tmpfs: the run stops with one line saying "disk
    full", no member failed; with space the next run completes the population."""
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    rounds = disk / "t.db.ray"
    rounds.mkdir()
    run = f"{sys.executable} -m tests.faults.fault_script pbt process {disk}/t.db"
    script = (f"mount -t tmpfs -o size=4m tmpfs {rounds} || exit 99\n"
              f"dd if=/dev/zero of={rounds}/filler bs=64k 2>/dev/null\n"
              f"{run} > {out}/1.txt 2>&1; echo $? > {out}/1.rc\n"
              f"cp {disk}/t.db {out}/first.db\n"
              f"rm -f {rounds}/filler\n"
              f"{run} > {out}/2.txt 2>&1; echo $? > {out}/2.rc\n"
              f"cp {disk}/t.db {out}/t.db\n")
    subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    first = (out / "1.txt").read_text()
    lines = [line for line in first.splitlines() if line.strip()]
    assert (out / "1.rc").read_text().strip() != "0"
    assert len(lines) == 1 and "disk full" in lines[0] and str(rounds) in lines[0], first
    with td.store.Store(out / "first.db", readonly=True) as db:
        assert not [t for t in db.trials("pbt") if t.status is td.TrialStatus.FAILED]
    assert (out / "2.rc").read_text().strip() == "0", (out / "2.txt").read_text()
    with td.store.Store(out / "t.db", readonly=True) as db:
        trials = db.trials("pbt")
    assert len(trials) == 4 and all(t.status is td.TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
