"""Stage trees: trials sharing a training prefix train it once, fork, and report exactly what
they report trained alone (bit-identical in float64 on CPU), with dropout and BatchNorm."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from rich.console import Console

import tridens as td
from tridens._views import trial_details
from tridens.evaluators import NonFiniteLoss
from tridens.trial import Objective, Trial, TrialStatus
from tridens.units import Job, SeparateUnit
from tridens.xopt import StageTreeUnit, plan_stage_trees
from tridens.xopt._stages import PrefixCache

from .test_batching import mlp, run


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


def schedule_evaluator(data, **kw):
    train, val = data
    return td.evaluators.Classification(
        train, val, batch_size=128, optimizer="sgd", lr=td.choice("lr", [0.05, 1e30]), momentum=0.9,
        schedule="step", epochs=td.choice("epochs", [2, 3, 4]), milestones=td.choice("milestones", [[1], [2], [1, 3]]),
        gamma=td.choice("gamma", [0.1, 0.5, 1e32]), **kw)


GRID = [dict(lr=0.05, epochs=e, milestones=m, gamma=g)
        for e in (2, 4) for m in ([1], [2], [1, 3]) for g in (0.1, 0.5)]


def jobs_of(samples, dtype=torch.float64, seed=7):
    """One job per sample, every model built from the same seed (same initial weights)."""
    jobs = []
    for i, sample in enumerate(samples):
        torch.manual_seed(seed)
        jobs.append(Job(Trial(id=i, sample=sample, seed=seed), mlp(0.3, dtype)))
    return jobs


def test_tree_equals_each_trial_alone_float64(data):
    ev = schedule_evaluator(data)
    units, rest = plan_stage_trees(jobs_of(GRID), ev)
    assert rest == [] and len(units) == 1 and isinstance(units[0], StageTreeUnit)
    tree = units[0]
    history, weights = run(tree)
    alone = run(SeparateUnit(jobs_of(GRID), ev))
    assert history.keys() == alone[0].keys() == set(range(len(GRID)))
    for tid in history:
        assert history[tid] == alone[0][tid]                  # bit-identical metrics, every epoch
        for k, v in weights[tid].items():
            assert torch.equal(v, alone[1][tid][k]), (tid, k)
    # 36 trial-epochs; distinct prefixes: epoch 0 once; epoch 1 by its lr (0.05, 0.025, 0.005);
    # epoch 2 (the 4-epoch trials) four paths; epoch 3 six (milestones [1] and [1, 3] part there)
    assert tree.trained_epochs == 1 + 3 + 4 + 6
    assert tree.nodes == [] and tree.active() == []   # every trial left; every node freed


def test_stage_records_show_the_tree(data):
    ev = schedule_evaluator(data)
    jobs = jobs_of(GRID[:4], torch.float32)
    units, _ = plan_stage_trees(jobs, ev)
    run(units[0])
    paths = {job.trial.id: job.trial.info["stages"] for job in jobs}
    # every trial starts in the root; trials with different gammas at milestone 1 fork at epoch 1
    assert all(path[0] == ["0.0", None, 0] for path in paths.values())
    first_forks = {tuple(path[1]) for path in paths.values() if len(path) > 1}
    assert all(parent == "0.0" and epoch == 1 for _, parent, epoch in first_forks)


def test_float32_within_tolerance_and_bigger_groups_need_sharing(data):
    ev = schedule_evaluator(data)
    different_seeds = [Job(Trial(id=i, sample=s, seed=i), mlp(0.3)) for i, s in enumerate(GRID[:4])]
    units, rest = plan_stage_trees(different_seeds, ev)
    assert units == [] and [j.trial.id for j in rest] == [0, 1, 2, 3]   # nothing in common: left to others
    units, rest = plan_stage_trees(jobs_of([GRID[0]], torch.float32), ev)
    assert units == [] and len(rest) == 1


def test_stopped_branch_frees_its_node_and_siblings_go_on(data):
    ev = schedule_evaluator(data)
    samples = [dict(lr=0.05, epochs=4, milestones=[1], gamma=0.1), dict(lr=0.05, epochs=4, milestones=[1], gamma=0.5)]
    tree = StageTreeUnit(jobs_of(samples), ev)   # one shared epoch of eight: below the planner's bar
    history, _ = run(tree, stop={1: 2})           # trial 1 stopped after its second epoch
    assert len(history[0]) == 4 and len(history[1]) == 2
    assert tree.nodes == []
    alone, _ = run(SeparateUnit(jobs_of(samples[:1]), ev))
    assert history[0] == alone[0]


def test_nan_branch_fails_alone(data):
    ev = schedule_evaluator(data)
    samples = [dict(lr=0.05, epochs=3, milestones=[1], gamma=0.1), dict(lr=0.05, epochs=3, milestones=[1], gamma=1e32)]
    history, _ = run(StageTreeUnit(jobs_of(samples, torch.float32), ev))
    assert isinstance(history[1][-1], NonFiniteLoss) and len(history[1]) == 2
    assert len(history[0]) == 3 and all(not isinstance(r, BaseException) for r in history[0])
    assert history[0][0] == history[1][0]  # the shared first epoch


def test_prefix_cache_starts_later_trials_exactly_and_stays_intact(data):
    ev = schedule_evaluator(data)
    short = dict(lr=0.05, epochs=2, milestones=[2], gamma=0.5)
    later = [dict(lr=0.05, epochs=4, milestones=[2], gamma=g) for g in (0.5, 0.1)]  # part after epoch 2
    cache = PrefixCache()
    run(StageTreeUnit(jobs_of([short]), ev, cache=cache))
    for sample in later:            # both start from the same cached entry, which must stay intact
        alone, _ = run(SeparateUnit(jobs_of([sample]), ev))
        unit = StageTreeUnit(jobs_of([sample]), ev, cache=cache)
        assert unit.reused_epochs == 2
        history, _ = run(unit)
        assert history[0] == alone[0]       # two replayed epochs, then two trained: as trained alone
        assert unit.trained_epochs == 2


class Net(td.nn.ModelSpace):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, td.choice("width", [24, 32])), nn.ReLU(),
                                  nn.Dropout(0.2), nn.Linear(td.choice("width", [24, 32]), 10))

    def forward(self, x):
        return self.body(x)


def test_experiment_with_per_architecture_seeds_shares_prefixes_across_groups(data, tmp_path):
    train, val = data

    ev = td.evaluators.Classification(train, val, batch_size=128, lr=0.05, schedule="step", epochs=td.choice("epochs", [2, 4]),
                                      milestones=td.choice("milestones", [[1], [2]]), gamma=td.choice("gamma", [0.1, 0.5]))
    runs = {}
    for optimize in (True, False):
        exp = td.Experiment(Net(), ev, td.strategy.GridSearch(batch_size=4), store=tmp_path / f"{optimize}.db",
                            name="grid", options=td.RunOptions(seeds="per-architecture", verbose=False),
                            executor=td.executors.Inline(optimize=optimize))
        exp.run()
        runs[optimize] = {json.dumps(t.sample, sort_keys=True): t for t in exp.trials()}
    assert len(runs[True]) == 16 and runs[True].keys() == runs[False].keys()
    for key, trial in runs[True].items():
        other = runs[False][key]
        assert trial.status is TrialStatus.COMPLETED and trial.seed == other.seed
        assert trial.metrics["val_acc"] == other.metrics["val_acc"]
    tree_paths = [t.info.get("stages") for t in runs[True].values()]
    assert all(path and path[0][1:] == [None, 0] for path in tree_paths)    # trained through a tree
    assert sum(len(path) > 1 for path in tree_paths) >= 8                    # and forked from it
    by_id = {t.id: t for t in runs[True].values()}
    reused = [t for t in by_id.values() if int(t.info["stages"][0][0].split(".")[0]) in by_id
              and by_id[int(t.info["stages"][0][0].split(".")[0])].group != t.group]
    assert reused                       # later groups started from prefixes trained by earlier ones
    assert not any("stages" in t.info for t in runs[False].values())
    seeds = {t.sample["width"]: t.seed for t in runs[True].values()}
    assert len(set(seeds.values())) == 2          # one seed per architecture
    trials = list(runs[True].values())
    console = Console(record=True, width=400)
    for part in trial_details(trials[0], trials, Objective("val_acc", "max")):   # `tridens show NAME TRIAL`
        console.print(part)
    shown = console.export_text()
    assert "from epoch 0: node" in shown and "shared with #" in shown
    with pytest.raises(ValueError, match="'seeds' parameter of Experiment"):
        td.Experiment(Net(), ev, options=td.RunOptions(seeds="shared"), store=tmp_path / "bad.db").run()
    assert math.isfinite(max(t.metric for t in runs[True].values()))


BATCH_SCHEDULES = {"64": None, "128 from 1": [[1, 128]], "128 from 2": [[2, 128]], "128, 256": [[1, 128], [3, 256]]}
BATCH_GRID = [dict(epochs=e, batch_schedule=b) for e in (2, 4) for b in BATCH_SCHEDULES]


def test_batch_size_schedule_breaks_stages_and_each_trial_is_as_trained_alone_float64(data):
    train, val = data
    ev = td.evaluators.Classification(
        train, val, batch_size=64, optimizer="sgd", lr=0.05, momentum=0.9, schedule="step", milestones=[2], gamma=0.5,
        epochs=td.choice("epochs", [2, 4]),
        batch_schedule=td.choice("batch_schedule", BATCH_SCHEDULES))
    cfg = ev.config(BATCH_GRID[-1])
    assert [cfg.batch_size_at(e) for e in range(4)] == [64, 128, 128, 256]
    assert cfg.epoch_steps(1) == (23, 35) and cfg.total_steps == 23 + 12 + 12 + 6   # 1438 examples
    assert cfg.lr_at(34) == 0.05 and cfg.lr_at(35) == 0.025                         # milestone 2: step 35
    jobs = jobs_of(BATCH_GRID)
    units, rest = plan_stage_trees(jobs, ev)
    assert rest == [] and len(units) == 1
    tree = units[0]
    history, weights = run(tree)
    alone = run(SeparateUnit(jobs_of(BATCH_GRID), ev))
    for tid in history:
        assert history[tid] == alone[0][tid]                  # bit-identical metrics, every epoch
        for k, v in weights[tid].items():
            assert torch.equal(v, alone[1][tid][k]), (tid, k)
    # epoch 0 once (all at 64); epoch 1 at 64 or 128; epoch 2 (4-epoch trials): 64, 128 after 64, 128
    # after 128; epoch 3: 64, 128 (two paths), 256
    paths = [job.trial.info["stages"] for job in jobs]
    assert all(p[0][2] == 0 for p in paths)
    first_fork = {p[1][2] for p in paths if len(p) > 1}
    assert min(first_fork) == 1                               # the tree parts where the batch size does
    assert tree.trained_epochs == 1 + 2 + 3 + 4
    with pytest.raises(td.evaluators.InvalidParameter, match="batch_schedule"):
        td.evaluators.Classification(train, val, batch_schedule=[[0, 32]]).config({})
