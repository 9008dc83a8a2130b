"""The planner across optimizations: one max_unit_memory for batching and CSE (from td.Experiment),
mixed units built automatically (batched groups inside one shared pipeline), equal to separate."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.executors._planner import plan
from tridens.units import PlanContext, SeparateUnit, parse_memory, resolve_max_unit_memory
from tridens.trial import TrialStatus
from tridens.xopt import Settings
from tridens.xopt._batching import BatchedMember, BatchedUnit
from tridens.xopt._cse import SharedPipelineUnit

from .test_batching import TOL, assert_close_runs, cnn, evaluator, make_jobs, mlp, run


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


@pytest.fixture
def force():
    """Settings that fuse every compatible group, whatever fusion measures."""
    return Settings().with_batching(mode="force")


def test_parse_memory():
    assert parse_memory(None) is None
    assert parse_memory(4096) == 4096
    assert parse_memory("2GiB") == 2 * 2**30
    assert parse_memory("512 MiB") == 512 * 2**20
    assert parse_memory("1.5GB") == 1_500_000_000
    assert parse_memory("3g") == 3 * 2**30
    assert parse_memory("100") == 100
    for bad in (0, -5, True, 2.5, "", "lots", "2 parsecs", "-1GiB", [1]):
        with pytest.raises(ValueError, match="'max_unit_memory' parameter of Experiment"):
            parse_memory(bad)


def test_one_bound_resolved_in_order(monkeypatch):
    monkeypatch.delenv("TRIDENS_MAX_UNIT_MEMORY", raising=False)
    default = resolve_max_unit_memory(None)
    assert default > 0
    monkeypatch.setenv("TRIDENS_MAX_UNIT_MEMORY", "3MiB")
    assert resolve_max_unit_memory(None) == 3 * 2**20
    run = PlanContext(max_unit_memory=1024)  # the experiment's value wins over the environment
    assert run.memory_bound("cpu") == 1024
    assert run.memory_bound("cpu", 77) == 77  # an explicit argument wins over both
    assert PlanContext().memory_bound("cpu") == 3 * 2**20


def test_experiment_validates_max_unit_memory(data, tmp_path):
    train, val = data
    ev = td.evaluators.Classification(train, val, epochs=1, batch_size=64, lr=0.05)
    exp = td.Experiment(HpSpace(), ev, td.strategy.GridSearch(), budget=2, store=tmp_path / "x.db",
                        executor=td.executors.Inline(max_unit_memory="two gigs"),
                        options=td.RunOptions(verbose=False))
    with pytest.raises(ValueError, match=r"The 'max_unit_memory' parameter of Experiment .* Got 'two gigs' instead"):
        exp.run()


class HpSpace(tnn.ModelSpace):
    """Two structures (width) x a dropout rate and an lr: same-shaped groups to batch."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [16, 32])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, w, bias=False), nn.BatchNorm1d(w), nn.ReLU(),
                                  nn.Dropout(td.choice("p", [0.0, 0.3])), nn.Linear(w, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def _experiment(data, tmp_path, name, optimize, max_unit_memory=None):
    train, val = data
    ev = td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="sgd",
                                      lr=td.choice("lr", [0.1, 0.03]))
    exp = td.Experiment(HpSpace(), ev, td.strategy.GridSearch(), budget=8, store=tmp_path / f"{name}.db", name=name,
                        executor=td.executors.Inline(optimize=optimize, max_unit_memory=max_unit_memory),
                        options=td.RunOptions(verbose=False, seed=5))
    exp.run()
    return {tuple(sorted(t.sample.items())): t for t in exp.trials()}


def test_experiment_max_unit_memory_reaches_the_planners(data, force, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tridens"):
        tiny = _experiment(data, tmp_path, "tiny", force, max_unit_memory="1KiB")
    # nothing fits in 1 KiB: batching says so, and CSE splits into one unit per trial
    assert "max_unit_memory is 0 MiB" in caplog.text and "batched unit of" not in caplog.text
    assert "max_unit_memory 0.0 MiB" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tridens"):
        roomy = _experiment(data, tmp_path, "roomy", force, max_unit_memory=2**30)
    assert "mixed unit" in caplog.text and "max_unit_memory 1024.0 MiB" in caplog.text
    separate = _experiment(data, tmp_path, "separate", False)
    assert tiny.keys() == roomy.keys() == separate.keys() and len(separate) == 8
    for key, a in separate.items():
        for other in (tiny[key], roomy[key]):
            assert a.status is TrialStatus.COMPLETED and other.status is TrialStatus.COMPLETED
            for metric in a.metrics:
                assert all(abs(x - y) <= TOL for x, y in zip(a.metrics[metric], other.metrics[metric])), (key, metric)


class Counter:
    """An augmentation (random flip of whole rows) that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        flip = torch.rand(x.shape[0]) < 0.5
        return torch.where(flip.view(-1, *([1] * (x.dim() - 1))), x.flip(-1), x)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_planner_builds_mixed_units_equal_to_separate(data, force, optimizer, caplog):
    """Two same-shaped CNNs (dropout, BatchNorm), two same-shaped MLPs and one other MLP on one
    augmented pipeline: plan() makes ONE shared-pipeline unit holding both batched groups and the
    lone trainer; metrics and weights as separate training's, augmentation once per batch."""
    aug = Counter()
    ev = evaluator(data, optimizer, transforms=aug)
    samples = [dict(lr=0.05, m=0.9, wd=0.0, s="constant", p=0.0), dict(lr=0.01, m=0.5, wd=1e-3, s="cosine", p=0.3),
               dict(lr=0.02, m=0.8, wd=1e-3, s="step", p=0.2), dict(lr=0.03, m=0.0, wd=0.0, s="rex", p=0.1),
               dict(lr=0.04, m=0.9, wd=1e-4, s="constant", p=0.2)]
    if optimizer == "adam":
        for s in samples:
            s["lr"] /= 10
    builders = [cnn, cnn, mlp, mlp, lambda p: mlp(p, out=10)[:-1].append(nn.Linear(48, 20)).append(nn.Linear(20, 10))]

    separate = run(SeparateUnit(make_jobs(samples, builders), ev), stop={3: 1})
    with caplog.at_level(logging.INFO, logger="tridens"):
        units = plan(make_jobs(samples, builders), ev, optimize=force)
    assert len(units) == 1 and isinstance(units[0], SharedPipelineUnit)
    unit = units[0]
    assert sum(isinstance(m, BatchedMember) for m in unit.members) == 2
    assert "mixed unit, one data pipeline for 3 planned units" in caplog.text
    aug.calls = 0  # (the planner augmented the first batch to measure on it)
    fused = run(unit, stop={3: 1})
    assert aug.calls == unit.counts["batches"] == 2 * -(-len(data[0]) // 64)
    assert_close_runs(separate, fused, weight_tol=2e-3)


def test_memory_bound_keeps_batched_units_apart(data, force):
    ev = evaluator(data, "sgd", transforms=Counter())
    units = plan(make_jobs([dict(lr=0.05, m=0.9, wd=0.0, s="constant", p=0.1)] * 2, mlp)
                 + make_jobs([dict(lr=0.05, m=0.9, wd=0.0, s="constant", p=0.1)] * 2, cnn), ev, optimize=force)
    assert sum(isinstance(u, SharedPipelineUnit) for u in units) == 1  # roomy default: merged
    first = [u for u in plan(make_jobs([dict(lr=0.05, m=0.9, wd=0.0, s="constant", p=0.1)] * 2, cnn), ev,
                             optimize=force) if isinstance(u, BatchedUnit)][0]
    assert first.memory and first.memory > 0
    units = plan(make_jobs([dict(lr=0.05, m=0.9, wd=0.0, s="constant", p=0.1)] * 2, mlp)
                 + make_jobs([dict(lr=0.05, m=0.9, wd=0.0, s="constant", p=0.1)] * 2, cnn), ev, optimize=force,
                 max_unit_memory=first.memory)
    assert [type(u).__name__ for u in units] == ["BatchedUnit", "BatchedUnit"]


def test_a_jobs_config_is_resolved_once_from_the_sample_it_trains_with(data):
    """``job.config(evaluator)``: resolved once (the same object every time), from the fork's
    hyperparameters after a PBT fork (``job.hparams``), an invalid sample's error raised each time."""
    from tridens.errors import InvalidSample
    from tridens.trial import Trial
    from tridens.units import Job

    train, val = data
    ev = td.evaluators.Classification(train, val, epochs=2, lr=td.choice("lr", [0.1, 0.5]),
                                      optimizer=td.choice("optimizer", ["sgd", "adam"]))
    job = Job(Trial(id=1, sample={"lr": 0.1, "optimizer": "sgd"}, seed=0), model=None)
    job.resolve_config(ev)   # what the engine does when it makes the job
    cfg = job.config(ev)
    assert cfg.lr == 0.1 and job.config(ev) is cfg
    job.hparams = {"lr": 0.5, "optimizer": "adam"}   # a PBT fork continues with other hyperparameters
    assert (job.config(ev).lr, job.config(ev).optimizer) == (0.5, "adam")
    bad = Job(Trial(id=2, sample={"lr": 0.1, "optimizer": "lbfgs"}, seed=0), model=None)
    for _ in range(2):
        with pytest.raises(InvalidSample, match="lbfgs"):
            bad.config(ev)
