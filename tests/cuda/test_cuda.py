"""The CUDA paths: fused training equal to separate training on the GPU (operator batching, the
shared pipeline, a frozen prefix, a stage tree), a NaN member leaving its unit, a batched member's
checkpoint continued by a separate trainer, the memory bound against GPU memory, the device chosen
by itself, and the store and the dashboard unchanged by a run on the GPU.

Marked ``cuda``: they skip cleanly without a CUDA device. ``TRIDENS_TEST_DEVICE=cpu`` runs them on
the CPU instead, a dry run of the tests themselves (``bench/gpu_check.sh --device cpu`` does that).
TF32 is switched off while they run: with it on, convolutions round to 10-bit mantissas and a
fused (grouped) convolution rounds differently from K separate ones, far above float32 rounding.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import tridens as td
from tridens.dashboard import StoreReader
from tridens.evaluators import NonFiniteLoss
from tridens.trial import Trial
from tridens.units import Job, SeparateUnit, default_max_unit_memory, resolve_max_unit_memory
from tridens.xopt import BatchedUnit, StageTreeUnit, plan_batching, plan_cse, plan_stage_trees

from ..xopt.test_batching import ADAPTIVE, SAMPLES, assert_close_runs, cnn, make_jobs, mlp, run
from ..xopt.test_cse import ARCHS, assert_same, assert_same_weights, drive, head_makers, jobs_for

DEVICE = torch.device(os.environ.get("TRIDENS_TEST_DEVICE", "cuda"))
ON_GPU = DEVICE.type == "cuda"

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = 1e-4


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


@pytest.fixture(autouse=True)
def no_tf32():
    if not ON_GPU:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def evaluator(data, optimizer, epochs=2, **kw):
    train, val = data
    return td.evaluators.Classification(
        train, val, epochs=epochs, batch_size=64, optimizer=optimizer, device=DEVICE,
        lr=td.loguniform("lr", 1e-6, 1e30), momentum=td.uniform("m", 0.0, 0.99),
        weight_decay=td.uniform("wd", 0.0, 1.0), schedule=td.choice("s", ["constant", "cosine", "rex", "step", "linear"]),
        **kw)


def samples_for(optimizer):
    samples = SAMPLES if optimizer == "sgd" else ADAPTIVE
    if optimizer == "rmsprop":  # no bias correction: its first steps are 10x larger
        samples = [dict(s, lr=s["lr"] / 30) for s in samples]
    return samples


def on_device(weights):
    return all(v.device.type == DEVICE.type for w in weights.values() for v in w.values() if torch.is_tensor(v))


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw", "rmsprop"])
@pytest.mark.parametrize("model", ["cnn", "mlp"])
def test_batched_equals_separate_float32(data, optimizer, model):
    build = {"cnn": cnn, "mlp": mlp}[model]
    ev = evaluator(data, optimizer)
    samples = samples_for(optimizer)
    separate = run(SeparateUnit(make_jobs(samples, build), ev))
    unit = BatchedUnit(make_jobs(samples, build), ev)
    fused = run(unit)
    assert_close_runs(separate, fused, TOL, weight_tol=2e-3)
    assert all(len(h) == 2 for h in fused[0].values())
    assert on_device(fused[1]) and on_device(separate[1])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_batched_equals_separate_float64(data, optimizer):
    def build(p):
        return cnn(p, torch.float64)

    ev = evaluator(data, optimizer, epochs=1)
    samples = [dict(s, lr=s["lr"] / (1 if optimizer == "sgd" else 2)) for s in SAMPLES]
    separate = run(SeparateUnit(make_jobs(samples, build), ev))
    fused = run(BatchedUnit(make_jobs(samples, build), ev))
    assert_close_runs(separate, fused, 1e-9, weight_tol=1e-9)


def test_shared_pipeline_equals_separate(data):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, device=DEVICE,
                                      optimizer=td.choice("opt", ["sgd", "adam", "adamw", "rmsprop"]),
                                      lr=td.choice("lr", [0.05, 0.01, 0.003]))
    samples = [{"opt": "sgd", "lr": 0.05}, {"opt": "adam", "lr": 0.01}, {"opt": "adamw", "lr": 0.003},
               {"opt": "rmsprop", "lr": 0.003}]
    separate = drive([SeparateUnit(jobs_for(ARCHS, samples), ev)])
    units, rest = plan_cse(jobs_for(ARCHS, samples), ev)
    assert rest == [] and len(units) == 1
    fused = drive(units)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])
    assert units[0].counts["batches"] == 2 * -(-len(train) // 64)


def test_frozen_prefix_equals_separate(data):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, device=DEVICE,
                                      optimizer=td.choice("opt", ["adam", "sgd"]), lr=0.01)
    samples = [{"opt": "adam"}, {"opt": "sgd"}, {"opt": "adam"}, {"opt": "sgd"}]
    separate = drive([SeparateUnit(jobs_for(head_makers(), samples), ev)])
    units, rest = plan_cse(jobs_for(head_makers(), samples), ev)
    assert rest == [] and len(units) == 1 and "frozen prefix of" in units[0].summary()
    fused = drive(units)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])


def test_stage_tree_equals_each_trial_alone(data):
    train, val = data
    ev = td.evaluators.Classification(
        train, val, batch_size=128, optimizer="sgd", lr=0.05, momentum=0.9, schedule="step", device=DEVICE,
        epochs=td.choice("epochs", [2, 4]), milestones=td.choice("milestones", [[1], [2]]),
        gamma=td.choice("gamma", [0.1, 0.5]))
    grid = [dict(epochs=e, milestones=m, gamma=g) for e in (2, 4) for m in ([1], [2]) for g in (0.1, 0.5)]

    def jobs():
        out = []
        for i, sample in enumerate(grid):
            torch.manual_seed(7)
            out.append(Job(Trial(id=i, sample=sample, seed=7), mlp(0.3, torch.float64)))
        return out

    units, rest = plan_stage_trees(jobs(), ev)
    assert rest == [] and len(units) == 1 and isinstance(units[0], StageTreeUnit)
    tree, alone = run(units[0]), run(SeparateUnit(jobs(), ev))
    assert tree[0].keys() == alone[0].keys() == set(range(len(grid)))
    for tid in tree[0]:
        for a, b in zip(tree[0][tid], alone[0][tid], strict=True):
            assert a == pytest.approx(b, abs=1e-9), tid
        for k, v in tree[1][tid].items():
            torch.testing.assert_close(v, alone[1][tid][k], atol=1e-9, rtol=0)
    assert units[0].trained_epochs < sum(s["epochs"] for s in grid)


def test_nan_member_leaves_its_unit_alone(data):
    def plain(p):
        return cnn(p)

    samples = [*SAMPLES[:3], dict(lr=1e12, m=0.9, wd=0.0, s="constant", p=0.1)]
    ev = evaluator(data, "sgd")
    separate = run(SeparateUnit(make_jobs(samples, plain), ev))
    fused = run(BatchedUnit(make_jobs(samples, plain), ev))
    assert isinstance(fused[0][3][-1], NonFiniteLoss) and isinstance(separate[0][3][-1], NonFiniteLoss)
    assert_close_runs(separate, fused, TOL, weight_tol=2e-3)
    assert 3 not in fused[1] and {0, 1, 2} <= fused[1].keys()


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_batched_members_checkpoint_restarts_as_a_separate_trainer(data, optimizer, tmp_path):
    ev = evaluator(data, optimizer, epochs=3)
    samples = samples_for(optimizer)[:2]
    unit = BatchedUnit(make_jobs(samples, cnn), ev)
    unit.train_epoch()
    for tid in unit.trial_ids():   # through a file, as the store keeps it, loaded back onto the device
        torch.save(unit.state_dict(tid), tmp_path / f"{tid}.pt")
    fused = [unit.train_epoch(), unit.train_epoch()]
    for job in make_jobs(samples, cnn):
        tid = job.trial.id
        trainer = ev.trainer(job.model, job.trial.sample, job.trial.seed)
        trainer.load_state_dict(torch.load(tmp_path / f"{tid}.pt", map_location=DEVICE, weights_only=True))
        for epoch in range(2):
            train_metrics = trainer.train_epoch()
            metrics = {**trainer.validate(), **train_metrics}
            for name, value in metrics.items():
                assert fused[epoch][tid][name] == pytest.approx(value, rel=1e-4, abs=1e-4), (tid, epoch, name)


def test_max_unit_memory_is_bounded_by_the_devices_memory(data):
    ev = evaluator(data, "adam", epochs=1)
    bound = resolve_max_unit_memory(None, DEVICE)
    assert bound == default_max_unit_memory(DEVICE) > 0
    if ON_GPU:
        free, _ = torch.cuda.mem_get_info(DEVICE)
        assert bound <= free
    force = td.xopt.Settings().with_batching(mode="force")
    units, rest = plan_batching(make_jobs(ADAPTIVE * 2, cnn), ev, settings=force)
    assert [len(u.jobs) for u in units] == [8] and rest == []
    estimate = units[0].memory_estimate()
    # a bound of 3.5 models' worth splits the eight into units of at most three
    units, rest = plan_batching(make_jobs(ADAPTIVE * 2, cnn), ev, settings=force, max_unit_memory=int(estimate / 8 * 3.5))
    assert units and max(len(u.jobs) for u in units) <= 3 and sum(len(u.jobs) for u in units) + len(rest) == 8
    if ON_GPU:  # the estimate is of the right size against what one epoch really holds on the GPU
        torch.cuda.synchronize(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)
        before = torch.cuda.memory_allocated(DEVICE)
        (unit,), _ = plan_batching(make_jobs(ADAPTIVE * 2, cnn), ev, settings=force)
        unit.train_epoch()
        torch.cuda.synchronize(DEVICE)
        peak = torch.cuda.max_memory_allocated(DEVICE) - before
        assert 0.25 * peak <= unit.memory_estimate() <= 8 * peak, (unit.memory_estimate(), peak)


def test_the_device_is_chosen_by_itself(data):
    train, val = data
    ev = td.evaluators.Classification(train, val, epochs=1, batch_size=64, optimizer="sgd", lr=0.05)
    assert ev.config().device.type == ("cuda" if torch.cuda.is_available() else "cpu")


class Space(td.nn.ModelSpace):
    def __init__(self):
        super().__init__()
        width = td.choice("width", [8, 16])
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.2), nn.Linear(width * 16, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def test_an_experiment_on_the_device_stores_and_shows_what_one_on_the_cpu_does(data, tmp_path):
    train, val = data

    def experiment(name, device, optimize):
        ev = td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="adamw", device=device,
                                          lr=td.choice("lr", [0.003, 0.01]))
        return td.Experiment(Space(), ev, td.strategy.GridSearch(), name=name, store=tmp_path / "runs.db",
                             executor=td.executors.Inline(optimize=optimize))

    force = td.xopt.Settings().with_batching(mode="force")
    on_device = experiment("device", DEVICE, force)
    on_device.run()
    on_cpu = experiment("cpu", "cpu", False)
    on_cpu.run()
    a, b = on_device.trials(), on_cpu.trials()
    assert len(a) == len(b) == 4 and all(t.status == td.TrialStatus.COMPLETED for t in a)
    for x, y in zip(sorted(a, key=lambda t: str(t.sample)), sorted(b, key=lambda t: str(t.sample)), strict=True):
        assert x.sample == y.sample and x.metrics.keys() == y.metrics.keys()
        assert all(isinstance(v, float) for values in x.metrics.values() for v in values)
        assert x.metric == pytest.approx(y.metric, abs=0.05)   # another device's kernels: seed-level noise
    best = on_device.top(1)[0]
    if best.checkpoint:   # a checkpoint written on the GPU loads on the CPU
        state = torch.load(best.checkpoint, map_location="cpu", weights_only=True)
        assert all(v.device.type == "cpu" for v in _tensors(state))
    reader = StoreReader(tmp_path / "runs.db")
    try:
        summary = reader.experiment("device")
        assert summary["name"] == "device"
        trial = reader.trial("device", 1)
        assert trial["status"] in ("completed", "COMPLETED")
    finally:
        reader.close()


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)

