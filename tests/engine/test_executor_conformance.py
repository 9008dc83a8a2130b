"""The executor conformance suite: every executor -- in-process, process pool, Ray (a real local
Ray on 127.0.0.1) -- passes the same cases, on tiny models and the real digits data:

same metrics for a seeded experiment, a stop decision, a member whose loss becomes NaN, a trial
past its ``trial_timeout`` (a loop that never reports), a crash of the process training a trial,
a process that hangs or dies inside an epoch (the hang check and the death message, wherever
step-wise trials train in another process: pool workers, stage trees on them, Ray tasks, forked
children),
``kill -9`` of the driver and a resume (real subprocesses), a fork of a member from its state,
stage trees (trials sharing a training prefix) and a strategy that forks members (PBT).
One-shot runs take the cases that apply to them: the supernet trains as one trial where the
executor trains trials (seeded metrics, the budget's stop, a worker that hangs or dies inside an
epoch, kill -9 of the driver and a resume from the supernet's last epoch).

The in-process Ray cases share one local Ray for the module (started on 127.0.0.1 as the executor
starts it); the two subprocess cases on Ray (a worker that kills itself, kill -9 of the driver),
which start a Ray of their own in each driver process, are marked slow.
"""

import copy
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tridens as td
from tridens.trial import Trial, TrialStatus
from tridens.units import Job, SeparateUnit

from tests.oneshot.spaces import DigitsCNN

from .spaces import AwayChoice, AwayMLP, TinyMLP

ROOT = Path(__file__).resolve().parents[2]

EXECUTORS = ["inline", "process", "ray"]
SLOW_RAY = ["inline", "process", pytest.param("ray", marks=pytest.mark.slow)]  # a Ray per driver process


@pytest.fixture
def executor_of(request, tmp_path):
    """``executor_of(kind)``: a fresh executor object of that kind."""
    def make(kind, **kw):
        if kind == "inline":
            return td.executors.Inline(**kw)
        if kind == "process":
            return td.executors.Process(workers=2, **kw)
        request.getfixturevalue("local_ray")
        return td.executors.Ray(workers=2, storage=tmp_path / "ray", **kw)
    return make


def classification(digits_data, epochs=2, **choices):
    train, val = digits_data
    return td.evaluators.Classification(train=train, val=val, epochs=epochs, batch_size=128, optimizer="sgd",
                                        **choices)


def run(tmp_path, executor, evaluator, strategy=None, name="conf", max_trials=None, trial_timeout=None, space=None,
        **options):
    exp = td.Experiment(space or TinyMLP(), evaluator, strategy or td.strategy.GridSearch(), store=tmp_path / "t.db",
                        name=name, executor=executor, budget=td.Budget(max_trials=max_trials, trial_timeout=trial_timeout),
                        options=td.RunOptions(verbose=False, **options))
    return {tuple(sorted(t.sample.items())): t for t in exp.run().trials()}


def same_curves(got, want):
    assert got.keys() == want.keys()
    for key, trial in got.items():
        ref = want[key]
        assert trial.seed == ref.seed and trial.status is ref.status, key
        assert trial.metrics.keys() == ref.metrics.keys(), key
        for metric, values in trial.metrics.items():
            assert values == pytest.approx(ref.metrics[metric], rel=1e-5, abs=1e-7), (key, metric)


_REFERENCES = {}


@pytest.fixture
def reference(tmp_path_factory, digits_data):
    """``reference(name, evaluator, strategy)``: the trials trained one by one in this process
    (``Inline(optimize=False)``), computed once per name."""
    def get(name, evaluator, strategy=None, **kw):
        if name not in _REFERENCES:
            folder = tmp_path_factory.mktemp(f"reference-{name}")
            _REFERENCES[name] = run(folder, td.executors.Inline(optimize=False), evaluator, strategy, name=name, **kw)
        return _REFERENCES[name]
    return get


# -- in-process cases ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", EXECUTORS)
def test_same_metrics_for_a_seeded_experiment(kind, tmp_path, executor_of, digits_data, reference):
    ev = classification(digits_data, lr=td.choice("lr", [0.05, 0.2]))
    got = run(tmp_path, executor_of(kind), ev)
    assert len(got) == 4 and all(t.status is TrialStatus.COMPLETED for t in got.values())
    same_curves(got, reference("seeded", ev))


class StopLr02AfterStep0(td.strategy.GridSearch):
    def decide(self, trial, step):
        if step == 0 and trial.sample["lr"] == 0.2:
            return td.Decision.STOP
        return super().decide(trial, step)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_stop_decision_ends_the_trial_after_that_step(kind, tmp_path, executor_of, digits_data, reference):
    ev = classification(digits_data, epochs=3, lr=td.choice("lr", [0.05, 0.2]))
    got = run(tmp_path, executor_of(kind), ev, StopLr02AfterStep0())
    for key, trial in got.items():
        if dict(key)["lr"] == 0.2:
            assert trial.status is TrialStatus.STOPPED and trial.steps == 1 and trial.checkpoint
            assert trial.metric == trial.metrics["val_acc"][-1]
        else:
            assert trial.status is TrialStatus.COMPLETED and trial.steps == 3
    same_curves(got, reference("stop", ev, StopLr02AfterStep0()))


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_member_whose_loss_becomes_nan_fails_alone(kind, tmp_path, executor_of, digits_data, reference):
    ev = classification(digits_data, lr=td.choice("lr", [0.05, 1e30]))
    got = run(tmp_path, executor_of(kind), ev)
    for key, trial in got.items():
        if dict(key)["lr"] == 1e30:
            assert trial.status is TrialStatus.FAILED and "the training loss of" in trial.error
            assert trial.checkpoint is None
        else:
            assert trial.status is TrialStatus.COMPLETED and trial.steps == 2
    same_curves(got, reference("nan", ev))


def quick_or_silent(model, x):
    """x=1 sleeps ten minutes without ever reporting; x=0 reports once and returns."""
    if x == 1:
        time.sleep(600)
    td.report(0.5, step=0)
    return 0.5


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_trial_past_its_timeout_fails_even_if_it_never_reports(kind, tmp_path, executor_of):
    ev = td.evaluators.FunctionalEvaluator(quick_or_silent, x=td.choice("x", [0, 1]))
    got = run(tmp_path, executor_of(kind), ev, trial_timeout=2)
    for key, trial in got.items():
        if dict(key)["x"] == 1:
            assert trial.status is TrialStatus.FAILED and "exceeded trial_timeout=2 s" in trial.error
        else:
            assert trial.status is TrialStatus.COMPLETED and trial.metric == 0.5


# -- a unit's process hangs or dies inside an epoch -----------------------------------------------------
UNIT_BACKENDS = ["process", "process-units", "process-fluid", "ray", "forked"]
"""Where step-wise trials train in another process: a pool worker per trial, pool workers training
stage trees (units), pool workers placed by Fluid, a Ray task per trial, forked children of the
in-process executor (units side by side)."""


def away(kind, how, executor_of, digits_data, tmp_path, trial_timeout=None):
    """The trials of ``AwayMLP(how)`` on ``kind``: width 4 trains, width 8 hangs or dies."""
    ev = classification(digits_data, lr=td.choice("lr", [0.05, 0.2]))
    options = {}
    if kind == "process":
        executor = executor_of("process", optimize=False)
    elif kind == "process-units":   # trials sharing a training prefix: a stage tree per width, in a worker
        executor = executor_of("process")
        ev = classification(digits_data, epochs=td.choice("epochs", [2, 3]), lr=0.1, schedule="step",
                            milestones=[1], gamma=td.choice("gamma", [0.1, 0.5]))
        options = {"seeds": "per-architecture"}
    elif kind == "process-fluid":   # Fluid's placements, a worker each (none packed with a misbehaving one)
        executor = executor_of("process", optimize=False, allocation=td.executors.StaticFluid(max_pack=1))
    elif kind == "ray":
        executor = executor_of("ray", optimize=False)
    else:
        if not hasattr(os, "fork"):
            pytest.skip("forked units need os.fork")
        executor = td.executors.Inline(threads=td.engine.ThreadPolicy(threads=1, concurrent=2), optimize=False)
    got = run(tmp_path, executor, ev, space=AwayMLP(how), trial_timeout=trial_timeout, **options)
    assert {dict(key)["hidden"] for key in got} == {4, 8}
    for key, trial in got.items():
        if dict(key)["hidden"] == 4:
            assert trial.status is TrialStatus.COMPLETED, trial.error
    return [t for key, t in got.items() if dict(key)["hidden"] == 8]


@pytest.mark.parametrize("kind", UNIT_BACKENDS)
def test_a_trial_silent_inside_an_epoch_past_its_timeout_is_killed(kind, tmp_path, executor_of, digits_data):
    """The hang check: a process that says nothing past ``trial_timeout`` (and a grace) is killed,
    its trials fail with the timeout message, the others train on."""
    for trial in away(kind, "hang", executor_of, digits_data, tmp_path, trial_timeout=3):
        assert trial.status is TrialStatus.FAILED and "exceeded trial_timeout=3 s" in trial.error, trial.error
        assert "was killed" in trial.error


@pytest.mark.parametrize("kind", UNIT_BACKENDS)
def test_a_process_that_dies_inside_an_epoch_fails_only_its_trials(kind, tmp_path, executor_of, digits_data):
    """The death message: ``os._exit(3)`` while training fails the trials of that process (a pool's
    stage tree after one retry on a fresh worker, Ray's after ``max_retries``), the others train on."""
    for trial in away(kind, "die", executor_of, digits_data, tmp_path):
        assert trial.status is TrialStatus.FAILED and "died" in trial.error, trial.error
        if kind != "ray":
            assert "exit code 3" in trial.error
        if kind == "process-units":
            assert "died 2 time(s)" in trial.error


# -- fork ------------------------------------------------------------------------------------------
class Recorder:
    """The experiment's side of the trial protocol, kept in memory: what the executor reported."""

    trial_timeout = None

    def __init__(self):
        self.steps, self.outcomes = {}, {}

    def started(self, trial):
        trial.status = TrialStatus.RUNNING

    def record(self, trial, step, metrics):
        self.steps.setdefault(trial.id, {})[step] = dict(metrics)

    def decide(self, trial, step):
        return td.Decision.CONTINUE

    def finish(self, trial, status, *, error=None, weights=None, value=None):
        trial.status = status
        self.outcomes[trial.id] = (status, error, weights, value)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_fork_continues_from_the_members_state(kind, tmp_path, executor_of, digits_data):
    """A trial forked from another's state after epoch 1 trains epochs 1 and 2 as the other did."""
    ev = classification(digits_data, epochs=3)
    space, sample, seed = TinyMLP(), {"hidden": 8}, 12345
    torch.manual_seed(seed)
    model = space.freeze(sample)
    executor = executor_of(kind)
    executor.start(td.executors.RunContext(experiment="fork", storage=str(tmp_path / "fork")))
    try:
        whole = Recorder()
        executor.run_group([Job(Trial(id=1, sample=sample, seed=seed), copy.deepcopy(model))], ev, whole)
        # the source: one epoch in a unit of its own, then its state
        unit = SeparateUnit([Job(Trial(id=2, sample=sample, seed=seed), copy.deepcopy(model))], ev)
        unit.train_epoch()
        state = unit.state_dict(2)
        forked = Recorder()
        job = Job(Trial(id=3, sample=sample, seed=seed), copy.deepcopy(model), start_from=state)
        executor.run_group([job], ev, forked)
    finally:
        executor.close()
    assert sorted(forked.steps[3]) == [1, 2]
    for step in (1, 2):
        assert forked.steps[3][step] == pytest.approx(whole.steps[1][step], rel=1e-6)
    status, _, weights, _ = forked.outcomes[3]
    assert status is TrialStatus.COMPLETED
    for name, tensor in whole.outcomes[1][2].items():
        assert torch.allclose(weights[name], tensor, atol=1e-6), name


@pytest.mark.parametrize("kind", EXECUTORS)
def test_trials_sharing_a_training_prefix_report_what_they_report_trained_alone(kind, tmp_path, executor_of,
                                                                               digits_data, reference):
    """A grid over step-schedule decay factors and epoch budgets with shared initial weights: stage
    trees (each shared stage trained once, then forked) give every trial its metrics trained alone."""
    ev = classification(digits_data, epochs=td.choice("epochs", [2, 3]), lr=0.1, schedule="step",
                        milestones=[1], gamma=td.choice("gamma", [0.1, 0.5]))
    got = run(tmp_path, executor_of(kind), ev, seeds="per-architecture")
    assert len(got) == 8 and all(t.status is TrialStatus.COMPLETED for t in got.values())
    assert {t.info["unit"]["kind"] for t in got.values()} == {"stage tree"}
    same_curves(got, reference("stages", ev, seeds="per-architecture"))


def pbt():
    return td.strategy.PBT(population=4, interval=1, hyperparams=["lr"])


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_strategy_that_forks_members_gets_the_in_process_result(kind, tmp_path, executor_of, digits_data,
                                                                 reference):
    """PBT: every exploit forks a member onto another's state, wherever the two train (the pool
    and Ray deal the population over their two workers in turn: a source in the other worker
    hands its state over, through the driver or through storage=)."""
    ev = classification(digits_data, epochs=4, lr=td.loguniform("lr", 1e-3, 0.5))
    got = run(tmp_path, executor_of(kind), ev, pbt(), max_trials=4)
    want = reference("pbt", ev, pbt(), max_trials=4)
    same_curves(got, want)
    exploits = {key: t.info.get("exploits") for key, t in got.items()}
    assert any(exploits.values()) and exploits == {key: t.info.get("exploits") for key, t in want.items()}
    if kind != "inline":   # some exploit copied a member of the other worker (members dealt in turn)
        worker = {t.id: i % 2 for i, t in enumerate(sorted(got.values(), key=lambda t: t.id))}
        assert any(worker[e["from"]] != worker[t.id] for t in got.values() for e in t.info.get("exploits") or ())


# -- real subprocesses: a crash, kill -9 of the driver ------------------------------------------------
def start_script(kind, store, scenario):
    return subprocess.Popen([sys.executable, "-m", "tests.engine.executor_script", kind, str(store), scenario],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def rows(store, sql, args=()):
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=30) as conn:
        return conn.execute(sql, args).fetchall()


def wait_for(predicate, seconds=120.0):
    """Poll ``predicate`` until it holds (the test fails after ``seconds``)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if predicate():
                return
        except sqlite3.OperationalError:  # the store is not created yet
            pass
        time.sleep(0.1)
    raise AssertionError(f"still not true after {seconds} s: {predicate.__doc__}")


def trials_of(store, name):
    with td.store.Store(store, readonly=True) as db:
        return db.trials(name)


@pytest.mark.parametrize("kind", SLOW_RAY)
def test_a_trial_that_kills_its_process_fails_and_the_run_goes_on(kind, tmp_path):
    """``os._exit(3)`` in a trial: a pool or Ray worker dies and the trial fails at once; in-process
    the driver dies, and the trial is charged on resume: failed after two deaths."""
    store = tmp_path / "crash.db"
    codes = []
    for _ in range(4):
        proc = start_script(kind, store, "crash")
        out = proc.communicate(timeout=300)[0]
        codes.append(proc.returncode)
        if proc.returncode == 0:
            break
    assert codes == ([3, 3, 0] if kind == "inline" else [0]), out
    by_x = {t.sample["x"]: t for t in trials_of(store, "crash")}
    assert sorted(by_x) == [0, 1, 2, 3]
    assert by_x[2].status is TrialStatus.FAILED and "died" in by_x[2].error
    assert all(by_x[x].status is TrialStatus.COMPLETED and by_x[x].metric == x for x in (0, 1, 3))


# inline: tests/cli/test_cli.py::test_kill_then_resume_completes_the_budget_without_retraining kills an
# inline driver and resumes it in the default run
@pytest.mark.parametrize("kind", [pytest.param("inline", marks=pytest.mark.slow), "process",
                                  pytest.param("ray", marks=pytest.mark.slow)])
def test_kill_9_of_the_driver_then_resume_loses_and_repeats_nothing(kind, tmp_path):
    store = tmp_path / "slow.db"
    proc = start_script(kind, store, "slow")

    def two_done():
        """two trials completed"""
        return rows(store, "SELECT COUNT(*) FROM trials WHERE status = 'completed'")[0][0] >= 2

    wait_for(two_done)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {t.id: t for t in trials_of(store, "slow") if t.status is TrialStatus.COMPLETED}
    resumed = start_script(kind, store, "slow")
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, out
    trials = trials_of(store, "slow")
    done = [t for t in trials if t.status is TrialStatus.COMPLETED]
    assert sorted(t.sample["x"] for t in done) == list(range(6))
    assert all(t.status is TrialStatus.COMPLETED for t in trials)  # nothing left running or interrupted
    for t in done:
        assert t.metrics["value"] == [t.sample["x"] * (s + 1) for s in range(4)]
        if t.id in before:
            assert t.metrics == before[t.id].metrics and t.checkpoint == before[t.id].checkpoint
    assert rows(store, "SELECT status FROM experiments WHERE name = 'slow'") == [("done",)]


# -- one-shot runs -------------------------------------------------------------------------------
def one_shot(tmp_path, executor, evaluator, strategy, space=None, name="oneshot", **budget):
    tmp_path.mkdir(parents=True, exist_ok=True)
    exp = td.Experiment(space or DigitsCNN(), evaluator, strategy, store=tmp_path / "t.db", name=name,
                        executor=executor, budget=td.Budget(**budget), options=td.RunOptions(verbose=False))
    exp.run()
    return exp, {t.info["oneshot"]["role"] + str(t.label): t for t in exp.trials()}


def adam(digits_data):
    train, val = digits_data
    return td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, optimizer="adam", lr=0.01)


def darts():
    return td.oneshot.DARTS(samples=2, population=2, retrain=1)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_a_one_shot_run_gets_the_in_process_result_wherever_its_supernet_trains(kind, tmp_path, executor_of,
                                                                               digits_data):
    """The supernet trains as one trial of the executor (a pool worker, a Ray task), its epochs'
    checkpoints come back to the store; the subnets it scores and the retrained best are those of
    a run in this process."""
    ev = adam(digits_data)
    if "oneshot" not in _REFERENCES:
        _REFERENCES["oneshot"] = one_shot(tmp_path / "reference", td.executors.Inline(), ev, darts())[1]
    want = _REFERENCES["oneshot"]
    exp, got = one_shot(tmp_path, executor_of(kind), ev, darts())
    assert exp.stop_reason.startswith("DARTS is done: the supernet trained 2 epochs, 2 subnets scored")
    assert got.keys() == want.keys()
    for key, trial in got.items():
        ref = want[key]
        assert trial.status is ref.status is TrialStatus.COMPLETED and trial.sample == ref.sample, key
        assert trial.checkpoint and Path(trial.checkpoint).is_file(), key
        assert trial.metrics.keys() == ref.metrics.keys(), key
        for metric, values in trial.metrics.items():  # (accuracy may move by an example: float sums differ)
            assert values == pytest.approx(ref.metrics[metric], rel=1e-4, abs=0.01 if "acc" in metric else 1e-6)
    supernet = got["supernet0"]
    assert supernet.info["oneshot"]["epochs"] == 2 and supernet.info["oneshot"]["steps"] > 0
    assert supernet.info["params"] == want["supernet0"].info["params"]
    with td.store.Store(tmp_path / "t.db", readonly=True) as db:
        state = db.load_checkpoint(supernet.checkpoint)
    assert state["epoch"] == 2 and "info" not in state
    relay = tmp_path / "t.db.ray"  # where the worker's epochs came back through: no empty folder left there
    assert not [p for p in relay.rglob("*") if p.is_dir() and not any(p.iterdir())] and not (
        relay.is_dir() and not any(relay.iterdir()))


@pytest.mark.parametrize("kind", EXECUTORS)
def test_max_duration_stops_a_supernet_and_the_next_run_continues_it_from_its_checkpoint(kind, tmp_path, executor_of,
                                                                                        digits_data):
    ev = adam(digits_data)
    strategy = td.oneshot.RandomOneShot(samples=2, search="random", epochs=3)
    exp, got = one_shot(tmp_path, executor_of(kind), ev, strategy, max_duration=1e-6)
    assert exp.stop_reason == ("max_duration=1e-06 reached during the supernet's training, after epoch 1 of 3 "
                               "(its checkpoint is kept: run again to continue)")
    (supernet,) = got.values()
    assert supernet.status is TrialStatus.STOPPED and len(supernet.metrics["train_loss"]) == 1 and supernet.checkpoint
    exp, got = one_shot(tmp_path, executor_of(kind), ev, td.oneshot.RandomOneShot(samples=2, search="random", epochs=3))
    assert exp.stop_reason.startswith("RandomOneShot is done: the supernet trained 3 epochs, 2 subnets scored")
    whole = one_shot(tmp_path / "whole", td.executors.Inline(), ev,
                     td.oneshot.RandomOneShot(samples=2, search="random", epochs=3))[1]
    assert got["supernet0"].status is TrialStatus.COMPLETED
    assert got["supernet0"].metrics["train_loss"] == pytest.approx(whole["supernet0"].metrics["train_loss"], rel=1e-5)


@pytest.mark.parametrize("kind", ["process", "ray"])
@pytest.mark.parametrize("how", ["hang", "die"])
def test_a_supernet_whose_worker_hangs_or_dies_fails_with_the_executors_message(kind, how, tmp_path, executor_of,
                                                                              digits_data):
    """The hang check and the death message of the executor: a supernet silent past
    ``trial_timeout`` is killed with its worker, one whose worker dies fails; the run stops
    saying so in one line (its checkpoint, if any, kept for the next run)."""
    ev = adam(digits_data)
    exp, got = one_shot(tmp_path, executor_of(kind), ev, td.oneshot.DARTS(samples=1),
                        space=AwayChoice(how, os.getpid()), trial_timeout=3 if how == "hang" else None)
    (supernet,) = got.values()
    assert supernet.status is TrialStatus.FAILED
    if how == "hang":
        assert "exceeded trial_timeout=3 s" in supernet.error and "killed" in supernet.error, supernet.error
    else:
        assert "died" in supernet.error, supernet.error
    assert "\n" not in exp.stop_reason and exp.stop_reason.endswith("run again to start it again"), exp.stop_reason


def test_a_ray_task_restarted_after_its_worker_died_continues_the_supernet_from_its_last_epoch(tmp_path, executor_of,
                                                                                             digits_data):
    """Ray's max_retries: the worker dies two epochs in, the task starts again from the last
    epoch it wrote (saying that epoch again, recorded once) and the supernet trains as in one go."""
    ev = adam(digits_data)
    strategy = td.oneshot.DARTS(samples=1, epochs=4)
    space = AwayChoice("die-once", os.getpid(), str(tmp_path / "died"))
    exp, got = one_shot(tmp_path, executor_of("ray", max_retries=1), ev, strategy, space=space)
    assert (tmp_path / "died").exists()  # its worker died once
    whole = one_shot(tmp_path / "whole", td.executors.Inline(), ev, td.oneshot.DARTS(samples=1, epochs=4),
                     space=AwayChoice("die-once", os.getpid(), str(tmp_path / "died")))[1]
    assert got["supernet0"].status is TrialStatus.COMPLETED, got["supernet0"].error
    assert got["supernet0"].metrics["train_loss"] == pytest.approx(whole["supernet0"].metrics["train_loss"], rel=1e-5)


@pytest.mark.parametrize("kind", ["process", pytest.param("ray", marks=pytest.mark.slow)])
def test_kill_9_of_a_one_shot_driver_then_resume_continues_the_supernet_from_its_last_epoch(kind, tmp_path):
    from .executor_script import ONESHOT_EPOCHS

    store = tmp_path / "oneshot.db"
    proc = start_script(kind, store, "oneshot")

    def two_epochs():
        """the supernet recorded two epochs"""
        return rows(store, "SELECT COUNT(*) FROM metrics WHERE name = 'train_loss'")[0][0] >= 2

    wait_for(two_epochs)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (before,) = trials_of(store, "oneshot")
    assert before.checkpoint and 2 <= len(before.metrics["train_loss"]) < ONESHOT_EPOCHS
    resumed = start_script(kind, store, "oneshot")
    out = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, out
    trials = trials_of(store, "oneshot")
    assert [t.status for t in trials] == [TrialStatus.COMPLETED] * 3
    supernet = trials[0]
    losses = supernet.metrics["train_loss"]
    assert len(losses) == ONESHOT_EPOCHS and losses[:len(before.metrics["train_loss"])] == before.metrics["train_loss"]
    assert rows(store, "SELECT DISTINCT step FROM metrics WHERE trial_id = ? ORDER BY step", (supernet.id,)) == [
        (s,) for s in range(ONESHOT_EPOCHS)]
    assert rows(store, "SELECT status FROM experiments WHERE name = 'oneshot'") == [("done",)]


# -- the driver's leftovers ------------------------------------------------------------------------
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_pool_workers_in_a_hanging_trial_exit_with_their_killed_driver(tmp_path):
    store = tmp_path / "hang.db"
    proc = start_script("process", store, "hang")

    def both_hang():
        """both trials reported their worker's pid"""
        return len(rows(store, "SELECT value FROM metrics WHERE name = 'pid'")) == 2

    wait_for(both_hang)
    pids = [int(v) for (v,) in rows(store, "SELECT value FROM metrics WHERE name = 'pid'")]
    assert all(alive(pid) for pid in pids)
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def workers_gone():
        """the workers exited"""
        return not any(alive(pid) for pid in pids)

    wait_for(workers_gone, seconds=30)


def test_a_run_left_running_by_a_killed_driver_is_marked_interrupted_on_the_next_open(tmp_path):
    store = tmp_path / "slow.db"
    proc = start_script("inline", store, "slow")

    def one_done():
        """a trial completed"""
        return rows(store, "SELECT COUNT(*) FROM trials WHERE status = 'completed'")[0][0] >= 1

    wait_for(one_done)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert rows(store, "SELECT status FROM experiments") == [("running",)]
    assert rows(store, "SELECT COUNT(*) FROM trials WHERE status = 'running'")[0][0] == 1
    listed = subprocess.run([sys.executable, "-m", "tridens.cli", "ls", "--db", str(store)], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert listed.returncode == 0, listed.stderr
    assert rows(store, "SELECT status FROM experiments") == [("interrupted",)]
    assert rows(store, "SELECT COUNT(*) FROM trials WHERE status = 'running'")[0][0] == 0
    assert rows(store, "SELECT COUNT(*) FROM trials WHERE status = 'interrupted'")[0][0] == 1


@pytest.mark.parametrize("fused", [False, True])
def test_a_unit_forks_a_member_that_goes_on_as_its_source(fused, digits_data):
    """``unit.fork(source, job)``: the new member continues from the source's state (a batched
    unit hands it to a separate unit, a separate unit takes it in)."""
    from tridens.xopt import BatchedUnit

    ev = classification(digits_data, epochs=3, lr=td.choice("lr", [0.05, 0.2]))
    space, seeds = TinyMLP(), (7, 8)

    def job(tid, lr, seed):
        torch.manual_seed(seed)
        return Job(Trial(id=tid, sample={"hidden": 8, "lr": lr}, seed=seed), space.freeze({"hidden": 8}))

    unit = (BatchedUnit if fused else SeparateUnit)([job(1, 0.05, seeds[0]), job(2, 0.2, seeds[1])], ev)
    unit.train_epoch()
    child = unit.fork(1, job(3, 0.05, seeds[0]))
    assert (child is unit) is not fused and child.describe()["trials"][-1] == 3
    later = [(unit.train_epoch(), child.train_epoch() if fused else None) for _ in range(2)]
    for own, forked in later:
        got = (forked if fused else own)[3]
        assert got == pytest.approx(own[1], rel=1e-5, abs=1e-6)
