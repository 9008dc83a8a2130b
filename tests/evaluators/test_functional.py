"""FunctionalEvaluator and td.report: the user's own loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tridens as td
from tridens.evaluators import (
    FunctionalEvaluator, InvalidParameter, NothingReported, RecordingReporter, TrialFailed, TrialStopped,
)

from .conftest import mlp


def sgd_loop(model, lr, epochs, data, batch_size=64):
    """A plain user-written training loop on digits that reports validation accuracy per epoch."""
    (x, y), (vx, vy) = data
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    acc = 0.0
    for epoch in range(epochs):
        model.train()
        for idx in torch.randperm(len(x)).split(batch_size):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc = (model(vx).argmax(1) == vy).float().mean().item()
        td.report({"val_acc": acc, "epoch": epoch}, step=epoch)
    return None


def test_user_loop_trains_digits_and_reports_each_epoch(digits):
    train, val = digits
    ev = FunctionalEvaluator(sgd_loop, lr=td.choice("lr", [0.01, 0.1]), epochs=2, data=(train.tensors, val.tensors))
    assert list(ev.search_space()) == ["lr"]
    assert ev.objective == td.Objective("value", "max") and ev.objective_from_reports  # named by the reports
    reporter = RecordingReporter()
    final = ev.evaluate(mlp(), {"lr": 0.1}, seed=0, reporter=reporter)
    assert reporter.steps == [0, 1]
    step0 = reporter.history[0][1]
    assert list(step0) == ["val_acc", "epoch"]       # the objective is the first key, under its own name
    assert final == reporter.metrics["val_acc"][-1] > 0.85


def test_same_seed_same_results_and_caller_rng_untouched(digits):
    train, val = digits
    ev = FunctionalEvaluator(sgd_loop, lr=0.1, epochs=1, data=(train.tensors, val.tensors))
    a = ev.evaluate(mlp(dropout=0.3), {}, seed=4)
    b = ev.evaluate(mlp(dropout=0.3), {}, seed=4)
    assert a == b
    assert ev.evaluate(mlp(dropout=0.3), {}, seed=5) != a     # the seed reaches torch.randperm / dropout
    model = mlp(dropout=0.3)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    ev.evaluate(model, {}, seed=4)
    assert torch.equal(torch.get_rng_state(), before)         # the caller's random state is restored


def test_metric_names_the_objective_of_dict_reports():
    def loop(model):
        td.report({"loss": 0.5, "val_acc": 0.7})
        td.report({"loss": 0.4, "val_acc": 0.8})

    reporter = RecordingReporter()
    ev = FunctionalEvaluator(loop, metric="val_acc")
    assert ev.objective == td.Objective("val_acc", "max")
    assert ev.evaluate(None, {}, seed=0, reporter=reporter) == 0.8
    assert reporter.steps == [0, 1]                            # steps default to 0, 1, ...
    assert list(reporter.history[0][1]) == ["val_acc", "loss"]

    def wrong(model):
        td.report({"loss": 0.5})

    with pytest.raises(InvalidParameter, match="without the objective metric 'val_acc'"):
        FunctionalEvaluator(wrong, metric="val_acc").evaluate(None, {}, seed=0)


def test_stop_decision_ends_the_loop():
    done = []

    def loop(model, steps):
        for step in range(steps):
            td.report(1.0 / (step + 1), step=step)
            done.append(step)
        return 123.0

    reporter = RecordingReporter(stop_after=2)
    ev = FunctionalEvaluator(loop, mode="min", steps=5)
    assert ev.evaluate(None, {}, seed=0, reporter=reporter) == 0.5   # the last report, not the return value
    assert reporter.steps == [0, 1]
    assert done == [0]                                         # td.report raised at step 1: nothing ran after it
    done.clear()
    assert ev.evaluate(None, {}, seed=0, max_steps=3) == pytest.approx(1 / 3)
    assert done == [0, 1]


def test_returned_value_is_the_final_metric():
    def loop(model, x):
        td.report(0.1)
        return x * 2

    ev = FunctionalEvaluator(loop, x=td.uniform("x", 0.0, 1.0))
    assert ev.evaluate(None, {"x": 0.25}, seed=0) == 0.5
    assert FunctionalEvaluator(lambda model: {"acc": 0.9, "loss": 0.1}).evaluate(None, {}, seed=0) == 0.9
    assert FunctionalEvaluator(lambda model: torch.tensor(0.75)).evaluate(None, {}, seed=0) == 0.75


def test_reporting_nothing_is_a_clear_error():
    def silent(model):
        pass

    with pytest.raises(NothingReported, match="the evaluator reported nothing: .*silent\\(\\) returned None") as info:
        FunctionalEvaluator(silent).evaluate(None, {}, seed=0)
    assert isinstance(info.value, TrialFailed)
    with pytest.raises(InvalidParameter, match="needs a number"):
        FunctionalEvaluator(lambda model: "high").evaluate(None, {}, seed=0)


def test_report_outside_a_trial_warns_and_does_nothing():
    with pytest.warns(RuntimeWarning, match="outside a trial"):
        td.report(0.5)
    FunctionalEvaluator(lambda model: td.report(0.3)).evaluate(None, {}, seed=0)
    with pytest.warns(RuntimeWarning):                         # the trial's context is gone afterwards
        td.report(0.5, step=3)


def test_seed_is_passed_when_the_function_asks_for_it():
    seen = {}

    def loop(model, seed, lr):
        seen.update(seed=seed, lr=lr, noise=torch.rand(1).item())
        return lr

    ev = FunctionalEvaluator(loop, lr=td.choice("lr", [0.1, 0.2]))
    ev.evaluate(None, {"lr": 0.2}, seed=42)
    first = dict(seen)
    ev.evaluate(None, {"lr": 0.2}, seed=42)
    assert first == seen and first["seed"] == 42 and first["lr"] == 0.2


def test_stop_exception_escapes_only_its_own_trial():
    def loop(model):
        try:
            td.report(1.0)
        except TrialStopped:
            pass                                               # a loop that swallows it...
        td.report(2.0)                                         # ...is stopped again at its next report

    reporter = RecordingReporter(stop_after=1)
    assert FunctionalEvaluator(loop).evaluate(None, {}, seed=0, reporter=reporter) == 1.0
    assert reporter.steps == [0]


def test_invalid_parameters():
    with pytest.raises(InvalidParameter, match="The 'mode' parameter of FunctionalEvaluator must be one of "
                                               r"\['max', 'min'\]\. Got 'maximize' instead\."):
        FunctionalEvaluator(lambda model: 1.0, mode="maximize").evaluate(None, {}, seed=0)
    with pytest.raises(InvalidParameter, match="The 'step' parameter of tridens.report"):
        FunctionalEvaluator(lambda model: td.report(1.0, step=-1)).evaluate(None, {}, seed=0)
