"""Activation variants: models that differ only in their activation modules train as one fused
unit, each row applying its own activation, equal to separate training."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.units import Decisions, SeparateUnit
from tridens.xopt import BatchingSettings
from tridens.xopt._batching import BatchedUnit, _structure_keys, plan_batching

from .test_batching import SAMPLES, Cast, assert_close_runs, assert_same_trials, evaluator, json_key, make_jobs, run


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


def mlp(act, dtype=torch.float64, width=32):
    def build(p):
        return nn.Sequential(Cast(dtype), nn.Flatten(), nn.Linear(64, width), act(), nn.Dropout(p),
                             nn.Linear(width, 32), act(), nn.Linear(32, 10)).to(dtype)
    return build


def cnn(act, dtype=torch.float64):
    """Activations on channel-packed maps, one right before a 2x2 max-pool (which the grouped
    program otherwise folds a ReLU into)."""
    def build(p):
        return nn.Sequential(Cast(dtype), nn.Conv2d(1, 8, 3, padding=1), act(), nn.Conv2d(8, 8, 3, padding=1), act(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(p), nn.Linear(128, 10)).to(dtype)
    return build


def on_input(act, dtype=torch.float64):
    """An activation of the shared input itself: the grouped program cannot apply it per model."""
    def build(p):
        return nn.Sequential(Cast(dtype), nn.Flatten(), act(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(p),
                             nn.Linear(16, 10)).to(dtype)
    return build


class SlopedReLU(nn.ReLU):
    """A subclass of an activation: its forward may be anything, so it is not a variant of ReLU."""

    def forward(self, x):
        return super().forward(x) * 2


def keys(builders):
    return _structure_keys(make_jobs((SAMPLES * 2)[:len(builders)], builders), Decisions())


def test_models_differing_only_in_activations_share_a_structure_key():
    a, b, c, d, wide, wide_tanh, sub, sub_again = keys([
        mlp(nn.ReLU), mlp(nn.Tanh), mlp(lambda: nn.LeakyReLU(0.2)), mlp(nn.GELU),
        mlp(nn.ReLU, width=48), mlp(nn.Tanh, width=48), mlp(SlopedReLU), mlp(SlopedReLU)])
    assert a == b == c == d and isinstance(a, str)
    assert wide == wide_tanh != a  # another width: another structure
    assert sub == sub_again != a


def test_the_structure_key_leaves_the_model_as_it_was():
    jobs = make_jobs(SAMPLES[:2], [mlp(nn.Tanh), mlp(nn.ReLU)])
    before = [[type(m) for m in job.model.modules()] for job in jobs]
    _structure_keys(jobs, Decisions())
    assert [[type(m) for m in job.model.modules()] for job in jobs] == before


@pytest.mark.parametrize("engine", ["grouped kernels", "per model", "vmap"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mixed_activations_fused_equal_separate(data, optimizer, engine):
    """float64: fused and separate agree to rounding (~1e-12), with a trial leaving after its
    first epoch (the rows of each activation shrink)."""
    builders = [mlp(nn.ReLU), mlp(nn.Tanh), mlp(nn.ReLU), mlp(nn.GELU)]
    ev = evaluator(data, optimizer, epochs=2)
    separate = run(SeparateUnit(make_jobs(SAMPLES, builders), ev), stop={0: 1})
    unit = BatchedUnit(make_jobs(SAMPLES, builders), ev, settings=BatchingSettings(packed=engine == "grouped kernels", exact=engine != "vmap"))
    assert unit.member.ids == [0, 2, 1, 3]  # each activation's rows together
    fused = run(unit, stop={0: 1})
    assert_close_runs(separate, fused, 1e-9, weight_tol=1e-9)
    assert unit.member.engine == engine
    assert [len(h) for _, h in sorted(fused[0].items())] == [1, 2, 2, 2]


@pytest.mark.parametrize("engine", ["grouped kernels", "per model", "vmap"])
def test_mixed_activations_on_feature_maps(data, engine):
    builders = [cnn(nn.Tanh), cnn(nn.ReLU), cnn(nn.Tanh), cnn(nn.SiLU)]
    ev = evaluator(data, "sgd", epochs=1)
    unit = BatchedUnit(make_jobs(SAMPLES, builders), ev, settings=BatchingSettings(packed=engine == "grouped kernels", exact=engine != "vmap"))
    assert_close_runs(run(SeparateUnit(make_jobs(SAMPLES, builders), ev)), run(unit), 1e-9, weight_tol=1e-9)
    assert unit.member.engine == engine


def test_mixed_activations_on_the_shared_input_run_per_model(data):
    builders = [on_input(nn.Tanh), on_input(nn.Sigmoid)]
    ev = evaluator(data, "sgd", epochs=1)
    unit = BatchedUnit(make_jobs(SAMPLES[:2], builders), ev)
    assert_close_runs(run(SeparateUnit(make_jobs(SAMPLES[:2], builders), ev)), run(unit), 1e-9, weight_tol=1e-9)
    assert unit.member.engine == "per model" and "shared input" in unit.member.why_vmap


def test_planner_fuses_activation_variants_in_one_unit(data, caplog):
    force = td.xopt.Settings().with_batching(mode="force")
    jobs = make_jobs(SAMPLES * 2, [mlp(nn.ReLU), mlp(nn.Tanh)] * 4)
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, rest = plan_batching(jobs, evaluator(data, "sgd"), settings=force)
    assert rest == [] and len(units) == 1
    assert units[0].member.ids == [0, 2, 4, 6, 1, 3, 5, 7]


class ActivationSpace(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        act = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}[td.choice("act", ["relu", "tanh", "gelu"])]
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 24), act(), nn.Linear(24, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def test_experiment_over_an_activation_choice_fuses_and_equals_optimize_false(data, tmp_path, caplog):
    """A user's space with an activation choice: every trial of the grid trains in one fused unit,
    with the metrics each trial gets alone."""
    train, val = data
    ev = td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="adam",
                                      lr=td.choice("lr", [1e-3, 3e-3]))
    results = {}
    for optimize in (False, True):
        force = td.xopt.Settings().with_batching(mode="force")
        exp = td.Experiment(ActivationSpace(), ev, td.strategy.GridSearch(), budget=6,
                            store=tmp_path / f"{optimize}.db", name="act",
                            executor=td.executors.Inline(optimize=force if optimize else False),
                            options=td.RunOptions(verbose=False, seed=5))
        with caplog.at_level(logging.INFO, logger="tridens"):
            exp.run()
        results[optimize] = {json_key(t.sample): t for t in exp.trials()}
    assert "batched unit of 6" in caplog.text
    assert_same_trials(results[False], results[True], 6)
