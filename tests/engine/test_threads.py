"""The thread and parallelism policy: decisions from injected machine figures, real FLOP counts,
and an experiment that trains under the decided thread count and logs it."""

import logging

import pytest
import torch
from torch import nn

import tridens as td
from tridens.engine import ThreadPolicy
from tridens.engine._threads import ThreadPlan, idle_cores, step_flops

from .spaces import TinyMLP


def test_small_steps_take_one_thread_and_run_side_by_side():
    plan = ThreadPolicy(concurrent=None).decide(step_flops=5e7, units=6, total=4, load=0.0)
    assert (plan.threads, plan.concurrent) == (1, 4) and "small steps" in plan.reason
    assert ThreadPolicy().decide(step_flops=5e7, units=6, total=4, load=0.0).concurrent == 1  # the default


def test_large_steps_take_every_idle_core():
    plan = ThreadPolicy().decide(step_flops=1e10, units=6, total=8, load=3.0)  # 2 cores busy elsewhere
    assert (plan.threads, plan.concurrent) == (6, 1) and "every idle core" in plan.reason


def test_a_loaded_machine_gives_one_thread_whatever_the_step():
    plan = ThreadPolicy().decide(step_flops=1e12, units=2, total=2, load=7.5)
    assert (plan.threads, plan.concurrent) == (1, 1) and "no idle core" in plan.reason
    assert idle_cores(2, 7.5) == 1 and idle_cores(8, 1.0) == 8 and idle_cores(8, 4.0) == 5


def test_the_user_overrides_threads_and_concurrency():
    plan = ThreadPolicy(threads=3, concurrent=2).decide(step_flops=1e3, units=8, total=2, load=9.0)
    assert (plan.threads, plan.concurrent) == (3, 2) and "set by the user" in plan.reason
    with pytest.raises(ValueError, match="The 'threads' parameter of ThreadPolicy must be None or an int"):
        ThreadPolicy(threads=0).decide(step_flops=1.0)


def test_applied_sets_and_restores_torch_threads():
    before = torch.get_num_threads()
    with ThreadPlan(threads=1, concurrent=1, reason="").applied():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_step_flops_counts_a_real_forward():
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    assert step_flops(model, torch.zeros(1, 8, 8), batch_size=16) == 3 * 2 * (64 * 32 + 32 * 10) * 16
    assert model.training  # left in the mode it was in


def test_experiment_trains_with_the_policy_threads_and_logs_it(digits_data, tmp_path, caplog):
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam",
                                      lr=td.choice("lr", [0.01, 0.003]))
    seen = []

    class Recording(ThreadPolicy):
        def decide_units(self, units, **kw):
            plan = super().decide_units(units, **kw)
            seen.append(plan)
            return plan

    before = torch.get_num_threads()
    exp = td.Experiment(TinyMLP(), ev, td.strategy.GridSearch(), max_trials=4, store=str(tmp_path / "t.db"),
                        verbose=False, executor=td.engine.InlineExecutor(threads=Recording(threads=1)))
    with caplog.at_level(logging.INFO, logger="tridens"):
        exp.run()
    assert seen and all(p.threads == 1 for p in seen)
    assert "threads: 1 per unit" in caplog.text and "set by the user" in caplog.text
    assert torch.get_num_threads() == before
    assert all(t.metric is not None for t in exp.trials())
