"""The thread and parallelism policy: decisions from injected machine figures, real FLOP counts,
and an experiment that trains under the decided thread count and logs it."""

import logging
import os

import pytest
import torch
from torch import nn

import tridens as td
from tridens.engine import ThreadPolicy
from tridens.executors._threads import (ALONE, SIDE, ThreadPlan, idle_cores, step_flops, torch_default_threads,
                                        user_torch_threads, workload_key)

from .spaces import TinyMLP

QUIET = {"total": 2, "load": 0.0, "torch_threads": 2, "default_threads": 2}  # a quiet 2-core machine, torch's default


def test_the_default_policy_keeps_one_thread_per_unit_whatever_the_load():
    """Results differ in the last bits between thread counts: the default policy never lets the
    load or a timing choose one. Idle cores train units side by side, one thread each."""
    rates = {workload_key(5e9, 2): {ALONE: [9e9], SIDE: [1e9]}}   # every idle core measured faster
    for load in (0.0, 0.5, 7.5):
        for units, splittable in ((6, True), (1, True), (6, False)):
            plan = ThreadPolicy().decide(step_flops=5e9, units=units, rates=rates, splittable=splittable,
                                         **{**QUIET, "load": load})
            assert plan.threads == 1, (load, units, splittable)
    plan = ThreadPolicy().decide(step_flops=5e9, units=6, rates=rates, **QUIET)
    assert (plan.threads, plan.concurrent, plan.option) == (1, 2, SIDE) and "repeatable" in plan.reason
    plan = ThreadPolicy().decide(None, units=1, **QUIET)
    assert (plan.threads, plan.concurrent) == (1, 1) and "repeatable=False" in plan.reason


def test_a_quiet_machine_tries_each_option_once_then_takes_the_faster():
    policy, key = ThreadPolicy(repeatable=False), workload_key(5e9, 2)
    plan = policy.decide(step_flops=5e9, units=6, **QUIET)  # a large step: every idle core first
    assert (plan.threads, plan.concurrent, plan.option, plan.key) == (2, 1, ALONE, key)
    assert "measured first" in plan.reason
    plan = policy.decide(step_flops=5e9, units=6, rates={key: {ALONE: [3e9]}}, **QUIET)
    assert (plan.threads, plan.concurrent, plan.option) == (1, 2, SIDE)
    plan = policy.decide(step_flops=5e9, units=6, rates={key: {ALONE: [3e9, 3.2e9], SIDE: [4e9]}}, **QUIET)
    assert (plan.threads, plan.concurrent, plan.option) == (1, 2, SIDE) and "side by side measured faster" in plan.reason
    plan = policy.decide(step_flops=5e9, units=6, rates={key: {ALONE: [3e9, 5e9, 4.5e9], SIDE: [4e9]}}, **QUIET)
    assert (plan.threads, plan.concurrent, plan.option) == (2, 1, ALONE)
    # a small step tries side by side first, then every idle core
    small = workload_key(5e7, 2)
    assert policy.decide(step_flops=5e7, units=6, **QUIET).option == SIDE
    assert policy.decide(step_flops=5e7, units=6, rates={small: {SIDE: [1e9]}}, **QUIET).option == ALONE
    # measurements of small steps do not decide for large ones; of other large steps they do
    assert workload_key(5e9 * 16, 2) == key
    other = {small: {ALONE: [9e9], SIDE: [1.0]}}
    assert policy.decide(step_flops=5e9, units=6, rates=other, **QUIET).option == ALONE
    assert policy.decide(step_flops=5e9, units=6, rates={key: {ALONE: [1.0]}, **other}, **QUIET).option == SIDE


def test_a_group_that_cannot_split_takes_every_idle_core_when_not_repeatable():
    rates = {workload_key(5e7, 4): {ALONE: [1e9], SIDE: [9e9]}}
    quiet4 = {**QUIET, "total": 4, "torch_threads": 4, "default_threads": 4}
    measured = ThreadPolicy(repeatable=False)
    assert measured.decide(step_flops=5e7, units=1, rates=rates, **quiet4).threads == 4
    plan = measured.decide(step_flops=5e7, units=6, rates=rates, splittable=False, **quiet4)
    assert (plan.threads, plan.concurrent, plan.option) == (4, 1, ALONE)
    plan = measured.decide(step_flops=5e7, units=3, rates=rates, **quiet4)
    assert (plan.threads, plan.concurrent, plan.option) == (1, 3, SIDE)  # no more at once than units


def test_a_loaded_machine_gives_one_thread_whatever_the_step():
    plan = ThreadPolicy().decide(step_flops=1e12, units=2, **{**QUIET, "load": 7.5})
    assert (plan.threads, plan.concurrent, plan.option) == (1, 1, "") and "no idle core" in plan.reason
    assert idle_cores(2, 7.5) == 1 and idle_cores(8, 1.0) == 8 and idle_cores(8, 4.0) == 5


def test_the_users_torch_threads_are_respected():
    # torch.set_num_threads(1) on a machine whose torch default is 2: one thread, one unit at a time,
    # on a quiet machine and whatever was measured
    rates = {workload_key(5e7, 2): {ALONE: [1e9], SIDE: [9e9]}}
    plan = ThreadPolicy().decide(step_flops=5e7, units=6, rates=rates, **{**QUIET, "torch_threads": 1})
    assert (plan.threads, plan.concurrent, plan.option) == (1, 1, "")
    assert "torch.set_num_threads(1) set by the user" in plan.reason
    # torch.set_num_threads(2) on a machine whose default is 4, even a loaded one
    plan = ThreadPolicy().decide(step_flops=5e7, units=6, total=4, load=9.0, torch_threads=2, default_threads=4)
    assert (plan.threads, plan.concurrent) == (2, 1)
    # OMP_NUM_THREADS in the environment is the user's count too, even when it equals the default
    assert user_torch_threads(current=2, default=2, environ={"OMP_NUM_THREADS": "2"}) == 2
    assert user_torch_threads(current=2, default=2, environ={}) is None
    assert torch_default_threads({"OMP_NUM_THREADS": "3"}) == 3 and torch_default_threads({}) >= 1


def test_the_user_overrides_threads_and_concurrency():
    plan = ThreadPolicy(threads=3, concurrent=2).decide(step_flops=1e3, units=8, total=2, load=9.0)
    assert (plan.threads, plan.concurrent) == (3, 2) and "set by the user" in plan.reason
    # the policy's count comes before torch's
    plan = ThreadPolicy(threads=2).decide(step_flops=1e3, units=8, **{**QUIET, "torch_threads": 1})
    assert (plan.threads, plan.concurrent) == (2, 1) and "threads=2 set by the user" in plan.reason
    plan = ThreadPolicy(concurrent=2).decide(step_flops=1e3, units=8, **{**QUIET, "total": 4, "default_threads": 4,
                                                                          "torch_threads": 4})
    assert (plan.threads, plan.concurrent) == (2, 2)
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
    exp = td.Experiment(TinyMLP(), ev, td.strategy.GridSearch(), budget=4, store=str(tmp_path / "t.db"),
                        options=td.RunOptions(verbose=False),
                        executor=td.engine.InlineExecutor(threads=Recording(threads=1)))
    with caplog.at_level(logging.INFO, logger="tridens"):
        exp.run()
    assert seen and all(p.threads == 1 for p in seen)
    assert "threads: 1 per unit" in caplog.text and "set by the user" in caplog.text
    assert torch.get_num_threads() == before
    assert all(t.metric is not None for t in exp.trials())


class QuietMachine(ThreadPolicy):
    """The measuring policy (``repeatable=False``) as it decides on a quiet 2-core machine with
    torch's default threads; it keeps its plans and the run's decisions."""

    def __init__(self):
        super().__init__(repeatable=False)
        self.plans, self.decisions = [], None

    def decide(self, step_flops, units=1, **kw):
        return super().decide(step_flops, units, **{**kw, **QUIET})

    def decide_units(self, units, *, rates=None, **kw):
        self.decisions = rates
        plan = super().decide_units(units, rates=rates, **kw)
        self.plans.append(plan)
        return plan


@pytest.mark.skipif(not hasattr(os, "fork"), reason="side by side needs os.fork")
def test_the_first_group_times_both_options_and_every_group_takes_the_faster(digits_data, tmp_path, caplog):
    """Three groups of two small trials: the first times both options on a copy of its own model
    (every idle core, then two forked copies side by side), one pair of rates recorded; every
    group takes the option of the higher rate, and the trials' results are untouched."""
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=64, optimizer="adam",
                                      lr=td.choice("lr", [0.01, 0.003, 0.001]))
    policy = QuietMachine()
    exp = td.Experiment(TinyMLP(), ev, td.strategy.GridSearch(batch_size=2), budget=6, store=str(tmp_path / "t.db"),
                        options=td.RunOptions(verbose=False),
                        executor=td.engine.InlineExecutor(threads=policy, optimize=False))
    with caplog.at_level(logging.INFO, logger="tridens"):
        exp.run()
    assert all(t.metric is not None for t in exp.trials())
    rates = policy.decisions.thread_rates[policy.plans[0].key]
    assert all(len(rates[o]) == 1 and rates[o][0] > 0 for o in (SIDE, ALONE))   # one pair, from the first group
    faster = max((ALONE, SIDE), key=lambda o: rates[o][0])
    assert [p.option for p in policy.plans[:3]] == [faster] * 3
    assert all("measured faster" in p.reason for p in policy.plans[:3])


def test_both_options_are_timed_on_the_same_group():
    """Injected measurements of a grid whose first group holds narrow models and whose second
    holds wide ones: on each group side by side is the faster option. Rates of one group per
    option would compare the narrow group side by side (1.2 GFLOP/s) with the wide group on every
    core (3.0) and pick every core; timed on the same group, the pair says side by side."""
    per_group = iter([{ALONE: 1.0e9, SIDE: 1.2e9},     # narrow models: both options on this group
                      {ALONE: 3.0e9, SIDE: 3.6e9}])    # wide models (not asked: the key has its pair)
    calls = []

    def measure(free):
        calls.append(free)
        return next(per_group)

    policy, rates = ThreadPolicy(repeatable=False), {}
    key = workload_key(5e7, 2)
    first = policy.decide(step_flops=5e7, units=4, rates=rates, measure=measure, **QUIET)
    assert (first.option, first.threads, first.concurrent) == (SIDE, 1, 2) and "measured faster" in first.reason
    assert rates == {key: {ALONE: [1.0e9], SIDE: [1.2e9]}} and calls == [2]
    second = policy.decide(step_flops=5e7, units=4, rates=rates, measure=measure, **QUIET)
    assert second.option == SIDE and calls == [2]
    # where the group's own pair says every core is faster, every core it is
    rates = {}
    plan = policy.decide(step_flops=5e7, units=4, rates=rates, measure=lambda free: {ALONE: 2e9, SIDE: 1e9}, **QUIET)
    assert (plan.option, plan.threads, plan.concurrent) == (ALONE, 2, 1)
    # a probe that cannot time the group (a user's loop) leaves the options' order: side by side first
    plan = policy.decide(step_flops=5e7, units=4, rates={}, measure=lambda free: {}, **QUIET)
    assert plan.option == SIDE and "measured first" in plan.reason
