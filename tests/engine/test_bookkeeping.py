"""The engine's per-trial bookkeeping: a known sample reuses its structure (fingerprint, parameter
count) without a build, the trained model is still the trial's seeded freeze, and a space whose
structure is not a function of its sample is noticed and built every time."""

from __future__ import annotations

import itertools

import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.store import Store
from tridens.trial import TrialStatus


class Net(tnn.ModelSpace):
    def __init__(self):
        super().__init__()
        w = td.choice("width", [4, 8])
        self.body = nn.Sequential(nn.Linear(3, w), nn.ReLU(), nn.Linear(w, 1))
        self.example_inputs = (torch.zeros(2, 3),)

    def forward(self, x):
        return self.body(x)


_BUILDS = itertools.count()


class Drifting(tnn.ModelSpace):
    """Its structure depends on how often it was built, not only on the sample."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [4, 8])
        extra = next(_BUILDS) % 3  # global state a structure cache cannot see
        layers = [nn.Linear(3, w)] + [nn.Linear(w, w) for _ in range(extra)] + [nn.Linear(w, 1)]
        self.body = nn.Sequential(*layers)
        self.example_inputs = (torch.zeros(2, 3),)

    def forward(self, x):
        return self.body(x)


def _recording_evaluator(seen):
    def fn(model, lr, seed):
        graph = td.graph.trace(model, (torch.zeros(2, 3),))
        seen[seed] = (graph.fingerprint(), sum(p.numel() for p in model.parameters()),
                      {k: v.clone() for k, v in model.state_dict().items()})
        return lr
    return td.evaluators.FunctionalEvaluator(fn, lr=td.choice("lr", [0.1, 0.2, 0.3, 0.4]))


def test_known_samples_reuse_their_structure_and_train_the_seeded_model(tmp_path):
    seen = {}
    space = Net()
    # GridSearch: every width comes back with four learning rates, so most trials are known samples.
    exp = td.Experiment(space, _recording_evaluator(seen), td.strategy.GridSearch(), budget=8,
                        store=tmp_path / "t.db", name="known", options=td.RunOptions(verbose=False))
    exp.run()
    trials = exp.trials()
    assert len(trials) == 8 and all(t.status is TrialStatus.COMPLETED for t in trials)
    assert len({t.fingerprint for t in trials}) == 2
    for t in trials:
        fingerprint, params, state = seen[t.seed]
        assert t.fingerprint == fingerprint and t.info["params"] == params
        torch.manual_seed(t.seed)
        expected = space.freeze({"width": t.sample["width"]}, check=False).state_dict()
        assert all(torch.equal(state[k], expected[k]) for k in expected)
        assert t.checkpoint is not None
        saved = Store(tmp_path / "t.db", readonly=True).load_checkpoint(t.checkpoint)
        assert all(torch.equal(saved[k], state[k]) for k in state)


def test_a_structure_that_depends_on_more_than_the_sample_is_built_every_time(tmp_path):
    seen = {}
    exp = td.Experiment(Drifting(), _recording_evaluator(seen), td.strategy.GridSearch(), budget=8,
                        store=tmp_path / "t.db", name="drift", options=td.RunOptions(verbose=False))
    exp.run()
    trials = [t for t in exp.trials() if t.status is TrialStatus.COMPLETED]
    assert len(trials) == 8
    for t in trials:  # every recorded fingerprint is the one of the model that trained
        assert (t.fingerprint, t.info["params"]) == seen[t.seed][:2]
    assert len({t.fingerprint for t in trials}) > 2


def test_a_parameter_constraint_rejects_before_training(tmp_path):
    seen = {}
    exp = td.Experiment(Net(), _recording_evaluator(seen), td.strategy.GridSearch(), budget=8,
                        store=tmp_path / "t.db", name="constrained",
                        options=td.RunOptions(verbose=False, constraints=[td.strategy.Constraint("params", max=30)]))
    exp.run()
    trials = exp.trials()
    failed = [t for t in trials if t.status is TrialStatus.FAILED]
    done = [t for t in trials if t.status is TrialStatus.COMPLETED]
    assert failed and done
    assert all(t.sample["width"] == 8 and "constraint violated" in t.error for t in failed)
    assert all(t.sample["width"] == 4 and t.seed in seen for t in done)
    assert not any(t.seed in seen for t in failed)
