"""The Ray executor on a real local Ray: same metrics as in-process, decisions reaching running
trials, checkpoints in ``storage``, workers killed for real (os.kill of the worker's pid) and a
driver killed for real (SIGKILL of a driver subprocess), resumed."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tridens as td
from tridens.engine._experiment import ExperimentFailed
from tridens.trial import Decision, TrialStatus

from .spaces import TinyCNN, TinyMLP

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (the executor uses a Ray already started in the process)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def by_sample(trials):
    return {tuple(sorted(t.sample.items())): t for t in trials}


def linear_curve(model, lr, steps=6):
    """A user loop (pickled to the workers by reference): the value grows with lr."""
    for step in range(steps):
        td.report(lr * (step + 1), step=step)


class KillWorker(td.strategy.Random):
    """Random search that kills the trial's worker process (SIGKILL) while the worker waits for the
    decision of ``kills[attempt]``: a real death at a known point of the trial."""

    def __init__(self, kills):
        super().__init__()
        self.kills = kills  # attempt -> step at which that attempt's worker is killed
        self.killed = []

    def decide(self, trial, step):
        info = trial.info.get("ray", {})
        if self.kills.get(info.get("attempt")) == step:
            os.kill(info["pid"], signal.SIGKILL)
            self.killed.append((trial.id, info["attempt"], step, info["pid"]))
        return super().decide(trial, step)


def test_same_metrics_in_process_and_on_ray_and_checkpoints_in_storage(local_ray, classification, tmp_path):
    runs = {}
    for kind, executor in (("inline", td.executors.Inline(optimize=False)), ("ray", td.executors.Ray(optimize=False))):
        exp = td.Experiment(TinyCNN(), classification, td.strategy.Random(), budget=3,
                            options=td.RunOptions(seed=7, verbose=False), store=tmp_path / f"{kind}.db", name="same",
                            executor=executor)
        runs[kind] = by_sample(exp.run().trials())
    assert runs["inline"].keys() == runs["ray"].keys()
    for key, inline in runs["inline"].items():
        on_ray = runs["ray"][key]
        assert on_ray.status is inline.status is TrialStatus.COMPLETED
        assert on_ray.metrics == inline.metrics  # bit for bit: same init, same batches, same seed
        assert on_ray.metric == inline.metric
        storage = Path(on_ray.info["storage"])  # default: a folder beside the store
        assert storage.parent == Path(str(tmp_path / "ray.db") + ".ray") / "same"
        assert Path(on_ray.checkpoint).exists()  # the driver copied the final weights into the store
        assert not storage.exists()  # and then removed the trial's folder


def test_user_loop_on_ray_with_asha_stops_running_trials(local_ray, tmp_path):
    evaluator = td.evaluators.FunctionalEvaluator(linear_curve, lr=td.choice("lr", [0.1 * i for i in range(1, 9)]))
    strategy = td.strategy.ASHA(min_steps=1, max_steps=6, reduction_factor=2, batch_size=8)
    exp = td.Experiment(TinyMLP(), evaluator, strategy, budget=8, options=td.RunOptions(verbose=False),
                        executor=td.executors.Ray(storage=tmp_path / "ckpt"), store=tmp_path / "asha.db", name="asha")
    trials = exp.run().trials()
    assert len(trials) == 8
    stopped = [t for t in trials if t.status is TrialStatus.STOPPED]
    completed = [t for t in trials if t.status is TrialStatus.COMPLETED]
    assert stopped and completed
    for t in stopped:  # the STOP reached the loop: it reported nothing after the rung that stopped it
        assert len(t.metrics["value"]) in strategy.rungs()
        assert t.metric == pytest.approx(t.sample["lr"] * len(t.metrics["value"]))
    for t in completed:
        assert len(t.metrics["value"]) == 6
    assert all(Path(t.checkpoint).exists() for t in trials)   # the final weights, stopped or not, in the store
    assert not [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]   # and nothing left under storage=


class StopFirstAtStep0(td.strategy.Random):
    """Stops trial 1 (the first of a new store) after its first epoch."""

    def decide(self, trial, step):
        return Decision.STOP if (trial.id, step) == (1, 0) else super().decide(trial, step)


def test_stop_reaches_a_declarative_trial_before_its_next_epoch(local_ray, classification, tmp_path):
    ev = td.evaluators.Classification(train=classification.train, val=classification.val, epochs=3, batch_size=128,
                                      optimizer="adam", lr=td.choice("lr", [0.01, 0.003]))
    runs = {}
    for kind, executor in (("inline", td.executors.Inline(optimize=False)), ("ray", td.executors.Ray(optimize=False))):
        exp = td.Experiment(TinyMLP(), ev, StopFirstAtStep0(), budget=2, options=td.RunOptions(seed=1, verbose=False),
                            executor=executor, store=tmp_path / f"{kind}.db", name="stop")
        runs[kind] = exp.run().trials()
    stopped = runs["ray"][0]
    assert stopped.status is TrialStatus.STOPPED and len(stopped.metrics["val_acc"]) == 1
    assert not os.path.exists(stopped.info["storage"])  # its folder removed once its weights were in the store
    assert runs["ray"][1].status is TrialStatus.COMPLETED and len(runs["ray"][1].metrics["val_acc"]) == 3
    import torch

    for inline, on_ray in zip(runs["inline"], runs["ray"]):
        assert (inline.status, inline.metrics) == (on_ray.status, on_ray.metrics)
        a, b = torch.load(inline.checkpoint, weights_only=True), torch.load(on_ray.checkpoint, weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_killed_worker_restarts_from_its_checkpoint(local_ray, classification, tmp_path):
    ev = td.evaluators.Classification(train=classification.train, val=classification.val, epochs=4, batch_size=128,
                                      optimizer="adam", lr=0.01)
    strategy = KillWorker({0: 1})  # the first worker of each trial dies after epoch 2 was checkpointed
    exp = td.Experiment(TinyMLP(), ev, strategy, budget=1, options=td.RunOptions(seed=3, verbose=False),
                        executor=td.executors.Ray(max_retries=1), store=tmp_path / "kill.db", name="kill")
    (trial,) = exp.run().trials()
    assert len(strategy.killed) == 1
    assert trial.status is TrialStatus.COMPLETED, trial.error
    assert trial.info["ray_restarts"] == 1
    assert trial.info["ray"]["attempt"] == 1 and trial.info["ray"]["pid"] != strategy.killed[0][3]
    # resumed from the checkpoint, each epoch recorded once, and the same as never killed
    inline = td.Experiment(TinyMLP(), ev, td.strategy.Random(), budget=1,
                           options=td.RunOptions(seed=3, verbose=False), store=tmp_path / "inline.db", name="kill").run().trials()[0]
    assert trial.sample == inline.sample
    assert trial.metrics == inline.metrics


def test_worker_killed_more_often_than_max_retries_fails_the_trial(local_ray, classification, tmp_path):
    ev = td.evaluators.Classification(train=classification.train, val=classification.val, epochs=3, batch_size=128, lr=0.05)
    strategy = KillWorker({0: 0, 1: 1})
    exp = td.Experiment(TinyMLP(), ev, strategy, budget=1, executor=td.executors.Ray(max_retries=1),
                        store=tmp_path / "dead.db", name="dead", options=td.RunOptions(verbose=False))
    with pytest.raises(ExperimentFailed):
        exp.run()
    (trial,) = exp.trials()
    assert trial.status is TrialStatus.FAILED
    assert "died 2 time(s)" in trial.error and "max_retries=1" in trial.error
    assert f"on node {trial.info['ray']['node']}" in trial.error and "\n" not in trial.error  # one line: where, and why
    assert len(trial.metrics["val_acc"]) == 2  # steps 0 and 1, each recorded once


@pytest.mark.parametrize("fn, timeout, message", [
    ("raise_on_hidden_8", None, "boom: hidden=8 is not supported"),
    pytest.param("sleep_on_hidden_8", 3.0, "exceeded trial_timeout=3.0 s", marks=pytest.mark.slow),
])
def test_errors_and_timeouts_fail_only_their_trial_on_ray(local_ray, tmp_path, fn, timeout, message):
    from . import spaces

    exp = td.Experiment(TinyMLP(), td.evaluators.FunctionalEvaluator(getattr(spaces, fn)), td.strategy.GridSearch(),
                        budget=td.Budget(max_trials=2, trial_timeout=timeout), executor=td.executors.Ray(),
                        store=tmp_path / "err.db", name=fn, options=td.RunOptions(verbose=False))
    trials = {t.sample["hidden"]: t for t in exp.run().trials()}
    assert trials[4].status is TrialStatus.COMPLETED and trials[4].metric == 0.5
    assert trials[8].status is TrialStatus.FAILED and message in trials[8].error


def test_storage_through_fsspec():
    from tridens.executors._ray_storage import CheckpointStorage

    storage = CheckpointStorage("memory://tridens-test/ckpt")
    assert storage.remote
    directory = storage.join("exp", "trial-1")
    for epoch in (1, 2):
        storage.save(storage.child(directory, f"epoch-{epoch}.pt"), {"epoch": epoch})
    assert storage.latest_epoch(directory) == 2
    assert storage.load(storage.child(directory, "epoch-2.pt")) == {"epoch": 2}
    storage.clear(directory)
    assert storage.latest_epoch(directory) is None


DRIVER = textwrap.dedent("""
    import sys, time
    import tridens as td
    from tests.engine.spaces import TinyMLP

    def slow_curve(model, lr):
        for step in range(4):
            time.sleep(0.15)
            td.report(lr * (step + 1), step=step)

    if __name__ == "__main__":
        ev = td.evaluators.FunctionalEvaluator(slow_curve, lr=td.choice("lr", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]))
        td.Experiment(TinyMLP(), ev, td.strategy.Random(), max_trials=6, store=sys.argv[1], name="driver",
                      executor=td.executors.Ray(address=sys.argv[2]), verbose=False).run()
""")


def _finished(db: Path) -> int:
    if not db.exists():
        return 0
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        try:
            return conn.execute("SELECT COUNT(*) FROM trials WHERE status IN ('completed', 'stopped')").fetchone()[0]
        except sqlite3.OperationalError:  # the schema is not there yet
            return 0


@pytest.mark.slow
def test_driver_killed_then_rerun_finishes_the_experiment(local_ray, tmp_path):
    script = tmp_path / "search.py"
    script.write_text(DRIVER)
    db = tmp_path / "driver.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}  # this checkout; tests.engine.spaces
    proc = subprocess.Popen([sys.executable, str(script), str(db), local_ray], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while _finished(db) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {t.id: t.metrics for t in td.Experiment.load(db, "driver").trials() if t.status is TrialStatus.COMPLETED}
    assert 2 <= len(before) < 6
    rerun = subprocess.run([sys.executable, str(script), str(db), local_ray], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    trials = td.Experiment.load(db, "driver").trials()
    assert all(t.status.finished for t in trials)  # the interrupted trials were run again
    completed = {t.id: t for t in trials if t.status is TrialStatus.COMPLETED}
    assert len(completed) == 6
    assert all(completed[i].metrics == metrics for i, metrics in before.items())  # kept, not retrained
    for t in completed.values():
        assert t.metrics["value"] == pytest.approx([t.sample["lr"] * (s + 1) for s in range(4)])


@pytest.mark.parametrize("kwargs, message", [
    ({"executor": "spark"}, "The 'executor' parameter of Experiment must be td.executors.Inline(), Process(...) or Ray(...)"),
    ({"executor": "ray", "max_retries": -1}, "The 'max_retries' parameter of Experiment must be an int in the range [0, inf)"),
    ({"executor": "ray", "ray_address": ""}, "The 'ray_address' parameter of Experiment must be None"),
    ({"ray_address": "127.0.0.1:6379"}, "only used with executor='ray'. Got executor='inline' instead."),
    ({"executor": "ray", "storage": 3}, "The 'storage' parameter of Experiment must be None, a directory or an fsspec URI"),
])
def test_ray_parameters_are_checked_at_run(classification, tmp_path, kwargs, message):
    with pytest.warns(DeprecationWarning, match="is deprecated: pass"):
        exp = td.Experiment(TinyMLP(), classification, budget=1, store=tmp_path / "x.db",
                            options=td.RunOptions(verbose=False), **kwargs)
    with pytest.raises(ValueError) as err:
        exp.run()
    assert message in str(err.value)


def test_storage_that_is_a_file_is_refused(classification, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.warns(DeprecationWarning, match="is deprecated: pass"):
        exp = td.Experiment(TinyMLP(), classification, budget=1, store=tmp_path / "x.db", executor="ray",
                            storage=tmp_path / "file", options=td.RunOptions(verbose=False))
    with pytest.raises(ValueError, match="must be a directory. Got the file"):
        exp.run()
