import contextlib
import io
import json
import time

import pytest
import torch

import tridens as td
from tridens.cli import main
from tridens.engine import Experiment, load
from tridens.store import Store
from tridens.trial import TrialStatus

from . import spaces
from .spaces import (TinyCNN, TinyMLP, nan_on_hidden_8, raise_on_hidden_8, score_by_width, sleep_briefly,
                     sleep_on_hidden_8)


def _run(tmp_path, space, evaluator, strategy=None, name="exp", max_trials=None, max_duration=None, executor=None,
         **options):
    exp = Experiment(space, evaluator, strategy, store=tmp_path / "t.db", name=name, executor=executor,
                     budget=td.Budget(max_trials=max_trials, max_duration=max_duration),
                     options=td.RunOptions(verbose=False, **options))
    return exp.run()


def test_declarative_search_end_to_end(tmp_path, classification):
    exp = _run(tmp_path, TinyCNN(), classification, td.strategy.RegularizedEvolution(population=3, sample_size=2),
               max_trials=5)
    trials = exp.trials()
    counted = [t for t in trials if t.status is not TrialStatus.DUPLICATE]
    assert len(counted) == 5
    for t in counted:
        assert t.status is TrialStatus.COMPLETED
        assert len(t.metrics["val_acc"]) == 2 and len(t.metrics["train_loss"]) == 2
        assert t.metric == t.metrics["val_acc"][-1]
        assert t.fingerprint and t.info["params"] > 0 and t.checkpoint
        assert set(t.sample) == {"width", "op", "lr"}
    top = exp.top(3)
    assert [t.metric for t in top] == sorted((t.metric for t in counted), reverse=True)[:3]
    assert exp.best().id == top[0].id
    # trained well above chance on real digits
    assert exp.best().metric > 0.3


def test_same_sample_and_seed_give_same_metrics(tmp_path, classification):
    a = _run(tmp_path, TinyCNN(), classification, td.strategy.Random(), name="a", max_trials=3, seed=7)
    b = _run(tmp_path, TinyCNN(), classification, td.strategy.Random(), name="b", max_trials=3, seed=7)
    ta, tb = a.trials(), b.trials()
    assert [t.sample for t in ta] == [t.sample for t in tb]
    assert [t.seed for t in ta] == [t.seed for t in tb]
    assert [t.metrics for t in ta] == [t.metrics for t in tb]


def test_load_reads_back_without_training(tmp_path, classification):
    _run(tmp_path, TinyCNN(), classification, max_trials=2, name="readback")
    exp = Experiment.load(tmp_path / "t.db", "readback")
    assert len(exp.trials()) >= 2
    assert exp.best() is not None and exp.best().metric is not None


def test_functional_evaluator_and_dedup(tmp_path):
    ev = td.evaluators.FunctionalEvaluator(score_by_width, scale=td.choice("scale", [1.0]))
    exp = _run(tmp_path, TinyMLP(), ev, td.strategy.Random(), max_trials=10)
    trials = exp.trials()
    completed = [t for t in trials if t.status is TrialStatus.COMPLETED]
    # only two distinct models exist: the rest are duplicates and the run ends
    assert sorted(t.sample["hidden"] for t in completed) == [4, 8]
    assert all(t.status in (TrialStatus.COMPLETED, TrialStatus.DUPLICATE) for t in trials)
    best = exp.best()
    assert best.sample["hidden"] == 8 and best.metric == pytest.approx(1.0)
    assert best.metrics["val_acc" if "val_acc" in best.metrics else next(iter(best.metrics))] == pytest.approx([1/3, 2/3, 1.0])


def test_equal_models_of_one_group_train_once(tmp_path):
    """Four samples of one grid group, two models: each model trains once and its equal waits
    for it, a duplicate of it when it completed; when it failed the equal one trains (and fails
    too). Trials keep the group's order and ids."""
    spaces.TRAINED.clear()
    exp = _run(tmp_path, spaces.EqualActivationsMLP(), td.evaluators.FunctionalEvaluator(spaces.score_and_count),
               td.strategy.GridSearch(), max_trials=4)
    trials = exp.trials()
    assert [t.id for t in trials] == sorted(t.id for t in trials) and len({t.group for t in trials}) == 1
    assert sorted(spaces.TRAINED) == [4, 8, 8]
    by_model: dict[int, list] = {}
    for t in trials:
        by_model.setdefault(t.sample["hidden"], []).append(t)
    first, second = by_model[4]
    assert first.status is TrialStatus.COMPLETED and first.metric == pytest.approx(0.25)
    assert second.status is TrialStatus.DUPLICATE and second.info["duplicate_of"] == first.id
    assert second.metric == first.metric
    assert [t.status for t in by_model[8]] == [TrialStatus.FAILED, TrialStatus.FAILED]
    assert all("boom: hidden=8" in t.error for t in by_model[8])


def test_failing_trials_are_recorded_and_the_run_continues(tmp_path):
    ev = td.evaluators.FunctionalEvaluator(raise_on_hidden_8)
    exp = _run(tmp_path, TinyMLP(), ev, td.strategy.GridSearch(), max_trials=2)
    by_hidden = {t.sample["hidden"]: t for t in exp.trials()}
    assert by_hidden[8].status is TrialStatus.FAILED and "boom: hidden=8" in by_hidden[8].error
    assert "Traceback" in by_hidden[8].error
    assert by_hidden[4].status is TrialStatus.COMPLETED


def test_nan_metric_fails_the_trial(tmp_path):
    exp = _run(tmp_path, TinyMLP(), td.evaluators.FunctionalEvaluator(nan_on_hidden_8), td.strategy.GridSearch(), max_trials=2)
    by_hidden = {t.sample["hidden"]: t for t in exp.trials()}
    assert by_hidden[8].status is TrialStatus.FAILED and "NaN" in by_hidden[8].error
    assert by_hidden[4].status is TrialStatus.COMPLETED


def test_nan_loss_fails_the_trial(tmp_path, digits_data):
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=128, optimizer="sgd",
                                      lr=td.choice("lr", [1e38, 0.01]))
    exp = _run(tmp_path, TinyMLP(), ev, td.strategy.GridSearch(), max_trials=4)
    failed = [t for t in exp.trials() if t.status is TrialStatus.FAILED]
    assert failed and all(t.sample["lr"] == 1e38 for t in failed)
    assert all("loss" in t.error.lower() for t in failed)


@pytest.mark.slow
def test_process_executor_matches_inline_and_enforces_timeout(tmp_path):
    ev = td.evaluators.FunctionalEvaluator(score_by_width, scale=td.choice("scale", [1.0]))
    inline = _run(tmp_path, TinyMLP(), ev, td.strategy.GridSearch(), name="inline", max_trials=2)
    proc = _run(tmp_path, TinyMLP(), ev, td.strategy.GridSearch(), name="proc", max_trials=2,
                executor=td.executors.Process(workers=2))
    assert [(t.sample, t.metrics, t.metric) for t in inline.trials()] == [(t.sample, t.metrics, t.metric) for t in proc.trials()]
    slow = _run(tmp_path, TinyMLP(), td.evaluators.FunctionalEvaluator(sleep_on_hidden_8), td.strategy.GridSearch(),
                name="slow", max_trials=2, executor=td.executors.Process(workers=2), trial_timeout=5)
    by_hidden = {t.sample["hidden"]: t for t in slow.trials()}
    assert by_hidden[8].status is TrialStatus.FAILED and "trial_timeout" in by_hidden[8].error
    assert by_hidden[4].status is TrialStatus.COMPLETED


def test_constraint_skips_models_without_training(tmp_path, classification):
    big = TinyCNN().freeze({"width": 16, "op": 0})
    limit = sum(p.numel() for p in big.parameters()) - 1
    exp = _run(tmp_path, TinyCNN(), classification, td.strategy.GridSearch(), max_trials=8,
               constraints=[td.strategy.Constraint("params", max=limit)])
    for t in exp.trials():
        if t.sample["width"] == 16 and t.sample["op"] == 0:
            assert t.status is TrialStatus.FAILED and "params" in t.error and not t.metrics
        else:
            assert t.status is TrialStatus.COMPLETED


def test_pareto_front_in_top(tmp_path, classification):
    exp = _run(tmp_path, TinyCNN(), classification, td.strategy.GridSearch(), max_trials=8,
               second_objective=("params", "min"))
    top = exp.top(8)
    front = td.strategy.pareto_front(exp.trials(), [td.Objective("val_acc", "max"), td.Objective("params", "min")])
    assert [t.id for t in top[:len(front)]] == sorted((t.id for t in front), key=lambda i: -next(t.metric for t in front if t.id == i))
    # `tridens top` ranks from the store alone, the same way
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["top", "exp", "-k", "8", "--json", "--db", str(tmp_path / "t.db")]) == 0
    assert [r["id"] for r in json.loads(out.getvalue())] == [t.id for t in top]


def test_asha_stops_trials_in_lockstep(tmp_path, digits_data):
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=4, batch_size=128, optimizer="adam",
                                      lr=td.choice("lr", [0.03, 0.01, 0.003, 0.001, 0.0003, 0.0001]))
    exp = _run(tmp_path, TinyMLP(), ev, td.strategy.Hyperband(min_steps=1, max_steps=4, reduction_factor=2),
               max_trials=6)
    statuses = [t.status for t in exp.trials()]
    assert TrialStatus.STOPPED in statuses
    stopped = [t for t in exp.trials() if t.status is TrialStatus.STOPPED]
    assert all(t.steps < 4 for t in stopped)


def test_export_and_load_round_trip(tmp_path, classification, digits_data):
    exp = _run(tmp_path, TinyCNN(), classification, max_trials=2)
    [path] = exp.export(tmp_path / "best")
    manifest = json.loads((path / "tridens.json").read_text())
    assert manifest["sample"] == exp.best().sample
    model = load(path)
    program = load(path, prefer="program")
    x = digits_data[1].tensors[0][:16] if hasattr(digits_data[1], "tensors") else torch.stack([digits_data[1][i][0] for i in range(16)])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), program(x))
    store = Store(tmp_path / "t.db", readonly=True)
    weights = store.load_checkpoint(exp.best().checkpoint)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_bad_parameters_name_the_parameter(tmp_path, classification):
    with pytest.raises(ValueError, match="'max_trials' of td.Budget must be an int"):
        _run(tmp_path, TinyCNN(), classification, max_trials=0)
    with pytest.raises(ValueError, match="'strategy' parameter"):
        _run(tmp_path, TinyCNN(), classification, 42)
    with pytest.raises(ValueError, match="unknown strategy 'randon'"):
        _run(tmp_path, TinyCNN(), classification, "randon")
    with pytest.raises(td.InvalidSpace, match="'space' parameter"):
        _run(tmp_path, torch.nn.Linear(2, 2), classification)


def test_trained_weights_start_from_the_trial_seed(tmp_path, classification):
    """The engine fingerprints on the meta device, then initialises under the trial's seed: the
    stored model equals a model frozen under that seed and trained separately."""
    exp = _run(tmp_path, TinyCNN(), classification, td.strategy.GridSearch(), max_trials=1,
               constraints=[td.strategy.Constraint("flops", max=1e12)])
    [trial] = exp.trials()
    assert trial.info["flops"] > 0 and trial.info["params"] > 0
    space = TinyCNN()
    torch.manual_seed(trial.seed)
    model = space.freeze(space.restrict(trial.sample), check=False)
    trainer = classification.trainer(model, trial.sample, trial.seed)
    for _ in range(2):
        trainer.train_epoch()
        metrics = trainer.validate()
    assert metrics["val_acc"] == trial.metric


def test_failures_before_training_count_toward_the_budget(tmp_path, classification):
    """Constraint violations are failed trials: the budget counts them, and it is never exceeded."""
    with pytest.raises(td.TridensError, match="every trial of 'exp' failed"):
        _run(tmp_path, TinyCNN(), classification, td.strategy.Random(batch_size=3), max_trials=4,
             constraints=[td.strategy.Constraint("params", max=1)])
    exp = Experiment.load(tmp_path / "t.db", "exp")
    trials = exp.trials()
    counted = [t for t in trials if t.status is not TrialStatus.DUPLICATE]
    assert len(counted) == 4 and all(t.status is TrialStatus.FAILED for t in counted)
    groups = {}
    for t in trials:
        groups.setdefault(t.group, []).append(t.id)
    assert all(ids == sorted(ids) for ids in groups.values())
    with pytest.raises(ValueError, match="'exp' has no best trial: every trial failed \\(4 failed"):
        exp.best()  # as Optuna's study.best_trial


def test_max_duration_stops_between_groups(tmp_path):
    ev = td.evaluators.FunctionalEvaluator(sleep_briefly)
    exp = _run(tmp_path, TinyMLP(), ev, td.strategy.GridSearch(batch_size=1), max_duration=0.5)
    assert len(exp.trials()) == 1  # the grid has two models; the deadline passed during the first


class _SleepPastTheDeadline(td.loggers.Callback):
    """Holds the first reported step until ``seconds`` after the run started, so the deadline
    passes while the group trains (the run's deadline is set before on_experiment_start)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def on_experiment_start(self, name, config):
        self.start = time.monotonic()

    def on_trial_step(self, trial, step, metrics):
        time.sleep(max(0.0, self.start + self.seconds + 0.05 - time.monotonic()))


def test_max_duration_stops_the_trials_of_a_running_group_after_their_step(tmp_path, classification):
    exp = Experiment(TinyMLP(), classification, td.strategy.GridSearch(batch_size=4), store=tmp_path / "t.db",
                     name="late", budget=td.Budget(max_duration=2.0), callbacks=[_SleepPastTheDeadline(2.0)],
                     options=td.RunOptions(verbose=False)).run()
    trials = exp.trials()
    assert len(trials) == 4  # one group: the whole grid, started before the deadline
    for t in trials:
        assert t.status is TrialStatus.STOPPED and t.info["stopped_by"] == "max_duration"
        assert len(t.metrics["val_acc"]) == 1 and t.checkpoint  # its first epoch of two, kept
    assert exp.stop_reason == "max_duration=2.0 reached after 4 trials (4 stopped early at the deadline)"


def test_epochs_are_shown_while_trials_train(tmp_path, classification, capsys, monkeypatch):
    # trials of a fused unit finish together: without per-epoch lines a long group prints nothing
    from tridens.engine._progress import Progress

    monkeypatch.setattr(Progress, "STEP_LINE_S", 0.0)
    Experiment(TinyCNN(), classification, td.strategy.Random(), store=tmp_path / "t.db", name="shown", budget=2,
               options=td.RunOptions(seed=3)).run()
    lines = capsys.readouterr().err.splitlines()
    training = [line for line in lines if "training, at step" in line]
    assert training and all(line.startswith("[shown]") for line in training)
    assert any("best val_acc so far" in line for line in training)
    assert any("2/2 trial" in line for line in lines)


def test_a_resumed_run_records_its_own_budget(tmp_path):
    ev = td.evaluators.FunctionalEvaluator(score_by_width, scale=td.choice("scale", [1.0, 2.0, 3.0]))
    _run(tmp_path, TinyMLP(), ev, td.strategy.GridSearch(), name="grow", max_trials=2)
    exp = _run(tmp_path, TinyMLP(), ev, td.strategy.GridSearch(), name="grow", max_trials=4)
    assert len([t for t in exp.trials() if t.status is TrialStatus.COMPLETED]) == 4
    with Store(tmp_path / "t.db") as db:
        assert db.get_experiment("grow").config["max_trials"] == 4  # what `tridens ls` and `resume` count against


def test_experiment_composes_policies_and_the_old_keywords_still_work(tmp_path, classification):
    """At most ten parameters: a budget, the executor's own policies (whether trials are fused, the
    memory bound) and run options replace the keywords of before; a run given the old keywords
    warns once per keyword and trains the same trials."""
    import inspect
    import warnings

    params = [p for p in inspect.signature(Experiment.__init__).parameters.values()
              if p.name != "self" and p.kind is not p.VAR_KEYWORD]
    assert len(params) <= 10, [p.name for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)   # the new way warns about nothing
        exp = Experiment(TinyMLP(), classification, td.strategy.GridSearch(), store=tmp_path / "new.db", name="new",
                         budget=td.Budget(max_trials=2), options=td.RunOptions(seed=3, verbose=False),
                         executor=td.executors.Inline(optimize=False, max_unit_memory="1GiB")).run()
    trials = exp.trials()
    assert len(trials) == 2 and all(t.status is TrialStatus.COMPLETED for t in trials)
    assert all(t.info["unit"]["reason"] == "optimize=False" for t in trials)   # the executor's policy
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = Experiment(TinyMLP(), classification, td.strategy.GridSearch(), store=tmp_path / "old.db", name="old",
                         max_trials=2, seed=3, verbose=False, optimize=False, max_unit_memory="1GiB").run()
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    moved = sorted(str(w.message).split("(")[1].split("=")[0] for w in deprecations)
    assert moved == ["max_trials", "max_unit_memory", "optimize", "seed", "verbose"]   # once each, the run included
    assert [t.metrics for t in old.trials()] == [t.metrics for t in trials]   # the same run either way
    assert (old.max_trials, old.seed, old.optimize, old.max_unit_memory) == (2, 3, False, "1GiB")
    assert Experiment(None, None, budget=5).max_trials == 5


_OLD_KEYWORDS = [   # (keyword, a value, the new form's parameter and the object that holds it)
    ("max_trials", 3, "budget=td.Budget(max_trials=...)"),
    ("max_duration", "1h", "budget=td.Budget(max_duration=...)"),
    ("trial_timeout", 5.0, "budget=td.Budget(trial_timeout=...)"),
    ("seed", 3, "options=td.RunOptions(seed=...)"),
    ("seeds", "per-architecture", "options=td.RunOptions(seeds=...)"),
    ("second_objective", ("params", "min"), "options=td.RunOptions(second_objective=...)"),
    ("constraints", (td.strategy.Constraint("params", max=1e6),), "options=td.RunOptions(constraints=...)"),
    ("warm_start", True, "options=td.RunOptions(warm_start=...)"),
    ("verbose", False, "options=td.RunOptions(verbose=...)"),
    ("resume", "force", "options=td.RunOptions(resume=...)"),
    ("retry_failed", False, "options=td.RunOptions(retry_failed=...)"),
    ("stage_policy", td.store.StagePolicy(reuse="experiment"), "options=td.RunOptions(stage_policy=...)"),
    ("optimize", False, "executor=td.executors.Inline(optimize=...)"),
    ("max_unit_memory", "1GiB", "executor=td.executors.Inline(max_unit_memory=...)"),
    ("allocation", "static", "executor=td.executors.Process(allocation=...)"),
]


@pytest.mark.parametrize("key, value, home", _OLD_KEYWORDS, ids=[k for k, _, _ in _OLD_KEYWORDS])
def test_each_old_keyword_warns_once_naming_its_new_home_and_means_the_same(tmp_path, key, value, home):
    import warnings

    ev = td.evaluators.FunctionalEvaluator(score_by_width)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = Experiment(TinyMLP(), ev, "grid", store=tmp_path / "t.db", name="kw", **{key: value})
    assert len(caught) == 1 and caught[0].category is DeprecationWarning, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "\n" not in message and message.startswith(f"Experiment({key}=...) is deprecated") and home in message
    assert caught[0].filename == __file__   # it points at the caller's line, not into tridens
    if home.startswith("budget="):
        new = Experiment(TinyMLP(), ev, "grid", store=tmp_path / "t.db", name="kw", budget=td.Budget(**{key: value}))
    elif home.startswith("options="):
        new = Experiment(TinyMLP(), ev, "grid", store=tmp_path / "t.db", name="kw", options=td.RunOptions(**{key: value}))
    else:   # one of the executor's policies (Process takes all three)
        new = Experiment(TinyMLP(), ev, "grid", store=tmp_path / "t.db", name="kw",
                         executor=td.executors.Process(**{key: value}))
    assert getattr(old, key) == value == getattr(new, key)
    assert (old.budget, old.options) == (new.budget, new.options)


def test_an_old_keyword_beside_the_object_that_holds_it_is_refused():
    ev = td.evaluators.FunctionalEvaluator(score_by_width)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="'max_trials' parameter .* budget=td.Budget"):
        Experiment(TinyMLP(), ev, budget=td.Budget(max_trials=2), max_trials=3)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="'seed' parameter .* options=td.RunOptions"):
        Experiment(TinyMLP(), ev, options=td.RunOptions(seed=1), seed=2)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"pass only td.executors.Inline\(optimize=...\)"):
        Experiment(TinyMLP(), ev, executor=td.executors.Inline(optimize=False), optimize=True)
    with pytest.raises(ValueError, match="'budget' parameter of Experiment must be a td.Budget or an int"):
        Experiment(TinyMLP(), ev, budget="ten")
