"""Fluid allocation: the rule, the scheduler, and real runs on the process pool (packing, DDP
over gloo, a DynamicFluid move), checked against the same trials trained in-process."""

import math

import pytest
import torch

import tridens as td
from tridens.engine import DynamicFluid, Experiment, StaticFluid, fluid_shares
from tridens.trial import TrialStatus

from .spaces import Groups, MLPSpace


# -- the rule and the scheduler (pure) ---------------------------------------------------------------
def test_fluid_shares_follow_the_rule():
    # w_i = min(max(floor(h_i / sum h * n), 1/c), d)
    assert fluid_shares([8, 4, 2, 1, 1], devices=8, max_pack=2, max_span=4) == [4.0, 2.0, 1.0, 0.5, 0.5]
    assert fluid_shares([1.0] * 6, devices=2, max_pack=3) == [1 / 3] * 6
    assert fluid_shares([5.0], devices=4) == [4.0]
    assert fluid_shares([1.0, 1.0, 1.0], devices=8, max_pack=1) == [2.0, 2.0, 2.0]  # floors leave 2 idle
    with pytest.raises(ValueError, match="'max_pack' parameter of fluid_shares must be an int"):
        fluid_shares([1.0], devices=2, max_pack=0)
    with pytest.raises(ValueError, match="'profiles' parameter of fluid_shares must hold finite times"):
        fluid_shares([math.nan], devices=2)


def test_static_fluid_packs_small_trials_and_spans_big_ones():
    sched = StaticFluid(max_pack=2).scheduler(devices=4)
    for key, h in [("big", 20.0), ("mid", 8.0), ("s1", 1.0), ("s2", 1.0), ("s3", 1.0)]:
        sched.submit(key, h)
    placed = {p.key: p for p in sched.schedule()}
    assert placed["big"].share == 2.0 and len(placed["big"].devices) == 2
    assert placed["mid"].share == 1.0
    # three half shares: two packed on the last device, the third waits
    packed = [k for k in ("s1", "s2", "s3") if k in placed]
    assert len(packed) == 2 and placed[packed[0]].devices == placed[packed[1]].devices
    sched.finish(packed[0])
    later = sched.schedule()
    assert [p.key for p in later] == [k for k in ("s1", "s2", "s3") if k not in packed]
    assert sched.rescales() == {}  # StaticFluid never moves a running trial


def test_dynamic_fluid_moves_only_when_it_pays():
    sched = DynamicFluid(epsilon=0.0).scheduler(devices=2)
    sched.submit("a", 10.0)
    sched.submit("b", 1.0)
    assert [(p.key, p.share) for p in sched.schedule()] == [("a", 1.0), ("b", 0.5)]
    sched.finish("b")
    sched.schedule()
    assert sched.rescales() == {"a": 2.0}
    sched.release("a", 9.0)
    assert [(p.key, p.share, p.devices) for p in sched.schedule()] == [("a", 2.0, (0, 1))]

    # The same event with a move that costs more than it saves: no move.
    slow = DynamicFluid(epsilon=100.0).scheduler(devices=2)
    slow.submit("a", 10.0)
    slow.submit("b", 1.0)
    slow.schedule()
    slow.finish("b")
    slow.schedule()
    assert slow.rescales() == {}
    with pytest.raises(ValueError, match="'efficiency' parameter of DynamicFluid"):
        DynamicFluid(efficiency=0).scheduler(2)


def test_allocation_parameter_is_checked(tmp_path, digits_data):
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1)
    with pytest.raises(ValueError, match="The 'allocation' parameter of Experiment must be None, 'static', 'dynamic'"):
        Experiment(MLPSpace(), ev, store=tmp_path / "t.db", executor=td.executors.Process(allocation="fluid")).run()
    with pytest.raises(ValueError, match="'allocation' parameter of Experiment shares the workers"), \
            pytest.warns(DeprecationWarning, match=r"Experiment\(allocation=...\) is deprecated"):
        Experiment(MLPSpace(), ev, store=tmp_path / "t.db", allocation="static").run()   # the old keyword


# -- real runs -----------------------------------------------------------------------------------------


def _pair(tmp_path, digits_data, groups, name, **kw):
    """The same search in-process and on the pool with Fluid; returns both trial lists."""
    train, val = digits_data
    # SGD with momentum (optimizer state that a move must carry): Adam's normalized steps amplify
    # float-summation-order differences epoch by epoch, past 1e-4 within 40 epochs.
    ev = td.evaluators.Classification(train=train, val=val, epochs=td.choice("epochs", [1, 2, 12, 40]),
                                      batch_size=96, optimizer="sgd", lr=0.05, momentum=0.9)
    out = []
    for kind, executor in (("inline", td.executors.Inline()), ("process", td.executors.Process(workers=2, **kw))):
        exp = Experiment(MLPSpace(), ev, Groups(groups), store=tmp_path / "t.db", name=f"{name}-{kind}",
                         options=td.RunOptions(verbose=False), executor=executor)
        out.append(exp.run().trials())
    return out


def _assert_same_training(inline, fluid):
    assert len(inline) == len(fluid)
    for a, b in zip(inline, fluid):
        assert a.sample == b.sample and b.status is TrialStatus.COMPLETED
        assert a.metrics.keys() == b.metrics.keys()
        for key in a.metrics:
            torch.testing.assert_close(torch.tensor(b.metrics[key]), torch.tensor(a.metrics[key]), rtol=1e-4, atol=1e-4)


def test_one_trial_spans_both_workers_with_ddp_and_trains_as_in_one_process(tmp_path, digits_data):
    inline, fluid = _pair(tmp_path, digits_data, [[{"hidden": 64, "epochs": 2}]], "ddp", allocation="static")
    _assert_same_training(inline, fluid)
    assert fluid[0].info["allocation"] == [{"share": 2.0, "workers": [0, 1], "from_epoch": 0}]


def hidden_profile(sample):
    """Seconds per step by the hidden width: the schedule must not depend on this machine's load."""
    return 1e-5 * sample["hidden"]


def test_dynamic_fluid_packs_then_widens_a_trial_and_trains_as_in_one_process(tmp_path, digits_data):
    # The big trial trains ~50x longer than the small ones: it still has epochs left when they end.
    # Given profiles fix the shares (1, 0.5, 0.5, then 2 for the big trial once it is alone).
    group = [{"hidden": 512, "epochs": 40}, {"hidden": 4, "epochs": 1}, {"hidden": 4, "epochs": 2}]
    policy = DynamicFluid(epsilon=0.0, profile=hidden_profile)
    inline, fluid = _pair(tmp_path, digits_data, [group], "dyn", allocation=policy)
    _assert_same_training(inline, fluid)
    big, small1, small2 = fluid
    assert [a["share"] for a in small1.info["allocation"]] == [0.5]
    assert small1.info["allocation"][0]["workers"] == small2.info["allocation"][0]["workers"]  # packed together
    shares = [a["share"] for a in big.info["allocation"]]
    assert shares[0] == 1.0 and shares[-1] == 2.0  # moved to DDP once the small trials were done
    assert big.info["allocation"][-1]["from_epoch"] >= 1
    assert big.info["fluid_step_seconds"] == pytest.approx(512e-5)  # the given profile, not a measurement


class PidGroups(Groups):
    """Fixed groups; records the pool's worker pids whenever the engine asks for the next group."""

    def __init__(self, groups, executor):
        super().__init__(groups)
        self.executor, self.pids = executor, []

    def ask(self, remaining=None):
        self.pids.append(self.executor.pids())
        return super().ask(remaining)


def test_ddp_workers_are_reused_and_profiles_are_measured_once_per_structure(tmp_path, digits_data):
    """Two groups, each one trial data-parallel over both workers: the ranks tear their gloo group
    down and serve the next placement (same processes), and the second trial of an already
    measured structure starts from the measured profile instead of timing its steps again."""
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=td.choice("epochs", [1, 2, 12, 40]),
                                      batch_size=96, optimizer="adam", lr=td.choice("lr", [0.01, 0.02]))
    executor = td.engine.ProcessExecutor(workers=2, allocation="static")
    groups = [[{"hidden": 64, "epochs": 2, "lr": 0.01}], [{"hidden": 64, "epochs": 1, "lr": 0.01}],
              [{"hidden": 4, "epochs": 1, "lr": 0.01}, {"hidden": 4, "epochs": 1, "lr": 0.02}]]
    strategy = PidGroups(groups, executor)
    trials = Experiment(MLPSpace(), ev, strategy, store=tmp_path / "t.db", options=td.RunOptions(verbose=False),
                        executor=executor).run().trials()
    assert [t.status for t in trials] == [TrialStatus.COMPLETED] * 4
    assert [a["share"] for t in trials for a in t.info["allocation"]] == [2.0, 2.0, 1.0, 1.0]
    after_first, after_second, after_third = strategy.pids[1:]
    assert len(after_first) == 2 and after_first == after_second == after_third  # no worker was replaced
    first, second = trials[0].info["fluid_step_seconds"], trials[1].info["fluid_step_seconds"]
    assert first > 0 and second == first  # measured on the first trial's real steps, reused for the second
    assert trials[2].info["fluid_step_seconds"] > 0 and trials[2].info["fluid_step_seconds"] != first


def test_profile_parameter_is_checked():
    with pytest.raises(ValueError, match="'profile' parameter of StaticFluid must be None or a callable"):
        StaticFluid(profile=3.0).scheduler(2)
    with pytest.raises(ValueError, match="'profile' parameter of DynamicFluid must return a finite number"):
        DynamicFluid(profile=lambda sample: -1.0).step_time({"hidden": 4})


def lr_profile(sample):
    """Seconds per step by the learning rate: lr 0.2 long (a worker of its own), lr 0.05 short (packed)."""
    return 1e-2 if sample["lr"] == 0.2 else 1e-4


def test_a_packed_worker_that_dies_fails_the_trials_on_it_and_no_other(tmp_path, digits_data):
    """The driver's death message on Fluid: the two short trials share a worker (shares 0.5) and
    the width-8 one ends that process in its first epoch, while the other (three epochs, turn
    about) still trains; both fail with the worker's death, and the long trial on the other
    worker completes."""
    from .spaces import AwayMLP

    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=3, batch_size=128, optimizer="sgd",
                                      lr=td.choice("lr", [0.05, 0.2]))
    group = [{"hidden": 4, "lr": 0.2}, {"hidden": 4, "lr": 0.05}, {"hidden": 8, "lr": 0.05}]
    executor = td.executors.Process(workers=2, allocation=StaticFluid(profile=lr_profile))
    trials = Experiment(AwayMLP("die"), ev, Groups([group]), store=tmp_path / "t.db", options=td.RunOptions(verbose=False),
                        executor=executor).run().trials()
    long, short, dying = sorted(trials, key=lambda t: (-t.sample["lr"], t.sample["hidden"]))
    assert long.status is TrialStatus.COMPLETED, long.error
    assert [a["share"] for a in short.info["allocation"]] == [0.5]
    assert short.info["allocation"][0]["workers"] == dying.info["allocation"][0]["workers"]   # packed together
    for trial in (short, dying):
        assert trial.status is TrialStatus.FAILED and "worker process of trial" in trial.error, trial.error
        assert "died (exit code 3)" in trial.error, trial.error
