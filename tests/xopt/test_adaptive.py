"""Operator batching decided from a unit's own first real training steps (tridens.xopt._adaptive):
whichever way a group goes, mid-way through its first epoch, its results are those of fused or of
separate training from the start."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tridens as td
from tridens.executors._planner import plan
from tridens.units import PlanContext, SeparateUnit
from tridens.evaluators import NonFiniteLoss
from tridens.trial import TrialStatus
from tridens.xopt import Settings, _batching
from tridens.xopt._adaptive import AdaptiveMember, AdaptiveUnit
from tridens.xopt._batching import BatchedUnit
from tridens.xopt._batching import plan_batching as plan_batching_in
from tridens.xopt._cse import SharedPipelineUnit

from .test_batching import SAMPLES, TOL, HpSpace, assert_close_runs, assert_same_trials, cnn, evaluator, json_key, make_jobs, mlp, plain, run
from .test_planning import Counter


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


RUN: list[PlanContext] = [PlanContext()]   # the plan context of the test's current run


def new_run() -> None:
    """Later planning belongs to a new run: nothing measured before it is known."""
    RUN[0] = PlanContext()


def plan_batching(jobs, ev, **kw):
    """The batching planner in the current run's plan context."""
    return plan_batching_in(jobs, ev, context=RUN[0], **kw)


@pytest.fixture(autouse=True)
def clean_cache():
    """No speed-up measured by an earlier test."""
    new_run()
    yield
    new_run()


def auto(speedup=None):
    """The default batching mode; ``speedup`` replaces the measured one in the decision."""
    return Settings().with_batching(mode="auto", override_speedup=speedup)


def assert_equal_runs(a, b):
    """Bit-identical per-epoch metrics and final weights (the decision changed nothing)."""
    assert a[0].keys() == b[0].keys()
    for tid in a[0]:
        for ra, rb in zip(a[0][tid], b[0][tid], strict=True):
            if isinstance(ra, BaseException):
                assert type(ra) is type(rb) and (ra.epoch, ra.batch) == (rb.epoch, rb.batch)
            else:
                assert ra == rb, (tid, ra, rb)
    assert a[1].keys() == b[1].keys()
    for tid in a[1]:
        for k, v in a[1][tid].items():
            assert torch.equal(v, b[1][tid][k]), (tid, k)


def adaptive(jobs, ev, settings=None):
    units, rest = plan_batching(jobs, ev, settings=settings or auto())
    assert rest == [] and len(units) == 1 and isinstance(units[0], AdaptiveUnit)
    assert units[0].member.state == "deciding"
    return units[0]


def planned_fused(units):
    """One unit, fused from the start on an earlier measurement (no deciding steps)."""
    return len(units) == 1 and isinstance(units[0], AdaptiveUnit) and units[0].member.state == "fused"


def test_fused_decision_equals_forced_fusion_and_separate(data, monkeypatch, caplog):
    """Decided fused (the measured ratio overridden) after real steps of both kinds: per-epoch
    metrics and weights exactly those of a BatchedUnit fused from the start, within 1e-4 of
    separate training; the timing trial's model is back at its initial weights."""
    settings = auto(5.0)
    ev = evaluator(data, "sgd")
    jobs = make_jobs(SAMPLES, cnn)
    initial = {k: v.clone() for k, v in jobs[0].model.state_dict().items()}
    unit = adaptive(jobs, ev, settings)
    assert "fused or not as measured on their first real steps" in unit.summary()
    with caplog.at_level(logging.INFO, logger="tridens"):
        decided = run(unit, stop={2: 1})
    member = unit.member
    assert member.state == "fused" and "fused: settings.override_speedup: 5.00x" in caplog.text
    assert all(torch.equal(v, initial[k]) for k, v in jobs[0].model.state_dict().items())
    assert_equal_runs(run(BatchedUnit(make_jobs(SAMPLES, cnn), ev), stop={2: 1}), decided)
    assert_close_runs(run(SeparateUnit(make_jobs(SAMPLES, cnn), ev), stop={2: 1}), decided, TOL, weight_tol=2e-3)


def test_separate_decision_after_fused_steps_equals_separate(data, monkeypatch, caplog):
    """Decided separate after the fused stack trained real batches: the trials' trainers replay
    the batches kept so far and go on: bit-identical to separate training; a stopped trial too."""
    settings = auto(0.5)
    ev = evaluator(data, "adam")
    samples = [dict(s, lr=s["lr"] / 10) for s in SAMPLES]
    unit = adaptive(make_jobs(samples, cnn), ev, settings)
    with caplog.at_level(logging.INFO, logger="tridens"):
        decided = run(unit, stop={1: 1})
    member = unit.member
    assert member.state == "separate" and member.fused is None and member._fused_calls >= 4
    assert "not fused: settings.override_speedup: 0.50x; 0.54x from here (separate would train the 4 batches " \
        "taken again) (below 1.10x)" in caplog.text
    assert "trained separately on one data pipeline" in caplog.text
    # stepped as the planner's separate training steps them: one backward, the exact max-pool kernel
    assert "joint step (one backward) for trials [0, 1, 2, 3]" in member.decision
    assert "2x2 max-pools of trials [0, 1, 2, 3] run by an exact two-pass kernel" in member.decision
    assert_equal_runs(run(SeparateUnit(make_jobs(samples, cnn), ev), stop={1: 1}), decided)


def test_a_model_near_the_peak_still_decides_by_its_measurement(data, monkeypatch, caplog):
    """One model's step rate against the peak matmul rate is recorded and logged, never decides:
    with an injected 5x the group fuses (after fused steps were taken) whatever that rate is, and
    the next group of the same key is planned fused from the cache."""
    settings = auto(5.0)
    ev = evaluator(data, "sgd", epochs=1)
    unit = adaptive(make_jobs(SAMPLES, mlp), ev, settings)
    with caplog.at_level(logging.INFO, logger="tridens"):
        decided = run(unit)
    assert unit.member.state == "fused" and unit.member._fused_calls > 0
    assert "of the peak matmul rate" in unit.member.decision
    fraction, rate, seconds = next(iter(RUN[0].decisions.efficiency.values()))
    assert fraction > 0 and rate > 0 and seconds > 0
    assert_equal_runs(run(BatchedUnit(make_jobs(SAMPLES, mlp), ev)), decided)
    units, rest = plan_batching(make_jobs(SAMPLES, mlp), ev, settings=settings)
    assert rest == [] and planned_fused(units)


@pytest.mark.parametrize("speedup", [5.0, 0.5])
def test_a_members_checkpoint_whichever_way_the_group_decided(data, speedup):
    """``unit.state_dict(trial)`` (what a Ray unit task saves after every epoch) from the fused
    stack or from the trial's own trainer once the group went separate."""
    unit = adaptive(make_jobs(SAMPLES, mlp), evaluator(data, "sgd"), auto(speedup))
    unit.train_epoch()
    assert unit.member.state == ("fused" if speedup > 1 else "separate")
    for tid in unit.trial_ids():
        state = unit.state_dict(tid)
        assert state is not None and state["epoch"] == 1, tid


def test_measured_decision_is_cached(data, caplog):
    """A real measurement (no override): the speed-up is finite, cached per key, and the next
    group of that key is planned by it (fused as a BatchedUnit, or left unfused)."""
    ev = evaluator(data, "sgd", epochs=1)
    unit = adaptive(make_jobs(SAMPLES, mlp), ev)
    run(unit)
    assert unit.member.state in ("fused", "separate") and "measured from" in unit.member.decision
    assert len(RUN[0].decisions.speedups) == 1
    [speedup] = next(iter(RUN[0].decisions.speedups.values()))
    assert 0 < speedup < float("inf")
    assert unit.member.state == ("fused" if speedup >= auto().batching.min_speedup else "separate")
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, rest = plan_batching(make_jobs(SAMPLES, mlp), ev, settings=auto())
    if _batching.settled_speedup([speedup], auto().batching) is None:  # near the bar: measured again
        assert [type(u) for u in units] == [AdaptiveUnit]
    elif speedup >= auto().batching.min_speedup:
        assert planned_fused(units) and "earlier unit's first steps" in units[0].summary()
    else:
        assert units == [] and "earlier unit's first steps" in caplog.text


@pytest.mark.parametrize("first, second, third", [(1.0, 1.3, 1.25), (1.3, 0.9, 0.95)])
def test_a_decision_near_the_bar_is_measured_again_until_three_agree(data, caplog, first, second, third):
    """A measured speed-up within 25% of the bar (1.1x) may lie on the wrong side of it: later
    groups of that key measure again until three measurements were taken, then follow their median;
    a clear one (5x) is reused at once."""
    ev = evaluator(data, "sgd", epochs=1)
    for ratio in (first, second):
        unit = adaptive(make_jobs(SAMPLES, mlp), ev, auto(ratio))  # measured again: an adaptive unit
        run(unit)
    run(adaptive(make_jobs(SAMPLES, mlp), ev, auto(third)))
    assert next(iter(RUN[0].decisions.speedups.values())) == [first, second, third]
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, rest = plan_batching(make_jobs(SAMPLES, mlp), ev, settings=auto())
    median = sorted([first, second, third])[1]
    if median >= 1.1:
        assert planned_fused(units)
        assert f"measured {median:.2f}x on an earlier unit's first steps, the median of 3" in units[0].summary()
    else:
        assert units == [] and f"measured {median:.2f}x on an earlier unit's first steps, the median of 3" in caplog.text
    new_run()
    run(adaptive(make_jobs(SAMPLES, mlp), ev, auto(5.0)))
    units, _ = plan_batching(make_jobs(SAMPLES, mlp), ev, settings=auto())
    assert planned_fused(units)
    once = Settings().with_batching(mode="auto", marginal_measurements=1)
    new_run()
    run(adaptive(make_jobs(SAMPLES, mlp), ev, auto(first)))
    units, rest = plan_batching(make_jobs(SAMPLES, mlp), ev, settings=once)
    if first >= 1.1:  # one measurement decides: no deciding steps either way
        assert planned_fused(units)
    else:
        assert units == [] and len(rest) == len(SAMPLES)


def test_a_decision_holds_for_groups_of_another_data_order_and_under_other_threads(data):
    """The cache key is taken at planning and leaves out the data order: a later group of the same
    model and setup but another data order is planned from the first group's measurement, also
    when the first unit ran under other torch threads than the planner's (the engine's thread
    policy sets them per unit)."""
    unit = adaptive(make_jobs(SAMPLES, mlp), evaluator(data, "sgd", epochs=1, data_seed=1), auto(5.0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if threads == 1 else 1)
    try:
        run(unit)
    finally:
        torch.set_num_threads(threads)
    assert unit.member.state == "fused"
    units, rest = plan_batching(make_jobs(SAMPLES, mlp), evaluator(data, "sgd", epochs=1, data_seed=2),
                                settings=auto())
    assert rest == [] and planned_fused(units)
    assert "measured 5.00x on an earlier unit's first steps" in units[0].summary()


def test_more_rounds_only_to_confirm_fusing_just_above_the_bar(data):
    """Just above the bar (an injected 1.2x; the bar is 1.1x) the group times twice the rounds before
    fusing; just below it (1.0x) it goes separate after ``measure_rounds``, throwing away no more
    fused steps than those. (Budgets of 20 epochs, stopped after one: the steps taken weigh
    little against what is left.)"""
    ev = evaluator(data, "sgd", epochs=20)
    stop = {t: 1 for t in range(len(SAMPLES))}
    rounds = auto().batching.measure_rounds
    above = adaptive(make_jobs(SAMPLES, mlp), ev, auto(1.2))
    run(above, stop=stop)
    assert above.member.state == "fused" and len(above.member._fused_steps) == 2 * rounds
    new_run()
    below = adaptive(make_jobs(SAMPLES, mlp), ev, auto(1.0))
    run(below, stop=stop)
    assert below.member.state == "separate" and len(below.member._fused_steps) == rounds


@pytest.mark.parametrize("epochs", [1, 20])
def test_a_short_run_keeps_the_fused_steps_it_took(data, caplog, epochs):
    """Fusion measured at 1.0x, under the 1.1x bar: with one epoch of 23 steps to train, going
    separate would train the kept batches again on three of the four models, so fused is cheaper
    from here and the group stays fused; with budgets of 20 epochs (stopped after one) it goes
    separate. Either way the cache keeps the measured 1.0x for later groups."""
    ev = evaluator(data, "sgd", epochs=epochs)
    unit = adaptive(make_jobs(SAMPLES, mlp), ev, auto(1.0))
    with caplog.at_level(logging.INFO, logger="tridens"):
        run(unit, stop={t: 1 for t in range(len(SAMPLES))})
    member = unit.member
    assert member.speedup == 1.0 and RUN[0].decisions.speedups[member.key] == [1.0]
    here = member.decision.split("; ")[1].split("x from here")[0]
    if epochs == 1:
        assert member.state == "fused" and float(here) >= auto().batching.min_speedup
    else:
        assert member.state == "separate" and 1.0 < float(here) < auto().batching.min_speedup


def test_the_speedup_from_here_counts_the_batches_to_train_again(data):
    """Injected step times: one model's separate step 10 ms, fused 10 ms per model (1.0x); 6 kept
    batches of a 23-step epoch with 6 validation batches (8 and 4 ms per model), 4 models, one
    epoch: going separate trains 3 x 6 batches again (0.18 s) on top of what is left."""
    member = adaptive(make_jobs(SAMPLES, mlp), evaluator(data, "sgd", epochs=1)).member
    member._separate, member._fused_steps = [0.010] * 3, [(0.040, 4)] * 3
    member._eval = (0.008, 0.004)
    member._kept = [None] * 6
    left_separate = 17 * 0.010 + 6 * 0.008          # one model, the rest of the epoch
    ratio = member._ratio()
    assert ratio == pytest.approx((23 * 0.010 + 6 * 0.008) / (23 * 0.010 + 6 * 0.004))
    expected = ratio * (3 * 6 * 0.010 + 4 * left_separate) / (4 * left_separate)
    assert member._from_here(ratio) == pytest.approx(expected)
    assert ratio < auto().batching.min_speedup <= expected  # measured under the bar, over it from here


def test_the_speedup_is_the_ratio_of_median_step_times(data):
    """Injected step times (CPU seconds) as a Fashion-MNIST CNN group of 4 measured them: one model
    alone is noisier than the fused stack, so its least time understates separate training (1.05x
    here, where the whole run measured 1.3x faster fused); the medians give 1.15x."""
    member = adaptive(make_jobs(SAMPLES, mlp), evaluator(data, "sgd", epochs=1)).member
    member._separate = [0.0121, 0.0097, 0.0107]
    member._fused_steps = [(0.0368, 4), (0.0372, 4), (0.0388, 4)]
    member._eval = ()  # no evaluation forwards timed: the training steps alone
    assert member._ratio() == pytest.approx(0.0107 / 0.0093)
    assert min(member._separate) / (0.0368 / 4) < auto().batching.min_speedup <= member._ratio()


def test_the_speedup_weighs_validation_by_its_batches(data):
    """An epoch of digits at batch 64 is 23 training steps and 6 validation batches; injected
    evaluation forwards (one model 8.6 ms, the fused stack 3.5 ms per model) count that many times."""
    member = adaptive(make_jobs(SAMPLES, mlp), evaluator(data, "sgd", epochs=1)).member
    member._separate, member._fused_steps = [0.0107] * 3, [(0.0372, 4)] * 3
    member._eval = (0.0086, 0.0035)
    assert member._epoch_batches() == (23, 6)
    expected = (23 * 0.0107 + 6 * 0.0086) / (23 * 0.0093 + 6 * 0.0035)
    assert member._ratio() == pytest.approx(expected) and expected > 0.0107 / 0.0093


def test_a_measured_decision_times_evaluation_forwards(data, caplog):
    unit = adaptive(make_jobs(SAMPLES, mlp), evaluator(data, "sgd", epochs=1))
    with caplog.at_level(logging.INFO, logger="tridens"):
        run(unit)
    one, fused = unit.member._eval
    assert one > 0 and fused > 0
    assert "real steps and evaluation forwards:" in caplog.text


@pytest.mark.parametrize("speedup", [5.0, 0.5])
def test_nan_member_and_budgets(data, monkeypatch, speedup):
    """A diverging trial fails alone at the same epoch and batch, a trial with a smaller budget
    stops early, whichever way the group goes."""
    settings = auto(speedup)
    samples = [*SAMPLES[:3], dict(lr=1e12, m=0.9, wd=0.0, s="constant", p=0.1)]
    ev = evaluator(data, "sgd")

    def jobs():
        out = make_jobs(samples, plain)
        out[1].max_steps = 1
        return out

    decided = run(adaptive(jobs(), ev, settings))
    separate = run(SeparateUnit(jobs(), ev))
    assert isinstance(decided[0][3][-1], NonFiniteLoss) and len(decided[0][1]) == 1
    if speedup < 1:
        assert_equal_runs(separate, decided)
    else:
        assert_close_runs(separate, decided, TOL, weight_tol=2e-3)


@pytest.mark.parametrize("speedup", [5.0, 0.5])
def test_epoch_too_short_to_decide_decides_at_its_end(data, monkeypatch, speedup):
    """Two batches per epoch: the decision is taken at the first epoch's end on what was timed
    (the fused stack trains the kept batches first)."""
    settings = auto(speedup)
    train, val = data
    small = (torch.utils.data.Subset(train, range(100)), val)
    ev = evaluator(small, "sgd")
    unit = adaptive(make_jobs(SAMPLES, mlp), ev, settings)
    decided = run(unit)
    assert unit.member.state == ("fused" if speedup > 1 else "separate")
    separate = run(SeparateUnit(make_jobs(SAMPLES, mlp), ev))
    assert_close_runs(separate, decided, TOL, weight_tol=1e-3)


@pytest.mark.parametrize("speedup", [5.0, 0.5])
def test_adaptive_member_in_a_mixed_unit(data, monkeypatch, speedup):
    """plan(): an adaptive group and a lone trial on one augmented pipeline, in one mixed unit;
    equal to separate training, augmentation once per batch."""
    settings = auto(speedup)
    aug = Counter()
    ev = evaluator(data, "sgd", transforms=aug)
    builders = [mlp, mlp, mlp, lambda p: nn.Sequential(nn.Flatten(), nn.Linear(64, 20), nn.ReLU(), nn.Linear(20, 10))]

    separate = run(SeparateUnit(make_jobs(SAMPLES, builders), ev), stop={0: 1})
    units = plan(make_jobs(SAMPLES, builders), ev, optimize=settings)
    assert len(units) == 1 and isinstance(units[0], SharedPipelineUnit)
    members = [m for m in units[0].members if isinstance(m, AdaptiveMember)]
    assert len(members) == 1 and members[0].trial_ids() == [0, 1, 2]
    aug.calls = 0
    mixed = run(units[0], stop={0: 1})
    assert members[0].state == ("fused" if speedup > 1 else "separate")
    assert aug.calls == units[0].counts["batches"]
    assert_close_runs(separate, mixed, TOL, weight_tol=2e-3)


def test_experiment_auto_equals_separate(data, tmp_path):
    """td.Experiment(optimize=True) in the default mode (each group decides on its own steps)
    gives the metrics of optimize=False."""
    train, val = data
    ev = td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="sgd",
                                      lr=td.choice("lr", [0.1, 0.05, 0.02]))
    results = {}
    for optimize in (False, True):
        exp = td.Experiment(HpSpace(), ev, td.strategy.GridSearch(), budget=6, store=tmp_path / f"{optimize}.db",
                            name="hp", executor=td.executors.Inline(optimize=optimize),
                            options=td.RunOptions(verbose=False, seed=3))
        exp.run()
        results[optimize] = {json_key(t.sample): t for t in exp.trials()}
    assert_same_trials(results[False], results[True], 6)


def test_cheap_structure_keys(data):
    """Models whose modules agree in class and plain attributes share one traced structure key;
    a dropout's p may differ; a different width or a hook sets a model apart."""
    a, b = HpSpace().freeze({"width": 16, "p": 0.0}), HpSpace().freeze({"width": 16, "p": 0.0})
    c, d = HpSpace().freeze({"width": 16, "p": 0.2}), HpSpace().freeze({"width": 32, "p": 0.0})
    key = _batching._attribute_key
    assert key(a) == key(b) is not None and key(a) != key(c) and key(a) != key(d)
    assert key(nn.Sequential(nn.Dropout(0.1))) == key(nn.Sequential(nn.Dropout(0.5)))
    hooked = HpSpace().freeze({"width": 16, "p": 0.0})
    hooked.body[1].register_forward_hook(lambda *args: None)
    assert key(hooked) is None
    ev = evaluator(data, "sgd", epochs=1)
    jobs = make_jobs(SAMPLES[:3], mlp)
    jobs[0].model, jobs[1].model, jobs[2].model = a, c, d
    keys = _batching._structure_keys(jobs, RUN[0].decisions)
    assert isinstance(keys[0], str) and keys[0] == keys[1] and keys[2] is None  # d: no partner, not traced
    assert keys[0] == _batching._structure_key(b)
    bytes_, flops, pools = _batching._model_costs(a, data[0].tensors[0][:64], ev.config(SAMPLES[0]))
    assert bytes_ > 0 and flops == 3 * 2 * 64 * (64 * 16 + 16 * 10) and not pools
    assert _batching._model_costs(cnn(0.0), data[0].tensors[0][:64], ev.config(SAMPLES[0]))[2]  # its MaxPool2d


@pytest.mark.slow  # the default run has adaptive units on Ray in test_executor_conformance's Ray cases
def test_adaptive_units_on_ray(monkeypatch, data, tmp_path, caplog):
    """On Ray the worker decides (the driver sends mode "auto"); checkpoints are taken from what
    the groups became (separate trainers after fused steps here); metrics as in-process."""
    ray = pytest.importorskip("ray")
    from tests.engine.spaces import TinyMLP
    from tests.engine.test_ray_units import SeenInStorage

    settings = auto(0.5)
    train, val = data
    ev = td.evaluators.Classification(train=train, val=val, epochs=2, batch_size=128, optimizer="adam",
                                      lr=td.choice("lr", [0.01, 0.003]))
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    seen = SeenInStorage()  # the group's folders under storage are removed when it ends
    try:
        runs = []
        for kind, executor in (("inline", td.executors.Inline(optimize=settings)),
                               ("ray", td.executors.Ray(workers=1, optimize=settings))):
            exp = td.Experiment(TinyMLP(), ev, td.strategy.GridSearch(), budget=4,
                                options=td.RunOptions(seed=5, verbose=False), store=tmp_path / f"{kind}.db",
                                name="adaptive", executor=executor, callbacks=[seen] if kind == "ray" else [])
            with caplog.at_level(logging.INFO, logger="tridens"):
                runs.append(exp.run().trials())
    finally:
        ray.shutdown()
    inline, on_ray = runs
    assert "trained separately on one data pipeline" in caplog.text
    assert "the driver planned" not in caplog.text
    assert [t.sample for t in inline] == [t.sample for t in on_ray]
    for a, b in zip(inline, on_ray):
        assert a.status is TrialStatus.COMPLETED and b.status is TrialStatus.COMPLETED, (a.error, b.error)
        for key in a.metrics:
            assert all(abs(x - y) <= TOL for x, y in zip(a.metrics[key], b.metrics[key])), key
    for t in on_ray:
        assert "epoch-2.pt" in seen.files[t.id]
        saved = seen.saved[t.id]
        assert saved["trainer"] is not None and saved["trainer"]["epoch"] == 2


@pytest.mark.parametrize("shrunk_ratio", [0.5, 3.0])
def test_a_fused_stack_that_shrinks_measures_again_and_may_go_on_separately(data, caplog, shrunk_ratio):
    """When a strategy stops some of a fused stack's trials (ASHA after a rung), the stack's next
    steps at its new size are timed against the separate step measured when it decided; below 1x
    (an injected 0.5x) its models go on as separate trainers from their rows' checkpoints, with
    results equal to fused training throughout to rounding (float64: 1e-9; dropout masks, BatchNorm
    statistics, momenta and lr schedules carried over); at 3x it stays fused."""
    def build(p):
        return mlp(p, torch.float64)

    ev = evaluator(data, "sgd", epochs=4)
    stop = {0: 1, 1: 1}  # two of the four trials stop after their first epoch
    unit = adaptive(make_jobs(SAMPLES, build), ev, auto(5.0))
    history, weights, epoch = {}, {}, 0
    with caplog.at_level(logging.INFO, logger="tridens"):
        while unit.active():
            if epoch == 1:  # the injected ratio now stands for the shrunk stack's measurement
                unit.member.settings = auto(shrunk_ratio).batching
            for tid, result in unit.train_epoch().items():
                history.setdefault(tid, []).append(result)
            for job in unit.active():
                tid = job.trial.id
                if unit.epoch(tid) >= unit.limit(tid) or stop.get(tid) == unit.epoch(tid):
                    weights[tid] = unit.weights(tid)
                    unit.drop(tid)
            epoch += 1
    member = unit.member
    assert member._decided_k == 4 and member._separate_step is not None
    if shrunk_ratio < 1:
        assert member.state == "separate" and "separately from epoch 3: 2 of 4 models left" in member.decision
        assert "train separately from epoch 3" in caplog.text
    else:
        assert member.state == "fused" and "stay fused: 2 of 4 models left" in caplog.text
    fused_throughout = run(BatchedUnit(make_jobs(SAMPLES, build), ev), stop=stop)
    assert_close_runs(fused_throughout, (history, weights), 1e-9, weight_tol=1e-9)
    assert all(len(history[t]) == (1 if t in stop else 4) for t in history)
    # a later group of the same key starts fused, with the separate step to compare with
    units, _ = plan_batching(make_jobs(SAMPLES, build), ev, settings=auto())
    assert planned_fused(units) and units[0].member._separate_step == member._separate_step


def test_the_unit_size_is_chosen_by_measurement(data, caplog):
    """K by measurement: a group of 8 whose fusion 8 at a time measured below the bar is tried 4 at
    a time next (measured on those units' first real steps); once fusing 4 at a time measured
    better, later groups are planned as units of 4, fused from the start."""
    ev = evaluator(data, "sgd", epochs=1)
    eight = SAMPLES + [dict(s, lr=s["lr"] / 2) for s in SAMPLES]
    run(adaptive(make_jobs(eight, mlp), ev, auto(0.5)))          # 8 at a time: 0.5x, goes separate
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, rest = plan_batching(make_jobs(eight, mlp), ev, settings=auto(1.6))
    assert rest == [] and [len(u.trial_ids()) for u in units] == [4, 4]
    assert all(u.member.state == "deciding" for u in units)
    assert "in units of at most 4: fused 8 at a time measured 0.50x, below 1.10x: trying 4" in caplog.text
    for unit in units:
        run(unit)                                                 # 4 at a time: 1.6x (the override)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tridens"):
        units, rest = plan_batching(make_jobs(eight, mlp), ev, settings=auto())
    assert rest == [] and [len(u.trial_ids()) for u in units] == [4, 4]
    assert all(u.member.state == "fused" for u in units)
    assert "fused 4 at a time measured 1.60x, the best per model (8: 0.50x)" in caplog.text
