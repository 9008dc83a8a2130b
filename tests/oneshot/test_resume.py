"""A one-shot run killed with SIGKILL resumes from its last supernet checkpoint; Ctrl-C stops it
with one line, as a multi-trial run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tridens.store import Store
from tridens.trial import TrialStatus

SCRIPT = Path(__file__).with_name("resume_script.py")
EPOCHS = 5


def _supernet(db):
    with Store(db, readonly=True) as store:
        trials = store.trials("resume")
    return next((t for t in trials if t.info.get("oneshot", {}).get("role") == "supernet"), None), trials


def _run(db, **kwargs):
    return subprocess.run([sys.executable, str(SCRIPT), str(db), str(EPOCHS)], capture_output=True, text=True,
                          timeout=300, **kwargs)


def _kill_and_resume(tmp_path):
    db = tmp_path / "killed.db"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(db), str(EPOCHS)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    done_before = 0
    try:
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
            if not db.exists():
                continue
            try:
                supernet, _ = _supernet(db)
            except Exception:
                continue
            checkpoint = db.parent / (db.name + ".files") / "resume" / f"trial-{supernet.number}-supernet.pt" if supernet else None
            if supernet and checkpoint.exists() and len(supernet.metrics.get("train_loss", [])) >= 2:
                done_before = len(supernet.metrics["train_loss"])
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert 2 <= done_before < EPOCHS, "the run was not killed in the middle of supernet training"
    supernet, _ = _supernet(db)
    assert supernet.status is TrialStatus.RUNNING
    losses_before = supernet.metrics["train_loss"][:done_before]

    res = _run(db)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resuming the supernet at epoch" in res.stdout
    # its last line says why it stopped, as a multi-trial run's does
    assert res.stderr.rstrip().splitlines()[-1] == (
        f"[resume] stopped: ENAS is done: the supernet trained {EPOCHS} epochs, 4 subnets scored with its weights, "
        "1 retrained from scratch")
    resumed_at = int(res.stdout.split("resuming the supernet at epoch")[1].split()[0])
    assert resumed_at >= done_before - 1  # at most the epoch in flight at the kill is trained again
    supernet, trials = _supernet(db)
    assert supernet.status is TrialStatus.COMPLETED
    assert supernet.metrics["train_loss"][:done_before] == losses_before  # finished epochs were not retrained
    roles = [t.info["oneshot"]["role"] for t in trials]
    assert roles.count("subnet") == 4 and roles.count("retrain") == 1 and len(roles) == 6
    retrained = next(t for t in trials if t.info["oneshot"]["role"] == "retrain")
    assert retrained.status is TrialStatus.COMPLETED and len(retrained.metrics["val_acc"]) == 1
    with Store(db, readonly=True) as store:
        assert store.get_experiment("resume").status == "done"

    return db, supernet, trials


def test_killed_one_shot_run_resumes_from_the_last_supernet_checkpoint(tmp_path):
    db, _, trials = _kill_and_resume(tmp_path)
    # running it once more changes nothing: everything is already in the store
    again = _run(db)
    assert again.returncode == 0
    _, after = _supernet(db)
    assert [(t.id, t.metric) for t in after] == [(t.id, t.metric) for t in trials]


@pytest.mark.slow
def test_a_resumed_run_trains_what_an_uninterrupted_one_does(tmp_path):
    _, supernet, trials = _kill_and_resume(tmp_path)
    clean = tmp_path / "clean.db"
    assert _run(clean).returncode == 0
    reference, ref_trials = _supernet(clean)
    assert reference.metrics["train_loss"] == supernet.metrics["train_loss"]
    assert reference.info["oneshot"]["greedy"] == supernet.info["oneshot"]["greedy"]
    assert reference.info["oneshot"]["baseline"] == supernet.info["oneshot"]["baseline"]
    best = lambda ts: max((t for t in ts if t.info["oneshot"]["role"] == "subnet"), key=lambda t: (t.metric, -t.id))
    assert best(ref_trials).sample == best(trials).sample and best(ref_trials).metric == best(trials).metric


def test_ctrl_c_stops_a_one_shot_run_with_one_line_and_keeps_the_supernet(tmp_path):
    db = tmp_path / "ctrl-c.db"
    # a terminal's SIGINT: a suite run in the background (nohup, CI job) would pass SIGINT on ignored
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(db), "100"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 240
    epochs = 0
    while time.time() < deadline and proc.poll() is None and epochs < 1:
        time.sleep(0.2)
        try:
            supernet, _ = _supernet(db)
        except Exception:  # not created yet
            continue
        epochs = len(supernet.metrics.get("train_loss", [])) if supernet else 0
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert epochs >= 1, err[-2000:]
    assert proc.returncode == 1 and "Traceback" not in err, err[-2000:]
    [line] = [line for line in err.splitlines() if "interrupted" in line]
    assert line.startswith("tridens: 'resume' interrupted with 0 finished trials kept in ")
    assert f"finish it with: tridens resume resume --db {db} --script {SCRIPT}" in line
    supernet, _ = _supernet(db)
    assert supernet.status is TrialStatus.INTERRUPTED and len(supernet.metrics["train_loss"]) >= epochs
    with Store(db, readonly=True) as store:
        assert store.get_experiment("resume").status == "interrupted"
