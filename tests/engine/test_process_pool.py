"""The process pool (``executor=td.executors.Process(workers=2)``): long-lived workers, real subprocesses, real kills.

Each user loop reports ``os.getpid()`` so the tests see which worker ran which trial.
"""

import math
import os
import signal
import time

import torch

import tridens as td
from tridens.engine import Experiment
from tridens.store import Store
from tridens.trial import TrialStatus

from .spaces import TinyMLP

# -- user loops (module level: the workers import them) ------------------------------------------


def report_pid(model, x):
    for step in range(2):
        td.report({"value": x + step, "pid": os.getpid()}, step=step)


def misbehave(model, x):
    """x=1 kills its own process, x=2 raises, x=3 returns NaN, x=4 hangs; others report their pid."""
    td.report({"value": 0.0, "pid": os.getpid()}, step=0)
    if x == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if x == 2:
        raise RuntimeError("boom: x=2")
    if x == 3:
        return math.nan
    if x == 4:
        time.sleep(120)
    return float(x)


def report_environment(model, x):
    """The driver's TRIDENS_TEST_MARK as the worker sees it, and whether torch was imported before
    this worker started (forked from the forkserver that preloaded it)."""
    import sys

    preloaded = "torch._dynamo" in sys.modules
    td.report({"value": float(os.environ.get("TRIDENS_TEST_MARK", "-1")), "pid": os.getpid(),
               "preloaded": float(preloaded)}, step=0)


def set_weights(model, x):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(x / 10)
    td.report({"value": x, "pid": os.getpid()}, step=0)


def report_until_stopped(model, lr):
    for step in range(4):
        td.report({"value": lr * (step + 1), "pid": os.getpid()}, step=step)


class StopOddLrAtStep1(td.strategy.GridSearch):
    """A user strategy: stops the trials with lr 0.1 and 0.3 after their step 1."""

    def decide(self, trial, step):
        if step == 1 and trial.sample["lr"] in (0.1, 0.3):
            return td.Decision.STOP
        return super().decide(trial, step)


def _run(tmp_path, evaluator, name, strategy=None, **budget):
    exp = Experiment(TinyMLP(), evaluator, strategy or td.strategy.GridSearch(), store=tmp_path / "t.db", name=name,
                     budget=td.Budget(**budget), options=td.RunOptions(verbose=False),
                     executor=td.executors.Process(workers=2))
    return exp.run()


def _pids(trial):
    return {int(p) for p in trial.metrics.get("pid", [])}


def test_many_quick_trials_reuse_the_workers(tmp_path):
    ev = td.evaluators.FunctionalEvaluator(report_pid, x=td.choice("x", list(range(6))))
    exp = _run(tmp_path, ev, "reuse", max_trials=12)
    trials = exp.trials()
    assert len(trials) == 12 and all(t.status is TrialStatus.COMPLETED for t in trials)
    pids = set().union(*(_pids(t) for t in trials))
    assert len(pids) == 2 and os.getpid() not in pids  # 12 trials, two worker processes
    assert all(t.metrics["value"] == [t.sample["x"], t.sample["x"] + 1] for t in trials)


def test_workers_start_preloaded_and_see_the_drivers_environment(tmp_path, monkeypatch):
    """Workers fork from a server that imported torch once; a run's workers still see the driver's
    environment as it is when they start, not as it was when the server started."""
    ev = td.evaluators.FunctionalEvaluator(report_environment, x=td.choice("x", [0, 1]))
    for mark in (1, 2):
        monkeypatch.setenv("TRIDENS_TEST_MARK", str(mark))
        trials = _run(tmp_path, ev, f"env-{mark}", max_trials=2).trials()
        assert [t.metric for t in trials] == [mark, mark]
        assert all(t.metrics["preloaded"] == [1.0] for t in trials)


def test_a_misbehaving_trial_fails_alone_and_its_worker_is_replaced(tmp_path):
    ev = td.evaluators.FunctionalEvaluator(misbehave, x=td.choice("x", [0, 1, 2, 3, 4, 5, 6, 7]))
    exp = _run(tmp_path, ev, "misbehave", max_trials=16, trial_timeout=4)
    by_x = {}
    for t in exp.trials():
        by_x.setdefault(t.sample["x"], t)
    assert "died" in by_x[1].error and by_x[1].status is TrialStatus.FAILED
    assert "boom: x=2" in by_x[2].error
    assert by_x[3].status is TrialStatus.FAILED and "NaN" in by_x[3].error
    assert "trial_timeout" in by_x[4].error
    for x in (0, 5, 6, 7):
        assert by_x[x].status is TrialStatus.COMPLETED and by_x[x].metric == float(x)
    # The killed and the timed-out workers were replaced: more than two processes served the run,
    # and the worker whose trial raised served later trials too.
    pids = [p for t in sorted(exp.trials(), key=lambda t: t.id) for p in sorted(_pids(t))]
    assert len(set(pids)) >= 3
    raised_in = _pids(by_x[2])
    later = [p for t in exp.trials() if t.id > by_x[2].id for p in _pids(t)]
    assert raised_in & set(later)


def test_weights_come_back_and_stop_decisions_reach_the_loop(tmp_path):
    ev = td.evaluators.FunctionalEvaluator(set_weights, x=td.choice("x", [1, 2, 3]))
    exp = _run(tmp_path, ev, "weights", max_trials=3)
    store = Store(tmp_path / "t.db", readonly=True)
    for t in exp.trials():
        weights = store.load_checkpoint(t.checkpoint)
        assert all(torch.all(w == t.sample["x"] / 10) for w in weights.values())

    ev = td.evaluators.FunctionalEvaluator(report_until_stopped,
                                           lr=td.choice("lr", [0.1, 0.2, 0.3, 0.4]))
    exp = _run(tmp_path, ev, "stops", StopOddLrAtStep1(), max_trials=4)
    for t in exp.trials():
        if t.sample["lr"] in (0.1, 0.3):  # the loop saw STOP at its next report and ended
            assert t.status is TrialStatus.STOPPED and t.steps == 2 and t.metric == 2 * t.sample["lr"]
        else:
            assert t.status is TrialStatus.COMPLETED and t.steps == 4


def test_ctrl_c_stops_a_pool_run_and_the_interrupted_trials_resume(tmp_path):
    """A real process-pool search (two workers busy training) gets SIGINT: it said on stderr that it
    was starting its workers, it stops with one line (no traceback), the trials that were running
    are interrupted (not failed), and running the script again trains them to the end."""
    import subprocess
    import sys

    db = tmp_path / "pool.db"
    command = [sys.executable, "-m", "tests.engine.pool_interrupt_script", str(db)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([*command, "40"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    done = running = 0
    while (done < 2 or not running) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.3)
        try:
            with Store(db, readonly=True) as store:  # (between two groups no trial runs: wait for the next)
                done = len(store.trials("pool", status="completed"))
                running = len(store.trials("pool", status="running"))
        except Exception:  # not created yet
            continue
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)  # a generous bound, against a hang; the pool ends its workers at once
    assert done >= 2, err
    assert "starting 2 pool worker process(es)" in err and "Traceback" not in err
    assert proc.returncode == 1 and "'pool' interrupted with" in err
    with Store(db, readonly=True) as store:
        trials = store.trials("pool")
    interrupted = [t.id for t in trials if t.status is TrialStatus.INTERRUPTED]
    assert interrupted and not [t for t in trials if t.status in (TrialStatus.RUNNING, TrialStatus.FAILED)]
    again = subprocess.run([*command, str(len(trials))], cwd=root, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    with Store(db, readonly=True) as store:
        after = {t.id: t for t in store.trials("pool")}
    assert all(after[i].status is TrialStatus.COMPLETED and len(after[i].metrics["val_acc"]) == 2 for i in interrupted)
