"""The cross-model optimization knobs as one frozen td.xopt.Settings: made from the environment or
given to td.Experiment, passed to the planners (no module state), plain data for Ray workers."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.xopt import BatchingSettings, CSESettings, Settings, resolve_settings
from tridens.xopt._decision_cache import default_path


class Mlp(tnn.ModelSpace):
    """One structure, two learning rates: a same-shaped pair the batching planner can fuse."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def test_environment_and_defaults():
    assert Settings.from_env({"TRIDENS_DECISION_CACHE": "off"}) == Settings()
    assert Settings.from_env({}) == Settings().with_batching(decision_cache=str(default_path()))  # the user's cache file
    env = Settings.from_env({"TRIDENS_BATCHING": "force", "TRIDENS_CSE_JOINT": "0", "TRIDENS_CSE_WIDE": "off"})
    assert (env.batching.mode, env.cse.joint, env.cse.wide) == ("force", False, "off")
    with pytest.raises(ValueError, match=r"^\$TRIDENS_BATCHING must be one of \['auto', 'force', 'off'\]. Got 'on' instead.$"):
        Settings.from_env({"TRIDENS_BATCHING": "on"})
    with pytest.raises(ValueError, match="'wide' parameter of CSESettings"):
        CSESettings(wide="always")
    with pytest.raises(ValueError, match="'max_unit_size' parameter of BatchingSettings"):
        BatchingSettings(max_unit_size=1)


def test_frozen_and_plain_data():
    settings = Settings().with_batching(mode="off", override_speedup=2.0).with_cse(fast_pools=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.batching.mode = "force"  # type: ignore[misc]
    data = settings.as_dict()
    assert data["batching"]["mode"] == "off" and data["cse"]["fast_pools"] is False
    assert Settings.from_dict(data) == settings
    assert resolve_settings(False) is None and resolve_settings(settings) is settings
    with pytest.raises(ValueError, match="'optimize' parameter of Experiment must be True, False or a td.xopt.Settings"):
        resolve_settings("yes")


def test_experiments_in_one_process_plan_with_their_own_settings(tmp_path, caplog, monkeypatch):
    """One experiment forces batching, the next turns it off, the next reads the environment: each
    plans as its own settings say (nothing is left behind in module state)."""
    train, val = td.datasets.digits()
    ev = td.evaluators.Classification(train, val, epochs=1, batch_size=128, lr=td.choice("lr", [0.1, 0.05]))

    def run(name, optimize):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tridens"):
            td.Experiment(Mlp(), ev, td.strategy.GridSearch(), store=tmp_path / f"{name}.db", name=name,
                          executor=td.executors.Inline(optimize=optimize), options=td.RunOptions(verbose=False)).run()
        return caplog.text

    assert "batched unit of 2" in run("forced", Settings().with_batching(mode="force"))
    assert "batched unit" not in run("off", Settings().with_batching(mode="off"))
    monkeypatch.setenv("TRIDENS_BATCHING", "force")
    assert "batched unit of 2" in run("environment", True)
    with pytest.raises(ValueError, match="'optimize' parameter of Experiment"):
        td.Experiment(Mlp(), ev, store=tmp_path / "bad.db", executor=td.executors.Inline(optimize="fast"),
                      options=td.RunOptions(verbose=False)).run()
