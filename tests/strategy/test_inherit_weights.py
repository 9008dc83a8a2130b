"""RegularizedEvolution(inherit_weights=True): children start from their parents' trained weights
for the layers they share (matched through the IR), with real training on digits."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import tridens as td
from tridens.cli import main as cli_main
from tridens.store import Store
from tridens.strategy import RegularizedEvolution
from tridens.trial import Objective, TrialStatus

from ..engine.spaces import InheritNet as Net
from .harness import Bench, finite_space, run



_DATA: dict[str, object] = {}
INITIAL: dict[int, dict[str, torch.Tensor]] = {}  # trial seed -> the model's weights when training began


def _digits():
    if "d" not in _DATA:
        _DATA["d"] = td.datasets.digits()
    return _DATA["d"]


def train_briefly(model, lr, seed):
    """A user loop: remembers the weights it was handed, then trains one epoch on digits."""
    INITIAL[seed] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train, val = _digits()
    loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        xs, ys = zip(*[val[i] for i in range(len(val))])
        acc = (model(torch.stack(xs)).argmax(1) == torch.tensor(ys)).float().mean().item()
    td.report(acc)
    return acc


def test_children_start_from_the_parents_trained_shared_layers_exactly(tmp_path):
    INITIAL.clear()
    space = Net()
    ev = td.evaluators.FunctionalEvaluator(train_briefly, lr=td.choice("lr", [0.02, 0.05]))
    strategy = RegularizedEvolution(population=3, sample_size=2, batch_size=3, mutation_prob=0.4, inherit_weights=True)
    exp = td.Experiment(space, ev, strategy, budget=12, store=tmp_path / "t.db", name="inh",
                        options=td.RunOptions(seed=3, verbose=False))
    exp.run()
    trials = {t.id: t for t in exp.trials()}
    children = [t for t in trials.values() if t.parent is not None]
    assert children, "evolution made no children"
    fractions = []
    with Store(tmp_path / "t.db", readonly=True) as db:
        for child in children:
            record = child.info["inherit"]
            assert record["parent"] == child.parent and "reason" not in record
            parent = trials[child.parent]
            parent_weights = db.load_checkpoint(parent.checkpoint)
            initial = INITIAL[child.seed]
            torch.manual_seed(child.seed)  # what the engine materializes the child from
            fresh = space.freeze(space.restrict(child.sample)).state_dict()
            shared = record["shared"]
            for key, tensor in initial.items():
                if key in shared:
                    assert torch.equal(tensor, parent_weights[shared[key]]), key
                else:
                    assert torch.equal(tensor, fresh[key]), key
            # what is shared is exactly the layers of equal type and shape in the parent
            if space.restrict(child.sample) == space.restrict(parent.sample):
                assert set(shared) == set(initial) and record["fraction"] == 1.0
            assert {"stem.weight", "stem.bias"} <= set(shared)  # the stem never changes shape
            if child.sample["width"] != parent.sample["width"]:
                assert not any(k.startswith(("conv.", "bn.", "head.")) for k in shared)
            fractions.append(record["fraction"])
    assert any(0 < f < 1 for f in fractions), fractions  # partial inheritance happened
    assert all(t.status is TrialStatus.COMPLETED for t in trials.values())
    # the command line still shows and ranks the experiment
    assert cli_main(["show", "inh", "--db", str(tmp_path / "t.db")]) == 0
    assert cli_main(["top", "inh", "-k", "3", "--db", str(tmp_path / "t.db")]) == 0


def test_off_by_default_groups_name_no_parents(tmp_path):
    result = run(RegularizedEvolution(population=4, sample_size=2, batch_size=2), Bench(finite_space()), max_trials=10)
    assert all(g.parents is None for g in result.groups)
    on = run(RegularizedEvolution(population=4, sample_size=2, batch_size=2, inherit_weights=True),
             Bench(finite_space()), max_trials=10)
    assert on.groups[0].parents is None  # the random initial population has no parents
    later = [g for g in on.groups[1:]]
    assert later and all(g.parents is not None and len(g.parents) == len(g) for g in later)
    assert any(p is not None for g in later for p in g.parents)
    # the same proposals with and without inheritance (only the groups' parents differ)
    off = run(RegularizedEvolution(population=4, sample_size=2, batch_size=2), Bench(finite_space()), max_trials=10)
    assert [g.samples for g in on.groups] == [g.samples for g in off.groups]


def test_engine_without_inheritance_records_no_parent(tmp_path):
    space = Net()
    ev = td.evaluators.FunctionalEvaluator(train_briefly, lr=td.choice("lr", [0.02, 0.05]))
    exp = td.Experiment(space, ev, RegularizedEvolution(population=2, sample_size=2, batch_size=2), budget=4,
                        store=tmp_path / "o.db", name="off", options=td.RunOptions(verbose=False))
    exp.run()
    assert all(t.parent is None and "inherit" not in t.info for t in exp.trials())


def test_parameter_is_validated():
    strategy = RegularizedEvolution(inherit_weights="yes")
    with pytest.raises(ValueError, match="'inherit_weights' parameter of RegularizedEvolution must be a bool"):
        strategy.start(finite_space(), Objective(), random.Random(0))


def test_trial_group_parents_must_match_the_samples():
    with pytest.raises(ValueError, match="'parents' parameter of TrialGroup"):
        td.TrialGroup([{"a": 1}], parents=[1, 2])
