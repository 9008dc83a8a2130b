"""Classification and Regression: real training on scikit-learn's digits and diabetes."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

import tridens as td
from tridens.evaluators import (
    OPTIMIZERS, SCHEDULES, Classification, InvalidParameter, NonFiniteLoss, RecordingReporter, Regression,
    StepwiseEvaluator, SupervisedTrainer, Trainer, lr_factor, scheduled_lr,
)

from .conftest import cnn, mlp


def run_epochs(trainer: SupervisedTrainer, n: int) -> list[dict[str, float]]:
    out = []
    for _ in range(n):
        metrics = trainer.train_epoch()
        out.append({**trainer.validate(), **metrics})
    return out


def test_classification_learns_digits_and_reports_every_epoch(digits):
    train, val = digits
    ev = Classification(train, val, epochs=2, batch_size=32, optimizer="sgd", lr=0.1)
    reporter = RecordingReporter()
    final = ev.evaluate(mlp(), {}, seed=0, reporter=reporter)
    assert reporter.steps == [0, 1]
    first = reporter.history[0][1]
    assert list(first)[0] == "val_acc"                       # the objective comes first
    assert set(first) == {"val_acc", "val_loss", "train_loss"}
    assert final == reporter.metrics["val_acc"][-1] > 0.85
    assert reporter.metrics["train_loss"][1] < reporter.metrics["train_loss"][0]
    assert ev.objective == td.Objective("val_acc", "max")
    assert isinstance(ev, StepwiseEvaluator)


def test_cnn_on_digit_images(digit_images):
    train, val = digit_images
    ev = Classification(train, val, epochs=2, batch_size=16, optimizer="sgd", lr=0.1)
    trainer = ev.trainer(cnn(), {}, seed=0)
    assert isinstance(trainer, Trainer)
    before = trainer.validate()["val_acc"]
    history = run_epochs(trainer, 2)
    assert trainer.epoch == 2 and trainer.done
    assert history[-1]["val_acc"] > max(0.6, before)


def test_same_init_sample_and_seed_give_identical_metrics(digits):
    train, val = digits
    ev = Classification(train, val, epochs=2, batch_size=64, lr=td.choice("lr", [0.05, 0.1]))
    runs = [run_epochs(ev.trainer(mlp(dropout=0.3), {"lr": 0.1}, seed=7), 2) for _ in range(2)]
    assert runs[0] == runs[1]                                # bit-identical floats
    other = run_epochs(ev.trainer(mlp(dropout=0.3), {"lr": 0.1}, seed=8), 2)
    assert other != runs[0]                                  # the seed changes order and dropout


def test_interleaved_trainers_match_trainers_run_alone_and_leave_global_rng_alone(digits):
    train, val = digits
    ev = Classification(train, val, epochs=2, batch_size=64, lr=0.1)
    alone = [run_epochs(ev.trainer(mlp(s, dropout=0.5), {}, seed=s), 2) for s in (1, 2)]
    a, b = ev.trainer(mlp(1, dropout=0.5), {}, seed=1), ev.trainer(mlp(2, dropout=0.5), {}, seed=2)
    state = torch.get_rng_state()
    together: list[list[dict[str, float]]] = [[], []]
    for _ in range(2):
        for i, t in enumerate((a, b)):
            m = t.train_epoch()
            together[i].append({**t.validate(), **m})
            torch.rand(3)                                    # the caller's own randomness in between
    assert together == alone
    state_after = torch.get_rng_state()
    torch.set_rng_state(state)
    torch.rand(3 * 4)
    assert torch.equal(torch.get_rng_state(), state_after)  # trainers drew nothing from the global stream


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_sets_its_lr_every_step(digits, schedule):
    train, val = digits
    ev = Classification(train, val, epochs=3, batch_size=350, lr=0.2, schedule=schedule)   # 4 steps an epoch
    trainer = ev.trainer(mlp(), {}, seed=0)
    cfg = trainer.config
    T = cfg.total_steps
    assert T == 12
    expected = {
        "constant": lambda t: 0.2,
        "step": lambda t: 0.2 * 0.1 ** (int(t >= 6) + int(t >= 9)),
        "cosine": lambda t: 0.2 * 0.5 * (1 + math.cos(math.pi * (t / T))),
        "linear": lambda t: 0.2 * (1 - t / T),
        "rex": lambda t: 0.2 * (1 - t / T) / (0.5 + 0.5 * (1 - t / T)),   # lr0 * (1 - z) / (0.5 + 0.5 * (1 - z))
    }[schedule]
    assert [cfg.lr_at(t) for t in range(T)] == [expected(t) for t in range(T)]
    for _ in range(3):
        trainer.train_epoch()
        assert trainer.optimizer.param_groups[0]["lr"] == expected(trainer.step - 1)   # set at the last step
    assert trainer.step == T


def test_rex_formula_exactly():
    for t, total in [(0, 10), (3, 10), (9, 10), (50, 100), (999, 1000)]:
        z = t / total
        assert scheduled_lr("rex", 0.3, t, total) == 0.3 * (1 - z) / (0.5 + 0.5 * (1 - z))
        assert lr_factor("rex", t, total) == (1 - z) / (0.5 + 0.5 * (1 - z))
    assert lr_factor("rex", 0, 10) == 1.0
    assert lr_factor("rex", 5, 10) == 0.5 / 0.75


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_trains(digits, optimizer):
    train, val = digits
    lr = {"sgd": 0.1, "adam": 3e-3, "adamw": 3e-3, "rmsprop": 1e-3}[optimizer]
    ev = Classification(train, val, epochs=1, batch_size=32, optimizer=optimizer, lr=lr, weight_decay=1e-4)
    trainer = ev.trainer(mlp(), {}, seed=0)
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "rmsprop": torch.optim.RMSprop}
    assert type(trainer.optimizer) is cls[optimizer]
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 1e-4
    before = trainer.validate()
    trainer.train_epoch()
    after = trainer.validate()
    assert after["val_loss"] < before["val_loss"] and after["val_acc"] > 0.7


def test_momentum_means_sgd_momentum_and_adam_beta1(digits):
    train, val = digits
    sgd = Classification(train, val, optimizer="sgd").trainer(mlp(), {}, seed=0).optimizer
    assert sgd.param_groups[0]["momentum"] == 0.9
    adam = Classification(train, val, optimizer="adam", momentum=0.8).trainer(mlp(), {}, seed=0).optimizer
    assert adam.param_groups[0]["betas"] == (0.8, 0.999)


def test_placeholders_are_resolved_from_the_sample(digits):
    train, val = digits
    ev = Classification(train, val, epochs=td.choice("epochs", [1, 2]), batch_size=td.choice("bs", [32, 128]),
                        optimizer=td.choice("opt", ["sgd", "adam"]), lr=td.loguniform("lr", 1e-3, 1e-1),
                        schedule=td.choice("sched", ["constant", "rex"]))
    space = ev.search_space()
    assert list(space) == ["epochs", "bs", "opt", "lr", "sched"]
    sample = {"epochs": 1, "bs": 128, "opt": "adam", "lr": 0.01, "sched": "rex"}
    cfg = ev.config(sample)
    assert (cfg.epochs, cfg.batch_size, cfg.optimizer, cfg.lr, cfg.schedule) == (1, 128, "adam", 0.01, "rex")
    reporter = RecordingReporter()
    ev.evaluate(mlp(), sample, seed=0, reporter=reporter)
    assert reporter.steps == [0]
    with pytest.raises(td.InvalidSample, match="'opt'"):
        ev.config({k: v for k, v in sample.items() if k != "opt"})


def test_checkpoint_round_trip_through_a_file_resumes_identically(digits, tmp_path):
    train, val = digits
    ev = Classification(train, val, epochs=2, batch_size=64, optimizer=td.choice("opt", ["sgd", "adam"]),
                        lr=0.05, schedule="cosine")
    for opt in ("sgd", "adam"):
        sample = {"opt": opt}
        straight = run_epochs(ev.trainer(mlp(3, dropout=0.3), sample, seed=11), 2)

        first = ev.trainer(mlp(3, dropout=0.3), sample, seed=11)
        head = run_epochs(first, 1)
        path = tmp_path / f"{opt}.pt"
        torch.save(first.state_dict(), path)
        del first

        resumed = ev.trainer(mlp(99, dropout=0.3), sample, seed=11)  # another init: the checkpoint overrides it
        resumed.load_state_dict(torch.load(path))
        assert resumed.epoch == 1 and resumed.step == resumed.config.steps_per_epoch
        assert head + run_epochs(resumed, 1) == straight


def test_state_dict_is_a_snapshot_and_checks_the_seed(digits):
    train, val = digits
    ev = Classification(train, val, epochs=2, batch_size=64, lr=0.1)
    trainer = ev.trainer(mlp(), {}, seed=1)
    state = trainer.state_dict()
    trainer.train_epoch()
    assert state["epoch"] == 0
    assert not torch.equal(state["model"]["0.weight"], trainer.model.state_dict()["0.weight"])
    with pytest.raises(InvalidParameter, match="seed 1.*seed 2"):
        ev.trainer(mlp(), {}, seed=2).load_state_dict(state)


def test_stop_decision_is_honoured(digits):
    train, val = digits
    ev = Classification(train, val, epochs=3, batch_size=64, lr=0.1)
    reporter = RecordingReporter(stop_after=1)
    value = ev.evaluate(mlp(), {}, seed=0, reporter=reporter)
    assert reporter.steps == [0]
    assert value == reporter.metrics["val_acc"][0]
    capped = RecordingReporter()
    ev.evaluate(mlp(), {}, seed=0, reporter=capped, max_steps=2)
    assert capped.steps == [0, 1]


def test_non_finite_loss_fails_the_trial_naming_epoch_and_batch(diabetes):
    train, val = diabetes
    ev = Regression(train, val, epochs=2, batch_size=16, optimizer="sgd", lr=1e3)
    with pytest.raises(NonFiniteLoss, match=r"epoch 0, batch \d+") as info:
        ev.evaluate(mlp(inputs=10, out=1, dropout=0.0), {}, seed=0)
    err = info.value
    assert err.epoch == 0 and err.step == err.batch and not math.isfinite(err.value)
    assert isinstance(err, td.evaluators.TrialFailed) and isinstance(err, td.TridensError)


def test_regression_on_diabetes(diabetes):
    train, val = diabetes
    ev = Regression(train, val, epochs=2, batch_size=32, optimizer="adam", lr=1e-2, metrics=["mse", "mae", "loss"])
    assert ev.objective == td.Objective("val_mse", "min")
    trainer = ev.trainer(mlp(inputs=10, out=1, hidden=32, dropout=0.0), {}, seed=0)
    before = trainer.validate()
    assert set(before) == {"val_mse", "val_mae", "val_loss"}
    assert before["val_loss"] == pytest.approx(before["val_mse"], rel=1e-5)   # default loss is MSE
    history = run_epochs(trainer, 2)
    assert history[-1]["val_mse"] < before["val_mse"] / 2
    val_x, val_y = val.tensors
    with torch.no_grad():
        pred = trainer.model.eval()(val_x).squeeze(1)
    assert history[-1]["val_mae"] == pytest.approx((pred - val_y).abs().mean().item(), rel=1e-5)


class PlainDataset(Dataset):
    """A dataset without ``.tensors``: goes through the DataLoader path."""

    def __init__(self, ds: TensorDataset):
        self.x, self.y = ds.tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def test_dataloader_path_and_subset_fast_path_match_the_tensor_path(digits):
    train, val = digits
    tensor_run = run_epochs(Classification(train, val, epochs=1, batch_size=50, lr=0.1).trainer(mlp(), {}, seed=3), 1)
    plain_run = run_epochs(Classification(PlainDataset(train), PlainDataset(val), epochs=1, batch_size=50,
                                          lr=0.1).trainer(mlp(), {}, seed=3), 1)
    assert plain_run == tensor_run
    x, y = train.tensors
    padded = TensorDataset(torch.cat([x, x[:100]]), torch.cat([y, y[:100]]))
    subset = Subset(padded, list(range(len(train))))
    trainer = Classification(subset, val, epochs=1, batch_size=50, lr=0.1).trainer(mlp(), {}, seed=3)
    assert trainer._train.tensors is not None                 # indexed directly, no DataLoader
    assert run_epochs(trainer, 1) == tensor_run


def test_transforms_augment_training_batches_deterministically(digit_images):
    train, val = digit_images
    calls = []

    def noise(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x + 0.1 * torch.randn_like(x)                 # draws from the trainer's random stream

    ev = Classification(train, val, epochs=1, batch_size=100, lr=0.05, transforms=noise)
    runs = [run_epochs(ev.trainer(cnn(), {}, seed=5), 1) for _ in range(2)]
    assert runs[0] == runs[1]
    assert sum(calls) == 2 * len(train)                      # training batches only, never validation
    plain = run_epochs(Classification(train, val, epochs=1, batch_size=100, lr=0.05).trainer(cnn(), {}, seed=5), 1)
    assert plain != runs[0]


def test_parameters_are_validated_when_training_starts(digits):
    train, val = digits
    ev = Classification(train, val, optimizer="sgdd")      # the constructor only stores
    assert ev.optimizer == "sgdd"
    with pytest.raises(InvalidParameter) as info:
        ev.trainer(mlp(), {}, seed=0)
    assert str(info.value) == ("The 'optimizer' parameter of Classification must be one of "
                               "['adam', 'adamw', 'rmsprop', 'sgd']. Got 'sgdd' instead.")
    with pytest.raises(InvalidParameter, match=r"The 'epochs' parameter of Regression must be an int in the "
                                               r"range \[1, inf\)\. Got 0 instead\."):
        Regression(train, val, epochs=0).config()
    with pytest.raises(InvalidParameter, match=r"'lr' parameter of Classification must be a float in the range "
                                               r"\(0, inf\)\. Got -0.1 instead \(the value of label 'lr' in the sample\)"):
        Classification(train, val, lr=td.choice("lr", [-0.1, 0.1])).config({"lr": -0.1})
    with pytest.raises(InvalidParameter, match="'schedule' parameter of Classification must be one of"):
        Classification(train, val, schedule="exp").config()
    with pytest.raises(InvalidParameter, match="'metric' parameter of Classification"):
        Classification(train, val, metric="val_mse").config()
    with pytest.raises(InvalidParameter, match="'train' parameter of Classification must be a torch Dataset"):
        Classification(None, val).config()
    with pytest.raises(InvalidParameter, match="already trained its 1 epochs"):
        trainer = Classification(train, val, epochs=1, batch_size=700).trainer(mlp(), {}, seed=0)
        trainer.train_epoch()
        trainer.train_epoch()


def test_device_auto_and_explicit_cpu(digits):
    train, val = digits
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert Classification(train, val).config().device.type == expected
    assert Classification(train, val, device="cpu").config().device == torch.device("cpu")
    with pytest.raises(InvalidParameter, match="'device' parameter"):
        Classification(train, val, device="gpu0").config()


def test_objective_metric_can_be_the_loss(digits):
    train, val = digits
    assert Classification(train, val, metrics=["loss"]).objective == td.Objective("val_loss", "min")
    assert Regression(train, val, metrics=["mae"]).objective == td.Objective("val_mae", "min")
    ev = Classification(train, val, epochs=1, batch_size=128, lr=0.1, metric="val_loss")
    assert ev.objective == td.Objective("val_loss", "min")
    reporter = RecordingReporter()
    value = ev.evaluate(mlp(), {}, seed=0, reporter=reporter)
    assert list(reporter.history[0][1])[0] == "val_loss" and value == reporter.metrics["val_loss"][0]


def test_repr_and_params_show_the_placeholders(digits):
    train, val = digits
    ev = Classification(train, val, lr=td.choice("lr", [0.01, 0.1]))
    assert ev.params()["lr"].label == "lr"
    assert "lr=Choice('lr'" in repr(ev)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU path is tested above)")
def test_cuda_training_resumes_identically(digits, tmp_path):
    train, val = digits
    ev = Classification(train, val, epochs=2, batch_size=64, lr=0.05, device="auto")
    assert ev.config().device.type == "cuda"
    straight = run_epochs(ev.trainer(mlp(dropout=0.3), {}, seed=1), 2)
    first = ev.trainer(mlp(dropout=0.3), {}, seed=1)
    head = run_epochs(first, 1)
    torch.save(first.state_dict(), tmp_path / "c.pt")
    resumed = ev.trainer(mlp(5, dropout=0.3), {}, seed=1)
    resumed.load_state_dict(torch.load(tmp_path / "c.pt"))
    assert [m["val_acc"] for m in head + run_epochs(resumed, 1)] == [m["val_acc"] for m in straight]
