"""CSE: a shared data pipeline and a shared frozen prefix give the metrics and weights of
separate training, compute the shared work once per batch, and go through the engine unchanged."""

from __future__ import annotations

import contextlib
import copy
import functools
import logging

import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.units import Job, SeparateUnit
from tridens.trial import Trial, TrialStatus
from tridens.xopt import Settings, _cse
from tridens.xopt._cse import SharedPipelineUnit, plan_cse


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


class Counter:
    """A random flip + noise augmentation written with torch ops on the batch, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        flip = torch.rand(x.shape[0], 1, 1, 1) < 0.5
        return torch.where(flip, x.flip(-1), x) + 0.05 * torch.randn_like(x)


# -- models: several architectures, with Dropout and BatchNorm -------------------------------------
def cnn(width):
    return nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Dropout(0.2), nn.Flatten(), nn.Linear(width * 16, 10))


def mlp(hidden):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                         nn.Dropout(0.3), nn.Linear(hidden, 10))


class InPlace(nn.Module):
    """Modifies its training input in place (the unit must hand it a copy). Not in eval mode: the
    separate trainer's validation batches are views of the dataset."""

    def __init__(self):
        super().__init__()
        self.body = mlp(16)

    def forward(self, x):
        if self.training:
            x.mul_(2.0)
        return self.body(x)


ARCHS = [lambda: cnn(8), lambda: cnn(12), lambda: mlp(32), lambda: mlp(24)]


def jobs_for(makers, samples, max_steps=None):
    jobs = []
    for i, (make, sample) in enumerate(zip(makers, samples)):
        torch.manual_seed(1000 + i)
        jobs.append(Job(Trial(id=i + 1, sample=dict(sample), seed=1000 + i), make(), max_steps))
    return jobs


def drive(units, stop=None):
    """The executor's lockstep loop, in short: {trial: [metrics per epoch]}, {trial: final weights},
    errors. ``stop`` maps a trial to the epoch after which it is stopped."""
    metrics, weights, errors = {}, {}, {}
    stop = stop or {}
    step = 0
    while any(u.active() for u in units):
        for unit in units:
            for trial_id, result in unit.train_epoch().items():
                if isinstance(result, BaseException):
                    errors[trial_id] = result
                    unit.drop(trial_id)
                else:
                    metrics.setdefault(trial_id, []).append(result)
        for unit in units:
            for job in unit.active():
                t = job.trial.id
                if unit.epoch(t) >= unit.limit(t) or stop.get(t) == step:
                    weights[t] = unit.weights(t)
                    unit.drop(t)
        step += 1
    return metrics, weights, errors


def assert_same(a, b):
    assert a.keys() == b.keys()
    for t in a:
        assert len(a[t]) == len(b[t])
        for ea, eb in zip(a[t], b[t]):
            assert list(ea) == list(eb)  # same names, objective first
            assert ea == pytest.approx(eb, abs=1e-4)


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for t in a:
        assert list(a[t]) == list(b[t])
        for k in a[t]:
            torch.testing.assert_close(a[t][k], b[t][k], atol=1e-4, rtol=0)


# -- the shared data pipeline ---------------------------------------------------------------------
def test_shared_pipeline_equals_separate_and_augments_once(data):
    train, val = data
    aug = Counter()
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, transforms=aug,
                                      optimizer=td.choice("opt", ["sgd", "adam", "adamw", "rmsprop"]),
                                      lr=td.choice("lr", [0.05, 0.01, 0.003]))
    samples = [{"opt": "sgd", "lr": 0.05}, {"opt": "adam", "lr": 0.01}, {"opt": "adamw", "lr": 0.003},
               {"opt": "rmsprop", "lr": 0.003}]
    separate = drive([SeparateUnit(jobs_for(ARCHS, samples), ev)])
    separate_calls = aug.calls
    aug.calls = 0
    units, rest = plan_cse(jobs_for(ARCHS, samples), ev)
    assert rest == [] and len(units) == 1 and isinstance(units[0], SharedPipelineUnit)
    fused = drive(units)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])
    batches = -(-len(train) // 64)
    assert units[0].counts["batches"] == 2 * batches
    assert aug.calls == 2 * batches                 # once per batch for the whole unit
    assert separate_calls == 4 * 2 * batches        # once per batch per trial, separately
    assert units[0].counts["val_batches"] == 2 * -(-len(val) // 256)


class RandomCropFlip(torch.utils.data.Dataset):
    """Images augmented per example in ``__getitem__`` (torchvision style): a random crop of the
    zero-padded image and a random horizontal flip, from torch's global generator; counts reads."""

    def __init__(self, ds):
        self.x, self.y = ds.tensors
        self.reads = 0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.reads += 1
        padded = torch.nn.functional.pad(self.x[i], (1, 1, 1, 1))
        top, left = torch.randint(0, 3, (2,)).tolist()
        x = padded[:, top:top + 8, left:left + 8]
        return (x.flip(-1) if torch.rand(()) < 0.5 else x), self.y[i]


def test_a_dataset_augmenting_per_example_is_read_once_and_equals_separate(data):
    # Random transforms in a map-style dataset are drawn per (data seed, epoch, batch), so one
    # shared loader gives every member the batches its own loader would have given it.
    train, val = data
    images = RandomCropFlip(train)
    ev = td.evaluators.Classification(train=images, val=val, epochs=2, batch_size=64,
                                      optimizer=td.choice("opt", ["sgd", "adam"]), lr=td.choice("lr", [0.05, 0.01]))
    samples = [{"opt": "sgd", "lr": 0.05}, {"opt": "adam", "lr": 0.01}, {"opt": "adam", "lr": 0.01},
               {"opt": "sgd", "lr": 0.01}]
    torch.manual_seed(1)  # the caller's random state differs between the two runs: it must not matter
    separate = drive([SeparateUnit(jobs_for(ARCHS, samples), ev)])
    separate_reads, images.reads = images.reads, 0
    torch.manual_seed(2)
    units, rest = plan_cse(jobs_for(ARCHS, samples), ev)
    assert rest == [] and len(units) == 1
    fused = drive(units)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])
    assert separate_reads == 4 * 2 * len(train)
    assert 2 * len(train) <= images.reads <= 2 * len(train) + 64  # once per epoch (+ the planner's example batch)


def test_member_that_modifies_its_input_gets_copies(data):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=128, optimizer="adam", lr=0.01)
    makers = [lambda: cnn(8), InPlace, lambda: mlp(16)]
    samples = [{}] * 3
    separate = drive([SeparateUnit(jobs_for(makers, samples), ev)])
    units, _ = plan_cse(jobs_for(makers, samples), ev)
    fused = drive(units)
    assert_same(separate[0], fused[0])


def test_failed_and_stopped_members_leave_without_disturbing_others(data):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=3, batch_size=128, optimizer="sgd",
                                      lr=td.choice("lr", [1e38, 0.05, 0.01]))
    samples = [{"lr": 0.05}, {"lr": 1e38}, {"lr": 0.01}, {"lr": 0.05}]
    stop = {3: 0}  # trial 3 is stopped by the strategy after its first epoch
    separate = drive([SeparateUnit(jobs_for(ARCHS, samples), ev)], stop)
    units, _ = plan_cse(jobs_for(ARCHS, samples), ev)
    fused = drive(units, stop)
    assert_same(separate[0], fused[0])
    assert set(fused[2]) == {2} and "loss" in str(fused[2][2]).lower()
    assert type(fused[2][2]) is type(separate[2][2])
    assert len(fused[0][3]) == 1 and len(fused[0][1]) == 3
    assert_same_weights(separate[1], fused[1])


def test_pipeline_groups_and_the_log_line_says_what_is_not_shared(data, caplog):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=td.choice("bs", [64, 32]),
                                      data_seed=td.choice("ds", [0, 7]), optimizer="adam", lr=0.01)
    samples = [{"bs": 64, "ds": 0}, {"bs": 64, "ds": 0}, {"bs": 32, "ds": 0}, {"bs": 64, "ds": 7}]
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, rest = plan_cse(jobs_for(ARCHS, samples), ev)
    assert [sorted(u.jobs) for u in units] == [[1, 2]]
    assert [j.trial.id for j in rest] == [3, 4]
    line = units[0].summary()
    assert "one data pipeline" in line
    assert "trial 3 (different batch size (32, not 64))" in line
    assert "trial 4 (different data seed (7, not 0))" in line
    # nothing shared at all: one line says so
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, rest = plan_cse(jobs_for(ARCHS[2:], samples[2:]), ev)
    assert units == [] and len(rest) == 2
    assert any("no two trials share a data pipeline" in r.getMessage() for r in caplog.records)


# -- the frozen prefix ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def pretrained() -> nn.Module:
    """A backbone (conv + BatchNorm) trained for one epoch on digits, then frozen."""
    train, val = td.datasets.digits()
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    model = nn.Sequential(backbone, nn.Flatten(), nn.Linear(32 * 16, 10))
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam", lr=0.01)
    ev.trainer(model, {}, seed=0).train_epoch()
    return backbone.requires_grad_(False)


class FineTune(tnn.ModelSpace):
    """A fine-tuning space: the pretrained backbone (frozen, BatchNorm in training mode) and 4 heads."""

    def __init__(self):
        super().__init__()
        self.backbone = copy.deepcopy(pretrained())
        self.head = tnn.LayerChoice([
            nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(32 * 16, 10)),
            nn.Sequential(nn.Conv2d(32, 16, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(256, 10)),
            nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5),
                          nn.Linear(64, 10)),
            nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(2), nn.Flatten(),
                          nn.Linear(128, 10)),
        ], label="head")
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.head(self.backbone(x))


def head_makers():
    space = FineTune()
    return [functools.partial(space.freeze, {"head": i}) for i in range(4)]


@contextlib.contextmanager
def counting_backbone_calls(units):
    """Count forward calls of every backbone's first layer, in training and in eval mode, while inside."""
    seen = {"train": 0, "eval": 0}

    def count(module, inputs, output):
        seen["train" if module.training else "eval"] += 1

    handles = [job.model.backbone[0].register_forward_hook(count) for unit in units for job in unit.jobs.values()]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def test_frozen_prefix_is_computed_once_and_equals_separate(data):
    train, val = data
    aug = Counter()
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, transforms=aug,
                                      optimizer=td.choice("opt", ["adam", "sgd"]), lr=0.01)
    samples = [{"opt": "adam"}, {"opt": "sgd"}, {"opt": "adam"}, {"opt": "sgd"}]
    separate = drive([SeparateUnit(jobs_for(head_makers(), samples), ev)])
    units, rest = plan_cse(jobs_for(head_makers(), samples), ev)
    assert rest == [] and len(units) == 1
    unit = units[0]
    assert "frozen prefix of" in unit.summary() and "computed once per batch for trials [1, 2, 3, 4]" in unit.summary()
    [prefix] = unit.prefixes.values()
    with counting_backbone_calls(units) as seen:
        fused = drive(units)
    batches, val_batches = -(-len(train) // 64), -(-len(val) // 256)
    assert prefix.calls == 2 * (batches + val_batches)
    assert seen == {"train": 2 * batches, "eval": 2 * val_batches}  # once per batch, not once per model
    assert_same(separate[0], fused[0])
    # weights(): the whole model's state_dict, same keys and values (the backbone's BatchNorm statistics too)
    assert_same_weights(separate[1], fused[1])
    reference = head_makers()[0]().state_dict()
    assert list(fused[1][1]) == list(reference)
    assert not torch.equal(fused[1][1]["backbone.1.running_mean"], reference["backbone.1.running_mean"])


@pytest.mark.parametrize("batching", ["auto", "force"])
def test_planner_shares_a_frozen_prefix_before_batching_same_shaped_models(data, batching):
    """Two pairs of trials with the same head (operator batching could fuse each pair, each running
    the backbone): the planner puts all four in one unit that runs the backbone once per batch, and a
    model without a frozen prefix is left to the other optimizations; metrics equal separate."""
    from tridens.executors._planner import plan

    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam",
                                      lr=td.choice("lr", [0.01, 0.003]))
    heads = head_makers()
    makers = [heads[0], heads[0], heads[1], heads[1], lambda: mlp(32)]
    samples = [{"lr": 0.01}, {"lr": 0.003}] * 2 + [{"lr": 0.01}]
    separate = drive([SeparateUnit(jobs_for(makers, samples), ev)])
    units = plan(jobs_for(makers, samples), ev, optimize=Settings().with_batching(mode=batching))
    prefixed = [u for u in units if isinstance(u, SharedPipelineUnit) and u.prefixes]
    assert len(prefixed) == 1 and sorted(prefixed[0].jobs) == [1, 2, 3, 4]
    assert "computed once per batch for trials [1, 2, 3, 4]" in prefixed[0].summary()
    with counting_backbone_calls(prefixed) as seen:
        fused = drive(units)
    assert seen["train"] == -(-len(train) // 64)  # once per batch for the four trials
    assert_same(separate[0], fused[0])


def test_prefix_members_fail_and_stop_alone(data):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=128, optimizer="sgd",
                                      lr=td.choice("lr", [1e38, 0.05]))
    samples = [{"lr": 0.05}, {"lr": 1e38}, {"lr": 0.05}, {"lr": 0.05}]
    stop = {1: 0}
    separate = drive([SeparateUnit(jobs_for(head_makers(), samples), ev)], stop)
    units, _ = plan_cse(jobs_for(head_makers(), samples), ev)
    assert units[0].prefixes
    fused = drive(units, stop)
    assert set(fused[2]) == {2}
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])


class Branchy(nn.Module):
    """Frozen backbone, then Python control flow on ``self.training`` that torch.fx bakes into the
    graph: the split would not reproduce the model in eval mode, so the planner must not use it."""

    def __init__(self):
        super().__init__()
        self.backbone = copy.deepcopy(pretrained())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 16, 10))

    def forward(self, x):
        h = self.backbone(x)
        if self.training:
            h = h * 0.5
        return self.head(h)


def test_a_split_that_does_not_reproduce_the_model_is_not_used(data):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=128, optimizer="adam", lr=0.01)
    makers = [Branchy, Branchy, head_makers()[0]]
    separate = drive([SeparateUnit(jobs_for(makers, [{}] * 3), ev)])
    units, _ = plan_cse(jobs_for(makers, [{}] * 3), ev)
    line = units[0].summary()
    assert "does not reproduce the model" in line
    fused = drive(units)
    assert_same(separate[0], fused[0])


def test_different_backbone_weights_are_not_shared(data):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=128, optimizer="adam", lr=0.01)
    makers = head_makers()[:2]
    jobs = jobs_for(makers, [{}, {}])
    with torch.no_grad():
        jobs[1].model.backbone[3].weight.add_(0.01)   # same structure, other weights
    units, _ = plan_cse(jobs, ev)
    assert not units[0].prefixes
    assert "frozen prefix" not in units[0].summary().split("whole models")[0]


# -- memory ------------------------------------------------------------------------------------------
def test_memory_bound_splits_units_and_training_is_unchanged(data):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, optimizer="adam", lr=0.01)
    samples = [{}] * 4
    separate = drive([SeparateUnit(jobs_for(head_makers(), samples), ev)])
    [whole] = plan_cse(jobs_for(head_makers(), samples), ev)[0]
    limit = whole.memory - 1
    units, rest = plan_cse(jobs_for(head_makers(), samples), ev, max_unit_memory=limit)
    assert rest == [] and len(units) >= 2
    assert all(u.memory <= limit for u in units)
    assert all("split into" in u.summary() for u in units)
    # each unit runs its own copy of the prefix: BatchNorm statistics are not updated twice
    prefixes = [p for u in units for p in u.prefixes.values()]
    assert len({id(p.module) for p in prefixes}) == len(prefixes) >= 2
    fused = drive(units)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])


def test_memory_estimate_grows_with_batch_size(data):
    train, val = data
    sizes = []
    for bs in (32, 512):
        ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=bs)
        [unit], _ = plan_cse(jobs_for(ARCHS[:2], [{}, {}]), ev)
        sizes.append(unit.memory)
    assert sizes[1] > sizes[0]
    assert _cse.unit_memory([(10, 5), (20, 7)], shared=3) == 40


# -- end to end through the engine -------------------------------------------------------------------
class SmallSpace(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [6, 10])
        self.conv = nn.Conv2d(1, w, 3, padding=1)
        self.bn = nn.BatchNorm2d(w)
        self.op = tnn.LayerChoice([nn.Conv2d(w, w, 3, padding=1), nn.Identity()], label="op")
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(w * 16, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        x = torch.relu(self.op(torch.relu(self.bn(self.conv(x)))))
        x = nn.functional.max_pool2d(x, 2)
        return self.head(self.drop(x.flatten(1)))


def _experiment(tmp_path, name, space, ev, strategy, optimize, max_trials=None):
    exp = td.Experiment(space, ev, strategy, store=tmp_path / "t.db", name=name, budget=max_trials,
                        executor=td.executors.Inline(optimize=optimize), options=td.RunOptions(verbose=False))
    trials = exp.run().trials()
    first = min(t.id for t in trials)
    return {t.id - first: t for t in trials}


def _same_trials(a, b):
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].sample == b[i].sample and a[i].status == b[i].status
        assert a[i].metrics.keys() == b[i].metrics.keys()
        for name in a[i].metrics:
            assert a[i].metrics[name] == pytest.approx(b[i].metrics[name], abs=1e-4), (i, name)


def test_experiment_optimize_true_equals_false(tmp_path, data, caplog):
    train, val = data
    # every trial a different (structure, optimizer kind): nothing for operator batching, all for CSE
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, transforms=Counter(),
                                      optimizer=td.choice("opt", ["adam", "sgd"]), lr=0.01)
    with caplog.at_level(logging.INFO, logger="tridens"):
        fused = _experiment(tmp_path, "fused", SmallSpace(), ev, td.strategy.GridSearch(), True, max_trials=8)
    assert any("one data pipeline" in r.getMessage() for r in caplog.records)
    separate = _experiment(tmp_path, "separate", SmallSpace(), ev, td.strategy.GridSearch(), False, max_trials=8)
    assert len(fused) == 8 and all(t.status is TrialStatus.COMPLETED for t in fused.values())
    _same_trials(fused, separate)


def test_experiment_on_a_dataset_augmenting_per_example(tmp_path, data):
    # torchvision-style random transforms in the dataset: the same trials with optimize on and
    # off, and again from another caller's random state, give the same metrics
    train, val = data
    ev = td.evaluators.Classification(train=RandomCropFlip(train), val=val, epochs=2, batch_size=64,
                                      optimizer=td.choice("opt", ["adam", "sgd"]), lr=0.01)
    torch.manual_seed(1)
    fused = _experiment(tmp_path, "fused", SmallSpace(), ev, td.strategy.GridSearch(), True, max_trials=4)
    torch.manual_seed(2)
    separate = _experiment(tmp_path, "separate", SmallSpace(), ev, td.strategy.GridSearch(), False, max_trials=4)
    assert all(t.status is TrialStatus.COMPLETED for t in fused.values())
    _same_trials(fused, separate)


def test_experiment_with_hyperband_stops_and_a_frozen_prefix(tmp_path, data, caplog):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=4, batch_size=128, lr=0.01,
                                      optimizer=td.choice("opt", ["adam", "sgd"]))
    strategy = lambda: td.strategy.Hyperband(min_steps=1, max_steps=4, reduction_factor=2)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="tridens"):
        fused = _experiment(tmp_path, "fused", FineTune(), ev, strategy(), True, max_trials=8)
    assert any("computed once per batch" in r.getMessage() for r in caplog.records)
    separate = _experiment(tmp_path, "separate", FineTune(), ev, strategy(), False, max_trials=8)
    assert any(t.status is TrialStatus.STOPPED for t in fused.values())
    _same_trials(fused, separate)


# -- a mixed unit: a fused (batched) member beside separate trainers ---------------------------------
def test_mixed_unit_batched_member_and_trainers_share_one_pipeline(data):
    from tridens.xopt._batching import BatchedMember
    from tridens.xopt._cse import TrainerMember

    train, val = data
    aug = Counter()
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, transforms=aug, optimizer="sgd",
                                      lr=td.choice("lr", [0.05, 0.02]))
    makers = [lambda: mlp(32), lambda: mlp(32), lambda: cnn(8), lambda: mlp(24)]
    samples = [{"lr": 0.05}, {"lr": 0.02}, {"lr": 0.05}, {"lr": 0.02}]
    stop = {2: 0}  # a batched trial stopped after its first epoch
    separate = drive([SeparateUnit(jobs_for(makers, samples), ev)], stop)
    aug.calls = 0
    jobs = jobs_for(makers, samples)
    members = [BatchedMember(jobs[:2], ev)] + [TrainerMember(j, ev.trainer(j.model, j.trial.sample, j.trial.seed))
                                              for j in jobs[2:]]
    unit = SharedPipelineUnit(jobs, ev, members=members)
    fused = drive([unit], stop)
    assert aug.calls == unit.counts["batches"] == 2 * -(-len(train) // 64)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])


def test_regression_metrics_equal_separate(data):
    train, val = data
    ev = td.evaluators.Regression(train=train, val=val, epochs=2, batch_size=128, optimizer="adam", lr=0.01,
                                  metrics=["mse", "mae", "loss"])
    makers = [lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1)),
              lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 1))]
    separate = drive([SeparateUnit(jobs_for(makers, [{}, {}]), ev)])
    units, _ = plan_cse(jobs_for(makers, [{}, {}]), ev)
    fused = drive(units)
    assert list(fused[0][1][0]) == ["val_mse", "val_mae", "val_loss", "train_loss"]
    assert_same(separate[0], fused[0])


# -- the joint step and first layers run as one wide op ---------------------------------------------
class FlatMLP(nn.Module):
    """An MLP flattening with ``torch.flatten``/``x.flatten`` (not ``nn.Flatten``), the ReLU after
    its first layer in place (on its slice of the wide op's output)."""

    def __init__(self, hidden, method=False):
        super().__init__()
        self.method = method
        self.fc1 = nn.Linear(64, hidden)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        x = x.flatten(1) if self.method else torch.flatten(x, 1)
        return self.fc2(self.drop(self.act(self.fc1(x))))


def wide_cnn(width, k=3, bn=True):
    """A CNN whose convolution has no bias (see the last test), BatchNorm after it or not."""
    norm = [nn.BatchNorm2d(width)] if bn else []
    return nn.Sequential(nn.Conv2d(1, width, k, padding=k // 2, bias=False), *norm, nn.ReLU(), nn.MaxPool2d(2),
                         nn.Dropout(0.2), nn.Flatten(), nn.Linear(width * 16, 10))


WIDE_ARCHS = [lambda: mlp(32), lambda: wide_cnn(8, bn=False), lambda: mlp(20), lambda: wide_cnn(12, bn=False),
              lambda: FlatMLP(24), lambda: FlatMLP(16, method=True), lambda: wide_cnn(6, k=5), lambda: wide_cnn(4, k=5)]


@pytest.fixture
def wide():
    """Settings that always run compatible first layers as one op."""
    return Settings().with_cse(wide="force", joint=True)


def joint_member(unit):
    [member] = [m for m in unit.members if isinstance(m, _cse.JointMember)]
    return member


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_joint_step_with_wide_first_layers_equals_separate(data, wide, optimizer):
    train, val = data
    aug = Counter()
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, transforms=aug,
                                      optimizer=optimizer, lr=td.choice("lr", [0.05, 0.01]),
                                      schedule="cosine", weight_decay=1e-4)
    samples = [{"lr": 0.05 if optimizer == "sgd" else 0.01}] * 4 + [{"lr": 0.01}] * 4
    separate = drive([SeparateUnit(jobs_for(WIDE_ARCHS, samples), ev)])
    aug.calls = 0
    units, rest = plan_cse(jobs_for(WIDE_ARCHS, samples), ev, settings=wide)
    assert rest == [] and len(units) == 1
    member = joint_member(units[0])
    # Linear(64, .) after three kinds of flatten; Conv2d 3x3 with bias apart from 5x5 (BatchNorm after)
    assert sorted(sorted(g.layers) for g in member.wide) == [[1, 3, 5, 6], [2, 4], [7, 8]]
    line = units[0].summary()
    assert "joint step (one backward) for trials [1, 2, 3, 4, 5, 6, 7, 8]" in line
    assert "trials [1, 3, 5, 6] share their first layer as one Linear(64 -> 92)" in line
    assert "trials [2, 4] share their first layer as one Conv2d(1 -> 20, kernel (3, 3)" in line
    assert "trials [7, 8] share their first layer as one Conv2d(1 -> 10, kernel (5, 5)" in line
    fused = drive(units)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])
    assert aug.calls == 2 * -(-len(train) // 64)


def test_joint_members_fail_and_stop_alone(data, wide):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=3, batch_size=128, optimizer="sgd",
                                      lr=td.choice("lr", [1e38, 0.05, 0.01]))
    makers = [lambda: mlp(32), lambda: mlp(20), lambda: FlatMLP(24), lambda: wide_cnn(8), lambda: wide_cnn(12)]
    samples = [{"lr": 0.05}, {"lr": 1e38}, {"lr": 0.01}, {"lr": 0.05}, {"lr": 1e38}]
    stop = {3: 0, 4: 1}  # the strategy stops trial 3 after its first epoch, trial 4 after its second
    separate = drive([SeparateUnit(jobs_for(makers, samples), ev)], stop)
    units, _ = plan_cse(jobs_for(makers, samples), ev, settings=wide)
    member = joint_member(units[0])
    assert sorted(sorted(g.layers) for g in member.wide) == [[1, 2, 3], [4, 5]]
    fused = drive(units, stop)
    assert set(fused[2]) == set(separate[2]) == {2, 5}
    for t in (2, 5):  # the same error at the same epoch and batch as separately
        a, b = fused[2][t], separate[2][t]
        assert type(a) is type(b) is td.evaluators.NonFiniteLoss
        assert (a.epoch, a.batch, a.step) == (b.epoch, b.batch, b.step)
        assert str(a) == str(b)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])
    assert len(fused[0][3]) == 1 and len(fused[0][4]) == 2 and len(fused[0][1]) == 3
    assert member.trial_ids() == [] and member.wide == []  # everyone left; lone members ran their own layer


def test_joint_step_with_a_member_that_modifies_its_input(data, wide):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=128, optimizer="adam", lr=0.01)
    makers = [lambda: mlp(16), InPlace, lambda: cnn(8), lambda: mlp(24)]
    separate = drive([SeparateUnit(jobs_for(makers, [{}] * 4), ev)])
    units, _ = plan_cse(jobs_for(makers, [{}] * 4), ev, settings=wide)
    line = units[0].summary()
    assert "joint step (one backward) for trials [1, 3, 4]" in line
    assert "trials [2] (it modifies its input in place)" in line
    fused = drive(units)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])
    # the joint member itself also guards the batch: an in-place member inside it gets copies
    jobs = jobs_for(makers, [{}] * 4)
    trainers = [_cse.TrainerMember(j, ev.trainer(j.model, {}, j.trial.seed)) for j in jobs]
    unit = SharedPipelineUnit(jobs, ev, members=[_cse.JointMember(trainers)])
    assert_same(separate[0], drive([unit])[0])


def test_wide_layers_kept_only_where_measured_to_pay(data, monkeypatch, caplog):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam", lr=0.01)
    makers = [lambda: mlp(32), lambda: mlp(20), lambda: wide_cnn(8)]
    settings = Settings().with_cse(joint=True, wide="auto", wide_min_speedup=float("inf"))
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, _ = plan_cse(jobs_for(makers, [{}] * 3), ev, settings=settings)
    assert joint_member(units[0]).wide == []
    assert "first layers of trials [1, 2] kept apart (Linear(64 -> 52) as one op measured" in units[0].summary()
    units, _ = plan_cse(jobs_for(makers, [{}] * 3), ev, settings=settings.with_cse(wide_min_speedup=0.0))
    assert [sorted(g.layers) for g in joint_member(units[0]).wide] == [[1, 2]]
    assert "trials [1, 2] share their first layer as one Linear(64 -> 52) (measured" in units[0].summary()
    # off: the joint step alone; no joint step: members one at a time
    units, _ = plan_cse(jobs_for(makers, [{}] * 3), ev, settings=settings.with_cse(wide="off"))
    assert joint_member(units[0]).wide == [] and "first layer" not in units[0].summary()
    units, _ = plan_cse(jobs_for(makers, [{}] * 3), ev, settings=settings.with_cse(joint=False))
    assert not any(isinstance(m, _cse.JointMember) for m in units[0].members)


def test_joint_step_respects_the_memory_bound(data, wide):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam", lr=0.01)
    makers = [lambda: mlp(32), lambda: mlp(20), lambda: wide_cnn(8)]
    [unit], _ = plan_cse(jobs_for(makers, [{}] * 3), ev, settings=wide)
    joint_memory = unit.memory
    [apart], _ = plan_cse(jobs_for(makers, [{}] * 3), ev, settings=wide.with_cse(joint=False))
    assert apart.memory < joint_memory  # members one at a time hold one member's activations
    [unit], _ = plan_cse(jobs_for(makers, [{}] * 3), ev, settings=wide, max_unit_memory=joint_memory - 1)
    assert not any(isinstance(m, _cse.JointMember) for m in unit.members)
    assert "members step one at a time (a joint step would need" in unit.summary()


def test_a_convolution_with_a_bias_keeps_its_own_op(data, wide):
    """oneDNN reduces a convolution's bias gradient inside its backward, rounding differently over
    a wide op's output than over one member's; before BatchNorm that gradient is rounding noise,
    which Adam scales to lr-sized steps (one validation example flipped in two epochs when it was
    fused). So such layers are not fused, and training stays bit-identical."""
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, optimizer="adam", lr=0.01)
    makers = [lambda: cnn(8), lambda: cnn(12)]   # Conv2d(bias=True) -> BatchNorm2d
    separate = drive([SeparateUnit(jobs_for(makers, [{}] * 2), ev)])
    units, _ = plan_cse(jobs_for(makers, [{}] * 2), ev, settings=wide)
    assert joint_member(units[0]).wide == [] and "first layer" not in units[0].summary()
    fused = drive(units)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])


# -- exact faster kernels inside the joint step ----------------------------------------------------
class PoolNet(nn.Module):
    """A CNN pooling with ``F.max_pool2d`` after ``torch.relu`` (functional forms), in place or not."""

    def __init__(self, width, inplace=False, ceil=False):
        super().__init__()
        self.inplace, self.ceil = inplace, ceil
        self.conv = nn.Conv2d(1, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width * 16, 10)

    def forward(self, x):
        x = self.bn(self.conv(x))
        x = torch.relu_(x) if self.inplace else torch.relu(x)
        x = torch.nn.functional.max_pool2d(x, 2, ceil_mode=self.ceil)
        return self.fc(x.flatten(1))


def odd_cnn(width):
    """A 2x2 max-pool on 7x7 maps (odd): the two-pass kernel does not apply."""
    return nn.Sequential(nn.Conv2d(1, width, 2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(width * 9, 10))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_joint_step_runs_max_pools_by_the_exact_kernel(data, optimizer):
    train, val = data
    aug = Counter()
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, transforms=aug,
                                      optimizer=optimizer, lr=0.01)
    makers = [lambda: cnn(8), lambda: PoolNet(6), lambda: PoolNet(4, inplace=True), lambda: odd_cnn(4),
              lambda: mlp(16), lambda: wide_cnn(6, k=5)]
    separate = drive([SeparateUnit(jobs_for(makers, [{}] * 6), ev)])
    units, rest = plan_cse(jobs_for(makers, [{}] * 6), ev)
    assert rest == [] and len(units) == 1
    member = joint_member(units[0])
    # not: the 7x7 maps, the MLP (no pool)
    assert sorted(member.fast) == [1, 2, 3, 6]
    assert "2x2 max-pools of trials [1, 2, 3, 6] run by an exact two-pass kernel" in units[0].summary()
    code = member.fast[1].code
    assert "_pool_2x2" in code and "max_pool2d" not in code and "relu" not in code  # the ReLU taken over
    fused = drive(units)
    assert_same(separate[0], fused[0])
    for t in separate[1]:  # bit for bit
        for k in separate[1][t]:
            assert torch.equal(separate[1][t][k], fused[1][t][k]), (t, k)


def test_max_pools_the_kernel_cannot_reproduce_keep_their_op(data, monkeypatch):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam", lr=0.01)
    makers = [lambda: PoolNet(6, ceil=True), lambda: odd_cnn(4), lambda: cnn(8)]
    units, _ = plan_cse(jobs_for(makers, [{}] * 3), ev)
    assert sorted(joint_member(units[0]).fast) == [3]  # ceil mode and odd maps: their own op
    units, _ = plan_cse(jobs_for(makers, [{}] * 3), ev, settings=Settings().with_cse(fast_pools=False))
    assert joint_member(units[0]).fast == {} and "max-pools" not in units[0].summary()


class TrainingBranch(PoolNet):
    """Pools after a branch on ``self.training``, which a traced graph bakes in: the rewritten graph
    does not reproduce the model in eval mode, so the planner keeps the model's own forward."""

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.nn.functional.max_pool2d(x if self.training else x * 0.5, 2)
        return self.fc(x.flatten(1))


def test_a_pool_rewrite_that_does_not_reproduce_the_model_is_not_used(data):
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam", lr=0.01)
    makers = [lambda: TrainingBranch(6), lambda: cnn(8)]
    separate = drive([SeparateUnit(jobs_for(makers, [{}] * 2), ev)])
    units, _ = plan_cse(jobs_for(makers, [{}] * 2), ev)
    assert sorted(joint_member(units[0]).fast) == [2]
    fused = drive(units)
    assert_same(separate[0], fused[0])
    assert_same_weights(separate[1], fused[1])
