"""Planner units and Fluid shares on a real local Ray: a fused unit is one Ray task reporting every
member, a stop reaches one member while the others go on, a SIGKILLed unit worker restarts its
members from their checkpoints; Fluid shares become the tasks' resource requests (fractional CPUs,
or one task running DDP over two local processes), DynamicFluid moves a trial at an epoch
boundary. Every run is checked against the same search in-process (1e-4)."""

import logging
import os
import signal

import pytest
import torch
from torch import nn

import tridens as td
from tridens.engine import DynamicFluid, StaticFluid
from tridens.trial import Decision, TrialStatus

from .spaces import Groups, MLPSpace, TinyMLP

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module (the executor uses a Ray already started in the process)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture
def force(monkeypatch):
    """Batch same-shaped trials without measuring whether it pays ($TRIDENS_BATCHING, read into the
    experiment's settings; the driver's decision travels to the worker, which plans the unit again)."""
    monkeypatch.setenv("TRIDENS_BATCHING", "force")


def assert_close(a, b):
    """Two runs' trials (same samples, same order): same status and per-epoch metrics to 1e-4."""
    assert [t.sample for t in a] == [t.sample for t in b]
    for x, y in zip(a, b):
        assert (x.status, x.metrics.keys()) == (y.status, y.metrics.keys()), (x.error, y.error)
        for key in x.metrics:
            torch.testing.assert_close(torch.tensor(y.metrics[key]), torch.tensor(x.metrics[key]), rtol=1e-4, atol=1e-4)


def evaluator(digits_data, epochs=3):
    train, val = digits_data
    return td.evaluators.Classification(train=train, val=val, epochs=epochs, batch_size=128, optimizer="adam",
                                        lr=td.choice("lr", [0.01, 0.003]))


class SeenInStorage(td.loggers.Callback):
    """What each trial's folder under storage= holds when the trial ends (the folder is removed
    once its group ends): its files, and its last per-epoch checkpoint."""

    def __init__(self):
        self.files, self.saved = {}, {}

    def on_trial_end(self, trial):
        folder = trial.info.get("storage")
        if folder and os.path.isdir(folder):
            self.files[trial.id] = sorted(os.listdir(folder))
            epochs = [name for name in self.files[trial.id] if name.startswith("epoch-")]
            if epochs:
                self.saved[trial.id] = torch.load(os.path.join(folder, epochs[-1]), weights_only=True)


def both(tmp_path, space, ev, strategy_factory, name, max_trials, on_ray, **ray_kw):
    """The same search in-process (optimize=True) and on ``on_ray`` (a ``td.executors.Ray``, with the
    experiment options ``ray_kw``); returns the two trial lists."""
    out = []
    for kind, executor in (("inline", td.executors.Inline()), ("ray", on_ray)):
        kw = ray_kw if kind == "ray" else {}
        exp = td.Experiment(space, ev, strategy_factory(), budget=max_trials,
                            options=td.RunOptions(seed=5, verbose=False), store=tmp_path / f"{kind}.db", name=name,
                            executor=executor, **kw)
        out.append(exp.run().trials())
    return out


# -- planner units -------------------------------------------------------------------------------------
def test_fused_unit_is_one_ray_task_with_the_in_process_metrics(local_ray, force, digits_data, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tridens"):
        seen = SeenInStorage()
        inline, on_ray = both(tmp_path, TinyMLP(), evaluator(digits_data), td.strategy.GridSearch, "fused", 4,
                              td.executors.Ray(workers=1), callbacks=[seen])
    assert caplog.text.count("mixed unit, one data pipeline for 2 planned units") == 2  # in-process, then on Ray
    assert_close(inline, on_ray)
    assert all(t.status is TrialStatus.COMPLETED for t in on_ray)
    assert len({t.info["ray"]["pid"] for t in on_ray}) == 1  # the four trials trained in one task
    for t in on_ray:
        assert seen.files[t.id] == ["epoch-3.pt", "final.pt"]  # a checkpoint per member
        saved = seen.saved[t.id]
        assert not os.path.exists(t.info["storage"])   # removed once the group ended
        assert saved["trainer"]["epoch"] == 3 and saved["metrics"]["val_acc"] == t.metrics["val_acc"][-1]


class StopTrial2(td.strategy.GridSearch):
    """Stops trial 2 after its first epoch."""

    def decide(self, trial, step):
        return Decision.STOP if (trial.id, step) == (2, 0) else super().decide(trial, step)


def test_stop_reaches_one_member_of_a_fused_unit(local_ray, force, digits_data, tmp_path, caplog):
    # two workers: the mixed unit is planned again as two batched units, one task each
    with caplog.at_level(logging.INFO, logger="tridens"):
        seen = SeenInStorage()
        inline, on_ray = both(tmp_path, TinyMLP(), evaluator(digits_data), StopTrial2, "stop", 4,
                              td.executors.Ray(workers=2), callbacks=[seen])
    assert "is planned again as two units for the 2 workers" in caplog.text
    assert caplog.text.count("batched unit of 2 trial(s)") == 2
    assert_close(inline, on_ray)
    stopped = next(t for t in on_ray if t.id == 2)
    assert stopped.status is TrialStatus.STOPPED and len(stopped.metrics["val_acc"]) == 1
    assert seen.files[stopped.id] == ["epoch-1.pt", "final.pt"]  # left after one epoch
    others = [t for t in on_ray if t.id != 2]
    assert all(t.status is TrialStatus.COMPLETED and len(t.metrics["val_acc"]) == 3 for t in others)
    pids = {t.id: t.info["ray"]["pid"] for t in on_ray}
    assert pids[1] == pids[2] and pids[3] == pids[4]  # trial 1 went on in the unit trial 2 left
    a = torch.load(next(t for t in inline if t.id == 2).checkpoint, weights_only=True)
    b = torch.load(stopped.checkpoint, weights_only=True)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)  # the stopped member's weights


class KillUnitOnce(td.strategy.GridSearch):
    """Grid search that SIGKILLs the unit's worker once, while it waits for the decisions of ``step``
    (every member's checkpoint of that epoch is written by then)."""

    def __init__(self, step):
        super().__init__()
        self.step = step
        self.killed = []

    def decide(self, trial, step):
        info = trial.info.get("ray", {})
        if not self.killed and info.get("attempt") == 0 and step == self.step:
            os.kill(info["pid"], signal.SIGKILL)
            self.killed.append(info["pid"])
        return super().decide(trial, step)


def test_killed_unit_worker_restarts_its_members_from_their_checkpoints(local_ray, force, digits_data, tmp_path,
                                                                         caplog):
    strategies = []

    def factory():
        strategies.append(KillUnitOnce(step=1))
        return strategies[-1]

    with caplog.at_level(logging.WARNING, logger="tridens"):
        inline, on_ray = both(tmp_path, TinyMLP(), evaluator(digits_data), factory, "kill", 4,
                              td.executors.Ray(workers=1, max_retries=1))
    assert len(strategies[1].killed) == 1 and len(strategies[0].killed) == 0  # in-process: no worker to kill
    assert "retried once on a fresh worker from the members' last checkpoints, as separate trials" in caplog.text
    assert_close(inline, on_ray)  # batched members resumed as separate trainers: the same curves
    for t in on_ray:
        assert t.status is TrialStatus.COMPLETED and t.info["ray_restarts"] == 1
        assert t.info["ray"]["attempt"] == 1 and t.info["ray"]["pid"] != strategies[1].killed[0]
        assert len(t.metrics["val_acc"]) == 3  # each epoch recorded once


# -- Fluid ----------------------------------------------------------------------------------------------


def fluid_pair(tmp_path, digits_data, group, name, allocation, **kw):
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=td.choice("epochs", [1, 2, 12]),
                                      batch_size=96, optimizer="adam", lr=0.01)
    return both(tmp_path, MLPSpace(), ev, lambda: Groups([group]), name, None,
                td.executors.Ray(workers=2, allocation=allocation), **kw)


def step_time(sample):
    """A fixed profile (seconds per step), so that the shares do not depend on measured times: a
    trial's work is then its steps."""
    return 1e-3


def test_static_fluid_shares_are_the_ray_tasks_resource_requests(local_ray, digits_data, tmp_path, caplog):
    # four similar trials on two CPUs, none with half the work (a fixed profile: shares from
    # measured step times depend on the machine's load): each gets half a CPU (Ray packs two
    # tasks on one)
    group = [{"hidden": h, "epochs": e} for h in (4, 64) for e in (1, 2)]
    with caplog.at_level(logging.INFO, logger="tridens"):
        inline, on_ray = fluid_pair(tmp_path, digits_data, group, "static", StaticFluid(profile=step_time))
    assert_close(inline, on_ray)
    for t in on_ray:
        assert [a["share"] for a in t.info["allocation"]] == [0.5]
        assert t.info["ray"]["resources"] == {"CPU": 0.5}  # what Ray assigned to the running task
    assert caplog.text.count("fluid on Ray: trial") == 4 and "gets share 0.5 (num_cpus=0.5)" in caplog.text


def test_share_above_one_is_one_task_running_ddp(local_ray, digits_data, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tridens"):
        seen = SeenInStorage()
        inline, on_ray = fluid_pair(tmp_path, digits_data, [{"hidden": 64, "epochs": 2}], "ddp", "static",
                                    callbacks=[seen])
    assert_close(inline, on_ray)  # DDP over two processes trains as one process does
    (t,) = on_ray
    assert t.info["allocation"][0]["share"] == 2.0 and t.info["ray"]["resources"] == {"CPU": 2.0}
    assert "torch DDP over 2 local processes" in caplog.text
    assert seen.files[t.id] == ["epoch-2.pt", "final.pt"]


@pytest.mark.slow
def test_dynamic_fluid_relaunches_a_trial_at_a_new_share_from_its_checkpoint(local_ray, digits_data, tmp_path):
    # The big trial trains far longer than the small ones: it still has epochs left when they end.
    # (Whether it still has them depends on how fast Ray starts the small trials' workers: if it
    # finished first, nothing could move and the test says so instead of passing.)
    group = [{"hidden": 512, "epochs": 12}, {"hidden": 4, "epochs": 1}, {"hidden": 4, "epochs": 2}]
    inline, on_ray = fluid_pair(tmp_path, digits_data, group, "dyn", DynamicFluid(epsilon=0.0, profile=step_time))
    assert_close(inline, on_ray)
    big = on_ray[0]
    if big.finished_at < max(t.finished_at for t in on_ray[1:]):
        pytest.skip("the big trial ended before the small ones: no share to change on this run")
    shares = [a["share"] for a in big.info["allocation"]]
    assert shares[0] == 1.0 and shares[-1] == 2.0 and big.info["allocation"][-1]["from_epoch"] >= 1
    assert big.info["ray"]["resources"] == {"CPU": 2.0} and big.info["ray"]["attempt"] == len(shares) - 1


# -- a member's checkpoint, taken from a fused unit, resumes as a separate trainer -------------------
def _cnn(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Dropout(0.2), nn.Linear(128, 10))


def _frozen_prefix(seed):
    """The same frozen backbone (identical weights) under a head of the trial's own."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
    torch.manual_seed(seed)
    return nn.Sequential(backbone.requires_grad_(False), nn.Flatten(), nn.Linear(16 * 64, 10))


def _two_mlps(seed):
    """Different structures per trial: a shared pipeline of whole models (no batching, no prefix)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16 + seed), nn.ReLU(), nn.Linear(16 + seed, 10))


@pytest.mark.parametrize("kind, optimizer", [("batched", "sgd"), ("batched", "adam"), ("batched", "rmsprop"),
                                             ("prefix", "adam"), ("pipeline", "sgd")])
def test_member_checkpoint_of_a_fused_unit_resumes_as_a_separate_trainer(digits_data, kind, optimizer):
    from tridens.units import Job
    from tridens.trial import Trial
    from tridens.xopt._batching import BatchedUnit
    from tridens.xopt._cse import plan_cse

    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=3, batch_size=128, optimizer=optimizer,
                                      lr=td.choice("lr", [0.01, 0.003]), momentum=0.5, weight_decay=1e-4,
                                      schedule="cosine")
    build = {"batched": _cnn, "prefix": _frozen_prefix, "pipeline": _two_mlps}[kind]
    samples = [{"lr": 0.01}, {"lr": 0.003}]

    def jobs():
        return [Job(Trial(id=i + 1, sample=s, seed=10 + i), build(10 + i)) for i, s in enumerate(samples)]

    if kind == "batched":
        unit = BatchedUnit(jobs(), ev)
    else:
        (unit,), _ = plan_cse(jobs(), ev)
        assert ("frozen prefix" in unit.summary()) == (kind == "prefix")
    unit.train_epoch()
    states = {tid: unit.state_dict(tid) for tid in unit.jobs}
    fused = [unit.train_epoch(), unit.train_epoch()]
    for job in jobs():
        tid = job.trial.id
        trainer = ev.trainer(job.model, job.trial.sample, job.trial.seed)
        trainer.load_state_dict(states[tid])
        for epoch in range(2):
            train_metrics = trainer.train_epoch()
            metrics = {**trainer.validate(), **train_metrics}
            for name, value in metrics.items():
                assert fused[epoch][tid][name] == pytest.approx(value, rel=1e-4, abs=1e-4), (tid, epoch, name)
