"""Operator batching: K same-shaped models as one vectorized model, equal to separate training."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.units import Decisions, Job, SeparateUnit
from tridens.evaluators import NonFiniteLoss
from tridens.trial import Trial, TrialStatus
from tridens.xopt import _batching
from tridens.xopt import BatchingSettings, Settings
from tridens.xopt._batching import BatchedMember, BatchedUnit, plan_batching

from .test_cse import RandomCropFlip

TOL = 1e-4


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


@pytest.fixture
def force():
    """Settings that fuse every compatible group, whatever fusion measures."""
    return Settings().with_batching(mode="force")


class Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def cnn(p: float, dtype=torch.float32, input_bn: bool = False) -> nn.Module:
    """A small CNN with BatchNorm (convs without bias: a bias before BatchNorm gets only rounding
    noise as gradient, which Adam amplifies into chaos) and element-wise and channel dropout."""
    layers = [Cast(dtype)] + ([nn.BatchNorm2d(1)] if input_bn else []) + [
        nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout2d(p / 2),
        nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(p), nn.Linear(256, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 10)]
    return nn.Sequential(*layers).to(dtype)


def mlp(p: float, dtype=torch.float32, out: int = 10) -> nn.Module:
    return nn.Sequential(Cast(dtype), nn.Flatten(), nn.Linear(64, 48, bias=False), nn.BatchNorm1d(48), nn.ReLU(), nn.Dropout(p),
                         nn.Linear(48, out)).to(dtype)


SAMPLES = [dict(lr=0.05, m=0.9, wd=0.0, s="constant", p=0.0),
           dict(lr=0.1, m=0.5, wd=1e-3, s="cosine", p=0.3),
           dict(lr=0.01, m=0.0, wd=1e-2, s="rex", p=0.5),
           dict(lr=0.02, m=0.8, wd=1e-3, s="step", p=0.2)]
ADAPTIVE = [dict(lr=0.005, m=0.9, wd=0.0, s="constant", p=0.0),
            dict(lr=0.01, m=0.5, wd=1e-3, s="cosine", p=0.3),
            dict(lr=0.002, m=0.8, wd=1e-4, s="linear", p=0.1),
            dict(lr=0.0003, m=0.9, wd=1e-3, s="constant", p=0.2)]


def evaluator(data, optimizer, epochs=2, task=td.evaluators.Classification, **kw):
    train, val = data
    if task is td.evaluators.Regression:
        train, val = (torch.utils.data.TensorDataset(d.tensors[0], d.tensors[1].float()) for d in (train, val))
    return task(train, val, epochs=epochs, batch_size=64, optimizer=optimizer,
                lr=td.loguniform("lr", 1e-6, 1e30), momentum=td.uniform("m", 0.0, 0.99),
                weight_decay=td.uniform("wd", 0.0, 1.0), schedule=td.choice("s", ["constant", "cosine", "rex", "step", "linear"]),
                **kw)


def make_jobs(samples, build, max_steps=None):
    """One job per sample; ``build``: one model builder for all, or a list of one per sample."""
    builders = build if isinstance(build, (list, tuple)) else [build] * len(samples)
    jobs = []
    for i, (s, b) in enumerate(zip(samples, builders, strict=True)):
        torch.manual_seed(100 + i)
        jobs.append(Job(Trial(id=i, sample=s, seed=100 + i), b(s["p"]), max_steps))
    return jobs


def run(unit, stop=None):
    """Drive a unit like the executor: per trial, its per-epoch results and final weights."""
    history, weights = {}, {}
    while unit.active():
        for tid, result in unit.train_epoch().items():
            history.setdefault(tid, []).append(result)
            if isinstance(result, BaseException):
                unit.drop(tid)
        for job in unit.active():
            tid = job.trial.id
            if unit.epoch(tid) >= unit.limit(tid) or (stop and stop.get(tid) == unit.epoch(tid)):
                weights[tid] = unit.weights(tid)
                unit.drop(tid)
    return history, weights


def assert_close_runs(a, b, tol=TOL, weight_tol=None):
    assert a[0].keys() == b[0].keys()
    for tid in a[0]:
        ea, eb = a[0][tid], b[0][tid]
        assert len(ea) == len(eb)
        for ra, rb in zip(ea, eb):
            if isinstance(ra, BaseException):
                assert type(ra) is type(rb) and (ra.epoch, ra.batch) == (rb.epoch, rb.batch), (ra, rb)
                continue
            assert list(ra) == list(rb)  # same metric names, same order (objective first)
            for k in ra:
                assert abs(ra[k] - rb[k]) <= tol, (tid, k, ra[k], rb[k])
    assert a[1].keys() == b[1].keys()
    for tid in a[1]:
        assert list(a[1][tid]) == list(b[1][tid])  # the same keys as the separate model's state_dict
        if weight_tol is not None:
            for k, v in a[1][tid].items():
                torch.testing.assert_close(b[1][tid][k], v, atol=weight_tol, rtol=weight_tol, msg=f"{tid} {k}")


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw", "rmsprop"])
def test_fused_equals_separate_float32(data, optimizer):
    samples = SAMPLES if optimizer == "sgd" else ADAPTIVE
    if optimizer == "rmsprop":  # no bias correction: its first steps are 10x larger
        samples = [dict(s, lr=s["lr"] / 30) for s in samples]
    ev = evaluator(data, optimizer)
    separate = run(SeparateUnit(make_jobs(samples, cnn), ev))
    unit = BatchedUnit(make_jobs(samples, cnn), ev)
    fused = run(unit)
    assert_close_runs(separate, fused, TOL, weight_tol=2e-3)
    assert all(len(h) == 2 for h in fused[0].values())
    assert unit.member.engine == "grouped kernels"


def test_fused_equals_separate_on_a_dataset_augmenting_per_example(data):
    # the fused unit reads the dataset once per batch; its random transforms follow the data seed
    # (float64: any other augmentation would show far above the rounding left, ~1e-12)
    train, val = data
    images = RandomCropFlip(train)
    ev = evaluator((images, val), "sgd")

    def build(p):
        return cnn(p, torch.float64)

    torch.manual_seed(1)
    separate = run(SeparateUnit(make_jobs(SAMPLES, build), ev))
    separate_reads, images.reads = images.reads, 0
    torch.manual_seed(2)
    fused = run(BatchedUnit(make_jobs(SAMPLES, build), ev))
    assert_close_runs(separate, fused, 1e-9, weight_tol=1e-9)
    # once per batch, plus the one example the grouped program is traced on
    assert separate_reads == len(SAMPLES) * 2 * len(train) and images.reads == 2 * len(train) + 1


@pytest.fixture(params=["grouped kernels", "vmap"])
def engine(request):
    return request.param


def test_fused_equals_separate_vmap_engine(data, monkeypatch):
    """The same with the vmap engine (inexact settings' fallback for models the grouped program
    does not cover): to rounding."""
    ev = evaluator(data, "adamw")
    unit = BatchedUnit(make_jobs(ADAPTIVE, cnn), ev, settings=BatchingSettings(packed=False, exact=False))
    assert_close_runs(run(SeparateUnit(make_jobs(ADAPTIVE, cnn), ev)), run(unit), TOL, weight_tol=2e-3)
    assert unit.member.engine == "vmap"


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw", "rmsprop"])
def test_fused_equals_separate_float64_to_rounding(data, optimizer, engine):
    """Inexact settings (kernels over all K models at once): in float64 the two agree to ~1e-12,
    rounding only (tests/xopt/test_exact.py: exact settings, bit for bit)."""
    samples = [dict(s, lr=s["lr"] / (1 if optimizer == "sgd" else 2)) for s in SAMPLES]

    def build(p):
        return mlp(p, torch.float64)

    def build_cnn(p):
        return cnn(p, torch.float64)

    ev = evaluator(data, optimizer, epochs=1)
    for b in (build, build_cnn) if optimizer in ("sgd", "adamw") else (build,):
        unit = BatchedUnit(make_jobs(samples, b), ev, settings=BatchingSettings(packed=engine == "grouped kernels",
                                                                                exact=False))
        assert_close_runs(run(SeparateUnit(make_jobs(samples, b), ev)), run(unit), 1e-9, weight_tol=1e-9)
        assert unit.member.engine == engine


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_fused_adam_kernel_equals_separate_float64(data, optimizer):
    """Models sharing Adam's beta1 (the case a fused Adam kernel over the stack would take): the same
    training as torch.optim's Adam per model, also after a model leaves the stack."""
    samples = [dict(s, m=0.9, lr=s["lr"] / 2) for s in SAMPLES]

    def build(p):
        return mlp(p, torch.float64)

    ev = evaluator(data, optimizer, epochs=2)
    unit = BatchedUnit(make_jobs(samples, build), ev)
    fused = run(unit, stop={1: 1})
    separate = run(SeparateUnit(make_jobs(samples, build), ev), stop={1: 1})
    assert [len(fused[0][t]) for t in range(4)] == [2, 1, 2, 2]
    assert_close_runs(separate, fused, 1e-9, weight_tol=1e-9)
    steps = 2 * math.ceil(len(data[0]) / 64)
    assert set(unit.member.optimizer.steps.values()) == {steps}


class InPlaceGain(nn.Module):
    """Scales a copy of its input in place by a parameter: with the input shared by the models
    (not batched) vmap cannot write batched values into it."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x):
        out = x.clone()
        out.mul_(self.gain)
        return out


def test_regression_metrics_and_unshared_input(data):
    """Regression's val_mse/val_mae; a model that cannot share its input gets its own copy."""
    ev = evaluator(data, "sgd", task=td.evaluators.Regression, loss="huber")

    def build(p):
        return nn.Sequential(InPlaceGain(), nn.BatchNorm2d(1), mlp(p, out=1))

    fused_unit = BatchedUnit(make_jobs(SAMPLES[:3], build), ev, settings=BatchingSettings(exact=False))
    fused = run(fused_unit)
    assert fused_unit.member.shared_input is False and fused_unit.member.engine == "vmap"
    assert_close_runs(run(SeparateUnit(make_jobs(SAMPLES[:3], build), ev)), fused, TOL, weight_tol=1e-3)
    assert set(fused[0][0][0]) == {"val_mse", "val_mae", "train_loss"}


def test_stopped_model_leaves_without_disturbing_the_others(data):
    ev = evaluator(data, "sgd", epochs=3)
    full = run(BatchedUnit(make_jobs(SAMPLES, mlp), ev))
    stopped = run(BatchedUnit(make_jobs(SAMPLES, mlp), ev), stop={1: 1, 3: 2})
    separate = run(SeparateUnit(make_jobs(SAMPLES, mlp), ev), stop={1: 1, 3: 2})
    assert [len(stopped[0][t]) for t in range(4)] == [3, 1, 3, 2]
    assert_close_runs(separate, stopped, TOL, weight_tol=1e-3)
    for tid in (0, 2):  # the models that stayed: the same as when nobody left
        for a, b in zip(full[0][tid], stopped[0][tid]):
            assert all(abs(a[k] - b[k]) <= TOL for k in a)


def test_budgets_differ_within_a_unit(data):
    """A trial with a smaller max_steps finishes early; its weights are those of its last epoch."""
    ev = evaluator(data, "adam", epochs=2)
    jobs = make_jobs(ADAPTIVE[:2], mlp)
    jobs[0].max_steps = 1
    fused = run(BatchedUnit(jobs, ev))
    jobs = make_jobs(ADAPTIVE[:2], mlp)
    jobs[0].max_steps = 1
    assert_close_runs(run(SeparateUnit(jobs, ev)), fused, TOL, weight_tol=1e-3)
    assert len(fused[0][0]) == 1 and len(fused[0][1]) == 2


def plain(p: float) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 10))


def test_nan_model_fails_alone(data):
    samples = [*SAMPLES[:3], dict(lr=1e12, m=0.9, wd=0.0, s="constant", p=0.1)]
    ev = evaluator(data, "sgd")
    separate = run(SeparateUnit(make_jobs(samples, plain), ev))
    fused = run(BatchedUnit(make_jobs(samples, plain), ev))
    err = fused[0][3][-1]
    assert isinstance(err, NonFiniteLoss) and "the trial failed" in str(err)
    assert isinstance(separate[0][3][-1], NonFiniteLoss)
    assert_close_runs(separate, fused, TOL, weight_tol=2e-3)
    assert 3 not in fused[1] and {0, 1, 2} <= fused[1].keys()


def test_member_protocol_and_weights_keys(data):
    """BatchedMember can be fed by another driver (a shared pipeline) batch by batch."""
    ev = evaluator(data, "sgd", epochs=1)
    jobs = make_jobs(SAMPLES[:2], cnn)
    keys = list(jobs[0].model.state_dict())
    member = BatchedMember(jobs, ev)
    assert member.trial_ids() == [0, 1] and member.wants_epoch()
    member.begin_epoch()
    x, y = data[0].tensors[0][:64], data[0].tensors[1][:64]
    losses = member.train_batch(x, y, 0)
    assert set(losses) == {0, 1} and all(math.isfinite(v) for v in losses.values())
    train = member.end_epoch()
    member.begin_validation()
    member.validate_batch(x, y)
    val = member.end_validation()
    assert set(train[0]) == {"train_loss"} and set(val[1]) == {"val_acc", "val_loss"}
    assert list(member.weights(1)) == keys and not member.wants_epoch()
    member.leave(0)
    assert member.trial_ids() == [1] and list(member.weights(1)) == keys


class RandomForward(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.body = mlp(p)

    def forward(self, x):
        return self.body(x + 0.01 * torch.randn_like(x))


class HpSpace(tnn.ModelSpace):
    """A width choice (two structures) and a dropout-rate choice (same structure)."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [16, 32])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, w, bias=False), nn.BatchNorm1d(w), nn.ReLU(),
                                  nn.Dropout(td.choice("p", [0.0, 0.2, 0.4])), nn.Linear(w, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def test_planner_groups_by_structure_and_setup(data, force, caplog):
    ev = td.evaluators.Classification(*data, epochs=1, batch_size=64, lr=td.choice("lr", [0.1, 0.05]),
                                      optimizer=td.choice("opt", ["sgd", "adam"]))
    jobs = []
    for i, (width, p, lr, opt) in enumerate([(16, 0.0, 0.1, "sgd"), (16, 0.4, 0.05, "sgd"), (32, 0.2, 0.1, "sgd"),
                                             (32, 0.0, 0.05, "sgd"), (16, 0.2, 0.1, "adam"), (32, 0.2, 0.1, "sgd")]):
        sample = {"width": width, "p": p, "lr": lr, "opt": opt}
        torch.manual_seed(i)
        jobs.append(Job(Trial(id=i, sample=sample, seed=i), HpSpace().freeze({"width": width, "p": p})))
    jobs.append(Job(Trial(id=9, sample={"width": 16, "p": 0.0, "lr": 0.1, "opt": "sgd"}, seed=9), RandomForward()))
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, rest = plan_batching(jobs, ev, settings=force)
    assert sorted(sorted(u.jobs) for u in units) == [[0, 1], [2, 3, 5]]
    assert [j.trial.id for j in rest] == [4, 9]
    text = caplog.text
    assert "trial 4 not fused: different optimizer" in text
    assert "trial 9 not fused: no other trial with the same model structure" in text
    assert "fused: forced" in units[0].summary()


def _same_named_net(negate: bool) -> type[nn.Module]:
    """A class named ``Net`` whose forward negates or not: two calls give classes with equal names,
    modules and attributes but different forwards (a class defined again, as in a notebook)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 10)

        def forward(self, x):
            out = self.fc(x.flatten(1))
            return out.neg() if negate else out

    return Net


def test_structure_keys_are_kept_across_plans_per_class(data, force):
    # a later plan of the same kind of model reuses the traced key; a class defined again is traced again
    plain, negated = _same_named_net(False), _same_named_net(True)

    def jobs(cls, first):
        return [Job(Trial(id=first + i, sample={"lr": 0.1}, seed=i), cls()) for i in range(2)]

    decisions = Decisions()   # one run's
    first = _batching._structure_keys(jobs(plain, 0), decisions)
    again = _batching._structure_keys(jobs(plain, 2), decisions)
    other = _batching._structure_keys(jobs(negated, 4), decisions)
    assert first[0] == first[1] == again[0] == again[1]
    assert other[0] == other[1] != first[0]
    ev = td.evaluators.Classification(*data, epochs=1, batch_size=64, lr=0.1)
    units, rest = plan_batching(jobs(plain, 6) + jobs(negated, 8), ev, settings=force)
    assert sorted(sorted(u.jobs) for u in units) == [[6, 7], [8, 9]] and not rest


def test_planner_respects_max_unit_memory(data, force, caplog):
    ev = evaluator(data, "sgd", epochs=1)
    probe = BatchedMember(make_jobs(SAMPLES[:2], cnn), ev)
    one = _batching._per_model_bytes(probe, data[0].tensors[0][:64])
    units, rest = plan_batching(make_jobs(SAMPLES * 2, cnn), ev, settings=force, max_unit_memory=int(3.5 * one))
    assert sorted(len(u.jobs) for u in units) == [2, 3, 3] and rest == []
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, rest = plan_batching(make_jobs(SAMPLES, cnn), ev, settings=force, max_unit_memory=one)
    assert units == [] and len(rest) == 4 and "max_unit_memory" in caplog.text


def test_random_ops_in_forward_are_not_fused(data, force, caplog):
    ev = evaluator(data, "sgd", epochs=1)
    jobs = [Job(Trial(id=i, sample=SAMPLES[i], seed=i), RandomForward()) for i in range(2)]
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, rest = plan_batching(jobs, ev, settings=force)
    assert units == [] and len(rest) == 2 and "do not vectorize" in caplog.text


def test_mode_off_and_user_loops(data, force, monkeypatch):
    ev = evaluator(data, "sgd", epochs=1)
    assert plan_batching(make_jobs(SAMPLES, mlp), ev, settings=Settings().with_batching(mode="off"))[0] == []
    monkeypatch.setenv("TRIDENS_BATCHING", "off")  # the environment's settings, when none are given
    assert plan_batching(make_jobs(SAMPLES, mlp), ev)[0] == []
    functional = td.evaluators.FunctionalEvaluator(lambda model: 0.5)
    assert plan_batching(make_jobs(SAMPLES, mlp), functional, settings=force)[0] == []


def test_experiment_optimize_true_equals_false(data, force, tmp_path, caplog):
    train, val = data
    ev = td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="sgd",
                                      lr=td.choice("lr", [0.1, 0.05, 0.02]),
                                      weight_decay=td.choice("wd", [0.0, 1e-3]))
    results = {}
    for optimize in (False, True):
        exp = td.Experiment(HpSpace(), ev, td.strategy.GridSearch(), budget=12, store=tmp_path / f"{optimize}.db",
                            name="hp", executor=td.executors.Inline(optimize=force if optimize else False),
                            options=td.RunOptions(verbose=False, seed=3))
        with caplog.at_level(logging.INFO, logger="tridens"):
            exp.run()
        results[optimize] = {json_key(t.sample): t for t in exp.trials()}
    assert "batched unit of" in caplog.text
    assert_same_trials(results[False], results[True], 12)


def json_key(sample):
    return tuple(sorted(sample.items()))


def assert_same_trials(alone, optimized, count):
    """Two runs' trials (by sample) all completed, with the same seeds and per-epoch metrics."""
    assert optimized.keys() == alone.keys() and len(alone) == count
    for key, a in alone.items():
        b = optimized[key]
        assert a.status is TrialStatus.COMPLETED and b.status is TrialStatus.COMPLETED and a.seed == b.seed
        assert a.metrics.keys() == b.metrics.keys()
        for name in a.metrics:
            assert all(abs(x - y) <= TOL for x, y in zip(a.metrics[name], b.metrics[name])), (key, name)
