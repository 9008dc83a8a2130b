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


def _runs_on_a_small_tmpfs(tmp_path, args, before_each, *, size="6m", under=""):
    """Runs ``python -m tests.faults.fault_script ARGS DISK/t.db`` once per entry of
    ``before_each`` (a shell line run just before that run, ``{disk}`` and ``{mount}`` filled in),
    in a private mount namespace with a tmpfs of ``size`` at ``DISK/under``. Returns each run's
    (printed text, exit code) and the folder holding ``N.db``, the store after run N."""
    disk, out = tmp_path / "disk", tmp_path / "out"
    mount = disk / under
    mount.mkdir(parents=True)
    out.mkdir()
    run = f"{sys.executable} -m tests.faults.fault_script {args} {disk}/t.db"
    lines = [f"mount -t tmpfs -o size={size} tmpfs {mount} || exit 99"]
    for number, before in enumerate(before_each, 1):
        lines += [before.format(disk=disk, mount=mount),
                  f"{run} > {out}/{number}.txt 2>&1; echo $? > {out}/{number}.rc",
                  f"cp {disk}/t.db {out}/{number}.db"]
    subprocess.run(["unshare", "-rm", "sh", "-c", "\n".join(lines)], cwd=ROOT, check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "FILL": str(disk)})
    runs = [((out / f"{n}.txt").read_text(), int((out / f"{n}.rc").read_text())) for n in range(1, len(before_each) + 1)]
    return runs, out


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _mountable(),
                    reason="needs a private small tmpfs (unshare -rm and mount)")
@pytest.mark.parametrize("room", [0, 96 * 1024], ids=["metrics", "checkpoint"])
def test_a_full_disk_stops_the_run_with_one_line_and_the_trial_runs_again_once_there_is_space(tmp_path, room):
    """On a 6 MB tmpfs of its own: trial 1 fills the disk; the run stops saying "disk full";
    the filler is removed (space freed) and the next run completes every trial, trial 1 included."""
    [(first, first_rc), (second, second_rc)], out = _runs_on_a_small_tmpfs(
        tmp_path, f"fill-{room} inline", ["", "rm -f {disk}/filler"])
    assert first_rc != 0
    lines = [line for line in first.splitlines() if line.strip()]
    assert len(lines) == 1 and "disk full" in lines[0], first
    assert second_rc == 0, second
    with td.store.Store(out / "2.db", readonly=True) as db:
        trials = db.trials("fill")
    assert len(trials) == 4 and all(t.status is td.TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
    assert sorted(t.metric for t in trials) == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _mountable(),
                    reason="needs a private small tmpfs (unshare -rm and mount)")
def test_a_run_stopped_by_a_full_disk_again_and_again_charges_no_death(tmp_path):
    """The disk fills under trial 1 in two runs in a row, each time before the run can mark its
    trials interrupted: a stop on a storage fault is no crash of the trial's process, so the third
    run (space freed) still trains trial 1 and completes every trial."""
    runs, out = _runs_on_a_small_tmpfs(tmp_path, "fill-0 inline", [
        "", "rm -f {disk}/filler {disk}/filled",  # the disk fills again in the next run
        "rm -f {disk}/filler"])
    for text, rc in runs[:2]:
        assert rc != 0 and "disk full" in text, text
    assert runs[2][1] == 0, runs[2][0]
    with td.store.Store(out / "3.db", readonly=True) as db:
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
    [(first, first_rc), (second, second_rc)], out = _runs_on_a_small_tmpfs(
        tmp_path, f"oneshot-fill-0 {kind}", ["", "rm -f {disk}/filler"])
    assert first_rc != 0
    lines = [line for line in first.splitlines() if line.strip()]
    assert len(lines) == 1 and "disk full" in lines[0] and "Traceback" not in first, first
    assert second_rc == 0, second
    with td.store.Store(out / "2.db", readonly=True) as db:
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
    [(first, first_rc), (second, second_rc)], out = _runs_on_a_small_tmpfs(
        tmp_path, "pbt process", ["dd if=/dev/zero of={mount}/filler bs=64k 2>/dev/null", "rm -f {mount}/filler"],
        size="4m", under="t.db.ray")
    rounds = tmp_path / "disk" / "t.db.ray"
    lines = [line for line in first.splitlines() if line.strip()]
    assert first_rc != 0
    assert len(lines) == 1 and "disk full" in lines[0] and str(rounds) in lines[0], first
    with td.store.Store(out / "1.db", readonly=True) as db:
        assert not [t for t in db.trials("pbt") if t.status is td.TrialStatus.FAILED]
    assert second_rc == 0, second
    with td.store.Store(out / "2.db", readonly=True) as db:
        trials = db.trials("pbt")
    assert len(trials) == 4 and all(t.status is td.TrialStatus.COMPLETED for t in trials), [t.error for t in trials]
