"""The super-graph unit: children of one parent trained merged, inherited tensors stored once.

Real training on scikit-learn's digits. The reference the unit must equal is weight sharing done
the slow way: separate models that load the shared tensors before each step and save them after
(what passing them through checkpoints would compute)."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.engine._execution import Job
from tridens.store import Store
from tridens.trial import Trial, TrialStatus
from tridens.warmup import describe
from tridens.xopt._supergraph import SuperGraphUnit, inherit, plan_supergraph

from ..engine.spaces import InheritNet as Net

X = torch.zeros(2, 1, 8, 8)
EPOCHS = 3



CHILDREN = [  # (trial id, sample, seed): another kernel, the same structure, another width
    (1, {"width": 8, "op": 1, "lr": 0.1}, 11),
    (2, {"width": 8, "op": 0, "lr": 0.05}, 12),
    (3, {"width": 12, "op": 0, "lr": 0.1}, 13),
]


@pytest.fixture(scope="module")
def setup():
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train=train, val=val, epochs=EPOCHS, batch_size=64,
                                      lr=td.choice("lr", [0.05, 0.1]))
    space = Net()
    torch.manual_seed(0)
    parent = space.freeze({"width": 8, "op": 0})
    ev.trainer(parent, {"lr": 0.05}, seed=0).train_epoch()  # a trained parent
    return space, ev, {k: v.clone() for k, v in parent.state_dict().items()}, describe(parent, X)


def _child(setup, tid, sample, seed):
    """A child as the engine makes it: seeded init, fingerprint, the parent's shared layers."""
    space, _ev, parent_state, parent_desc = setup
    torch.manual_seed(seed)
    model = space.freeze(space.restrict(sample))
    record = inherit(model, parent_state, describe(model, X), parent_desc)
    trial = Trial(id=tid, sample=dict(sample), seed=seed, info={"inherit": {"parent": 0, **record}},
                  fingerprint=td.graph.trace(model, X).fingerprint())
    return Job(trial, model)


def _children(setup):
    return [_child(setup, tid, sample, seed) for tid, sample, seed in CHILDREN]


def _drive(unit, leave: dict[int, int] | None = None):
    """The executor's lockstep loop, by hand: every epoch's results; ``leave`` drops a trial after
    an epoch (a stop decision). Returns {trial: [metrics per epoch]}, {trial: weights at its end}."""
    leave = leave or {}
    metrics: dict[int, list[dict[str, float]]] = {}
    final: dict[int, dict[str, torch.Tensor]] = {}
    for epoch in range(EPOCHS):
        results = unit.train_epoch()
        assert set(results) == {j.trial.id for j in unit.active()}  # every child, every epoch
        for tid, result in results.items():
            assert not isinstance(result, BaseException), result
            metrics.setdefault(tid, []).append(dict(result))
        for tid in list(results):
            if leave.get(tid) == epoch or unit.epoch(tid) >= unit.limit(tid):
                final[tid] = {k: v.clone() for k, v in unit.weights(tid).items()}
                unit.drop(tid)
    assert not unit.active()
    return metrics, final


def _reference(setup, jobs, leave: dict[int, int] | None = None):
    """Weight sharing through 'checkpoints': untied copies of the children; before each step a
    child loads the current value of every tensor it shares with a sibling, after it saves it."""
    _space, ev, _ps, _pd = setup
    leave = leave or {}
    models = {j.trial.id: copy.deepcopy(j.model) for j in jobs}
    shared = {j.trial.id: j.trial.info["inherit"]["shared"] for j in jobs}
    users: dict[str, int] = {}
    for mapping in shared.values():
        for pk in set(mapping.values()):
            users[pk] = users.get(pk, 0) + 1
    saved = {pk: models[j.trial.id].state_dict()[ck].clone() for j in jobs
             for ck, pk in shared[j.trial.id].items() if users[pk] > 1}

    def load(tid):
        state = models[tid].state_dict()
        with torch.no_grad():
            for ck, pk in shared[tid].items():
                if pk in saved:
                    state[ck].copy_(saved[pk])

    def save(tid):
        state = models[tid].state_dict()
        for ck, pk in shared[tid].items():
            if pk in saved:
                saved[pk] = state[ck].clone()

    trainers = {j.trial.id: ev.trainer(models[j.trial.id], j.trial.sample, j.trial.seed) for j in jobs}
    active = [j.trial.id for j in jobs]
    metrics: dict[int, list[dict[str, float]]] = {}
    for epoch in range(EPOCHS):
        totals = {tid: [0.0, 0] for tid in active}
        for tid in active:
            trainers[tid].begin_epoch()
        for batch, x, y in trainers[active[0]].epoch_batches():
            for tid in active:
                load(tid)
                loss = trainers[tid].train_batch(x, y, batch)
                save(tid)
                totals[tid][0] += loss * len(y)
                totals[tid][1] += len(y)
        for tid in active:
            train = trainers[tid].end_epoch(totals[tid][0] / totals[tid][1])
            load(tid)
            metrics.setdefault(tid, []).append({**trainers[tid].validate(), **train})
        active = [tid for tid in active if leave.get(tid) != epoch]
    return metrics


def _same(a, b):
    for tid in b:
        assert len(a[tid]) == len(b[tid])
        for ma, mb in zip(a[tid], b[tid]):
            assert {k: ma[k] for k in mb} == mb, tid


def test_planner_merges_children_and_they_share_one_tensor(setup):
    jobs = _children(setup)
    units, rest = plan_supergraph(jobs, setup[1])
    assert rest == [] and len(units) == 1 and isinstance(units[0], SuperGraphUnit)
    unit = units[0]
    a, b, c = (j.model for j in jobs)
    assert a.stem.weight is b.stem.weight is c.stem.weight        # stored once for all three
    assert a.bn.weight is b.bn.weight and a.head.weight is b.head.weight
    assert a.bn.running_mean is b.bn.running_mean                 # buffers too
    assert a.conv.weight is not b.conv.weight                      # 5x5 vs 3x3: not shared
    assert c.bn.weight is not a.bn.weight and c.head.weight is not a.head.weight  # other width
    # stem (three users: two copies saved), BatchNorm (4 x 8 + the step counter) and head of a and b
    assert unit.saved_elements == 2 * (8 * 9 + 8) + (4 * 8 + 1) + (128 * 10 + 10)
    for job in jobs:  # each child's own optimizer steps the one shared object
        params = [p for g in unit._by_trial[job.trial.id].trainer.optimizer.param_groups for p in g["params"]]
        assert any(p is a.stem.weight for p in params)
        assert job.trial.info["inherit"]["merged"]["unit"] == [1, 2, 3]
    assert "supergraph unit of 3 trial(s)" in unit.describe()
    metrics, final = _drive(unit)
    assert all(len(metrics[tid]) == EPOCHS for tid in (1, 2, 3))
    for key in ("stem.weight", "stem.bias"):  # each checkpoint holds the shared value
        assert torch.equal(final[1][key], final[2][key]) and torch.equal(final[1][key], final[3][key])
        assert not torch.equal(final[1][key], setup[2][key])     # and it was trained
    assert not torch.equal(final[1]["conv.weight"][:, :, 1:4, 1:4], final[2]["conv.weight"])


def test_one_child_per_architecture_joins_the_super_graph(setup):
    jobs = _children(setup)
    sibling = _child(setup, 4, {"width": 8, "op": 0, "lr": 0.1}, 14)  # child 2's architecture, another lr
    units, rest = plan_supergraph([*jobs, sibling], setup[1])
    assert rest == [sibling] and len(units) == 1 and sorted(units[0].jobs) == [1, 2, 3]
    assert sibling.model.stem.weight is not jobs[0].model.stem.weight
    assert torch.equal(sibling.model.stem.weight, setup[2]["stem.weight"])  # still inherited


def test_the_unit_equals_weight_sharing_through_checkpoints(setup):
    jobs = _children(setup)
    reference = _reference(setup, jobs)
    metrics, _final = _drive(SuperGraphUnit(jobs, setup[1]))
    _same(metrics, reference)


def test_a_stopped_child_leaves_without_disturbing_the_others(setup):
    full, _ = _drive(SuperGraphUnit(_children(setup), setup[1]))
    jobs = _children(setup)
    unit = SuperGraphUnit(jobs, setup[1])
    stopped, final = _drive(unit, leave={2: 0})
    assert [len(stopped[t]) for t in (1, 2, 3)] == [EPOCHS, 1, EPOCHS]
    _same({t: stopped[t][:1] for t in (1, 3)}, {t: full[t][:1] for t in (1, 3)})  # untouched until it left
    assert stopped[2] == full[2][:1]
    # afterwards the others go on exactly as the shared weights without child 2's steps give
    _same(stopped, _reference(setup, _children(setup), leave={2: 0}))
    assert jobs[0].model.stem.weight is jobs[2].model.stem.weight  # still one tensor for the others
    assert 2 not in unit.jobs and all(2 not in m.trial_ids() for m in unit.members)
    assert not torch.equal(final[2]["stem.weight"], final[1]["stem.weight"])  # its checkpoint: its own end


def test_engine_merges_children_and_checkpoints_each(tmp_path):
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=64, lr=td.choice("lr", [0.05, 0.1]))
    strategy = td.strategy.RegularizedEvolution(population=3, sample_size=2, batch_size=4, mutation_prob=0.3,
                                                inherit_weights=True)
    runs = {}
    for optimize in (True, False):
        exp = td.Experiment(Net(), ev, strategy, max_trials=11, store=tmp_path / f"{optimize}.db", name="sg",
                            seed=1, optimize=optimize, verbose=False)
        exp.run()
        runs[optimize] = exp.trials()
    merged = [t for t in runs[True] if "merged" in t.info.get("inherit", {})]
    assert len(merged) >= 2
    assert not any("merged" in t.info.get("inherit", {}) for t in runs[False])  # separate: inherited only
    assert any(t.info.get("inherit", {}).get("tensors") for t in runs[False])
    with Store(tmp_path / "True.db", readonly=True) as db:
        by_id = {t.id: t for t in runs[True]}
        for t in merged:
            assert t.status is TrialStatus.COMPLETED and len(t.metrics["val_acc"]) == 2
            siblings = [by_id[i] for i in t.info["inherit"]["merged"]["unit"] if i != t.id]
            mine = db.load_checkpoint(t.checkpoint)
            for s in siblings:
                theirs = db.load_checkpoint(s.checkpoint)
                common = set(t.info["inherit"]["shared"].items()) & set(s.info["inherit"]["shared"].items())
                for ck, _pk in common:  # a tensor the two shared: the same value in both checkpoints
                    if ck.endswith(("weight", "bias")):
                        assert torch.equal(mine[ck], theirs[ck]), ck


SCRIPT = textwrap.dedent('''
    import sys, torch
    from torch import nn
    import tridens as td
    sys.path.insert(0, {tests!r})
    from engine.spaces import InheritNet as Net

    torch.set_num_threads(1)
    train, val = td.datasets.digits()
    train = torch.utils.data.Subset(train, range(400))  # small: the kill needs only a few epochs
    ev = td.evaluators.Classification(train=train, val=val, epochs=3, batch_size=8,
                                      lr=td.choice("lr", [0.02, 0.05]))
    strategy = td.strategy.RegularizedEvolution(population=2, sample_size=2, batch_size=3, mutation_prob=0.3,
                                                inherit_weights=True)
    td.Experiment(Net(), ev, strategy, max_trials=5, store={db!r}, name="kill", seed=2, verbose=False).run()
''')


def test_resume_after_a_kill_during_a_merged_unit(tmp_path):
    db = tmp_path / "kill.db"
    script = tmp_path / "search.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parents[1]), db=str(db)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    running: list[Trial] = []
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
        if not db.exists():
            continue
        try:
            with Store(db, readonly=True) as store:
                trials = store.trials("kill")
        except Exception:
            continue
        running = [t for t in trials if t.parent is not None and t.status is TrialStatus.RUNNING and t.metrics]
        if running:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert running, "the run never reached a child mid-training"
    subprocess.run([sys.executable, str(script)], check=True, timeout=300, capture_output=True)
    with Store(db, readonly=True) as store:
        trials = {t.id: t for t in store.trials("kill")}
        assert store.get_experiment("kill").status == "done"
        for t in running:
            again = trials[t.id]
            assert again.status is TrialStatus.COMPLETED and len(again.metrics["val_acc"]) == 3
            assert again.info["inherit"]["parent"] == t.parent and again.info["inherit"]["tensors"] > 0
            assert again.checkpoint and set(store.load_checkpoint(again.checkpoint)) == set(
                Net().freeze({"width": again.sample["width"], "op": again.sample["op"]}).state_dict())
        assert len([t for t in trials.values() if t.status is TrialStatus.COMPLETED]) == 5
        assert any("merged" in t.info.get("inherit", {}) for t in trials.values())
