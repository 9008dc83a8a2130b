"""A run's planning state belongs to the run (its tridens.units.PlanContext): nothing is left in the
modules of tridens.engine, tridens.xopt or tridens.units, and two experiments in one process plan
independently. Real training on digits, real SQLite stores."""

from __future__ import annotations

import collections
import importlib
import pkgutil
import types
import weakref
from typing import Any

import torch.nn as nn

import tridens as td
import tridens.nn as tnn
from tridens.trial import TrialStatus
from tridens.xopt import Settings

PACKAGES = ("tridens.engine", "tridens.xopt", "tridens.units")
CONTAINERS = (dict, list, set, collections.deque, weakref.WeakKeyDictionary, weakref.WeakValueDictionary,
              weakref.WeakSet, bytearray)


class FixedMLP(tnn.ModelSpace):
    """One model structure, learning rates from the evaluator: one group that batching fuses."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x):
        return self.body(x)


def evaluator(data, epochs=2):
    train, val = data
    return td.evaluators.Classification(train, val, batch_size=128, epochs=epochs,
                                        lr=td.choice("lr", [0.01, 0.03, 0.1, 0.3]))


def modules() -> list[types.ModuleType]:
    found = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        found.append(package)
        for info in pkgutil.iter_modules(package.__path__, name + "."):
            try:
                found.append(importlib.import_module(info.name))
            except ImportError:  # an optional dependency (Ray) not installed
                continue
    return found


def _contents(value: Any) -> Any:
    if isinstance(value, (dict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
        return tuple((id(k), id(v)) for k, v in list(value.items()))
    if isinstance(value, (set, weakref.WeakSet)):
        return frozenset(id(v) for v in value)
    if isinstance(value, bytearray):
        return bytes(value)
    return tuple(id(v) for v in value)


def mutable_globals() -> dict[str, Any]:
    """Every module-level container of the packages, by ``module.name``, with what it holds."""
    return {f"{m.__name__}.{name}": _contents(value) for m in modules() for name, value in vars(m).items()
            if isinstance(value, CONTAINERS) and not name.startswith("__")}


def test_a_run_leaves_nothing_in_module_globals(digits_data, tmp_path):
    """An experiment that fuses trials, measures a speed-up, traces structures and stores stages
    changes no module-level dict, list or set of engine, xopt or units: its state was the run's."""
    before = mutable_globals()
    exp = td.Experiment(FixedMLP(), evaluator(digits_data), td.strategy.GridSearch(), store=tmp_path / "a.db",
                        name="a", options=td.RunOptions(verbose=False),
                        executor=td.executors.Inline(optimize=Settings().with_batching(mode="auto", override_speedup=3.0)))
    exp.run()
    assert all(t.status is TrialStatus.COMPLETED for t in exp.trials())
    assert "fused" in exp.trials()[0].info["unit"]["reason"]
    after = mutable_globals()
    changed = sorted(name for name in after if name in before and after[name] != before[name])
    assert changed == [], f"module-level state changed by a run: {changed}"


def test_two_experiments_in_one_process_plan_independently(digits_data, tmp_path):
    """The first experiment measures that fusion pays (an injected 3x); the second, in the same
    process with the same space and evaluator, where fusion does not pay (0.5x), decides from its
    own first steps instead of the first one's measurement."""
    ev = evaluator(digits_data)
    runs = {}
    for name, speedup in (("pays", 3.0), ("does-not-pay", 0.5)):
        exp = td.Experiment(FixedMLP(), ev, td.strategy.GridSearch(), store=tmp_path / "s.db", name=name,
                            options=td.RunOptions(verbose=False),
                            executor=td.executors.Inline(optimize=Settings().with_batching(mode="auto", override_speedup=speedup)))
        exp.run()
        runs[name] = exp.trials()
    for name, trials in runs.items():
        assert all(t.status is TrialStatus.COMPLETED for t in trials), name
        reason = trials[0].info["unit"]["reason"]
        assert "as measured on their first real steps" in reason, (name, reason)
        assert "earlier unit" not in reason, (name, reason)
    assert [e["fused"] for e in runs["pays"][0].info["unit"]["speedups"]] == [True]
    assert [e["fused"] for e in runs["does-not-pay"][0].info["unit"]["speedups"]] == [False]
