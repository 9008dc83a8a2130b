"""The Experiment options of a one-shot run: each is applied (seeds, retry_failed, constraints) or
refused before the run in one line naming it (warm_start, allocation, stage_policy)."""

import json

import pytest
import torch

import tridens as td
from tridens.engine._loop import _trial_seed
from tridens.trial import TrialStatus

from .spaces import DigitsCNN
from .spaces import role


@pytest.fixture
def evaluator(digits_data):
    train, val = digits_data
    return td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="adam", lr=0.01)


def one_shot(tmp_path, evaluator, strategy=None, name="o", executor=None, budget=None, **options):
    return td.Experiment(DigitsCNN(), evaluator, strategy or td.oneshot.RandomOneShot(samples=2, search="random"),
                         store=tmp_path / "t.db", name=name, executor=executor, budget=budget,
                         options=td.RunOptions(verbose=False, **options))


@pytest.mark.parametrize("option, value, executor", [
    ("warm_start", True, None),
    ("stage_policy", td.store.StagePolicy(), None),
    ("allocation", td.executors.StaticFluid(), td.executors.Process(allocation=td.executors.StaticFluid())),
])
def test_an_option_a_one_shot_run_cannot_apply_is_refused_before_the_run(tmp_path, evaluator, option, value, executor):
    options = {} if option == "allocation" else {option: value}
    exp = one_shot(tmp_path, evaluator, executor=executor, **options)
    with pytest.raises(ValueError, match=f"The '{option}' parameter of Experiment is not applied by the one-shot "
                                         "strategy RandomOneShot") as info:
        exp.run()
    assert "\n" not in str(info.value)
    if (tmp_path / "t.db").exists():  # (warm start's check opens its zoo, the store) nothing was written
        with td.store.Store(tmp_path / "t.db", readonly=True) as db:
            with pytest.raises(td.StoreError):
                db.get_experiment("o")


@pytest.mark.parametrize("seeds", ["per-trial", "per-architecture"])
def test_seeds_per_architecture_gives_a_retrained_model_the_seed_a_multi_trial_run_gives_it(tmp_path, evaluator,
                                                                                           seeds):
    exp = one_shot(tmp_path, evaluator, td.oneshot.RandomOneShot(samples=2, search="random", retrain=1, epochs=1),
                   seed=7, seeds=seeds).run()
    (retrained,) = [t for t in exp.trials() if role(t) == "retrain"]
    architecture = DigitsCNN().restrict(retrained.sample)
    want = _trial_seed(7, json.dumps(architecture, sort_keys=True, default=str)) if seeds == "per-architecture" else 7
    assert retrained.seed == want and retrained.status is TrialStatus.COMPLETED


@pytest.mark.parametrize("retry", [True, False])
def test_retry_failed_trains_a_failed_supernet_again_or_a_new_one_in_its_place(tmp_path, evaluator, retry):
    first = one_shot(tmp_path, evaluator, budget=td.Budget(trial_timeout=1e-9)).run()
    (failed,) = first.trials()
    assert failed.status is TrialStatus.FAILED and failed.checkpoint and len(failed.metrics["train_loss"]) == 1
    again = one_shot(tmp_path, evaluator, retry_failed=retry).run()
    trials = again.trials()
    supernets = [t for t in trials if role(t) == "supernet"]
    if retry:   # the same supernet, continued from its checkpoint
        assert [t.id for t in supernets] == [failed.id] and supernets[0].status is TrialStatus.COMPLETED
        assert supernets[0].metrics["train_loss"][0] == failed.metrics["train_loss"][0]
    else:       # the failed one stays failed; a new one trains from its own start
        assert [t.id for t in supernets][0] == failed.id and len(supernets) == 2
        assert supernets[0].status is TrialStatus.FAILED and supernets[1].status is TrialStatus.COMPLETED
    assert len(supernets[-1].metrics["train_loss"]) == 2
    subnets = [t for t in trials if role(t) == "subnet"]
    assert len(subnets) == 2 and all(t.info["oneshot"]["supernet"] == supernets[-1].label for t in subnets)


def test_constraints_fail_the_subnets_that_violate_them_unscored_and_never_retrain_them(tmp_path, evaluator):
    limit = td.strategy.Constraint("params", max=12_000)
    exp = one_shot(tmp_path, evaluator, td.oneshot.RandomOneShot(samples=6, search="random", retrain=1, epochs=1),
                   constraints=[limit]).run()
    trials = exp.trials()
    subnets = [t for t in trials if role(t) == "subnet"]
    violating = [t for t in subnets if t.status is TrialStatus.FAILED]
    meeting = [t for t in subnets if t.status is TrialStatus.COMPLETED]
    assert violating and meeting and len(violating) + len(meeting) == len(subnets)
    for t in violating:
        assert t.error == f"constraint violated: {limit.violation(t.info)}" and t.info["params"] > 12_000
        assert not t.metrics and t.metric is None
    assert all(t.info["params"] <= 12_000 for t in meeting)
    (retrained,) = [t for t in trials if role(t) == "retrain"]
    assert retrained.info["params"] <= 12_000 and exp.best().info["params"] <= 12_000


class TwoLinear(td.nn.ModelSpace):
    """A linear classifier on digits behind a choice of two."""

    def __init__(self):
        super().__init__()
        self.op = td.nn.LayerChoice([torch.nn.Linear(64, 10), torch.nn.Linear(64, 10)], label="op")
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.op(x.flatten(1))


def test_a_resumed_experiment_of_another_search_space_is_refused_in_one_line(tmp_path, evaluator):
    td.Experiment(TwoLinear(), evaluator, td.oneshot.RandomOneShot(samples=1, search="random", epochs=1),
                  store=tmp_path / "t.db", name="o", options=td.RunOptions(verbose=False)).run()
    with pytest.raises(td.TridensError, match="experiment 'o' was run with another search space") as info:
        one_shot(tmp_path, evaluator).run()
    assert "\n" not in str(info.value) and "resume='force'" in str(info.value)
    # forced: the old supernet's weights belong to the old space, so a new supernet trains in the experiment
    one_shot(tmp_path, evaluator, resume="force").run()
    trials = td.Experiment.load(tmp_path / "t.db", "o").trials()
    old, new = [t for t in trials if role(t) == "supernet"]
    assert old.status is new.status is TrialStatus.COMPLETED and new.id > old.id
    subnets = [t for t in trials if role(t) == "subnet" and t.info["oneshot"]["supernet"] == new.label]
    assert subnets and all(set(t.sample) <= set(DigitsCNN().search_space()) and len(t.sample) > 1 for t in subnets)
    one_shot(tmp_path, evaluator).run()  # the experiment now records the new space: a plain resume is taken
