"""The precision policy: ``precision="bf16-mixed"`` on Classification/Regression runs separate and
fused training alike under bfloat16 autocast (loss in float32), recorded in each trial's info."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tridens as td
from tridens.evaluators import InvalidParameter
from tridens.trial import TrialStatus
from tridens.units import SeparateUnit
from tridens.xopt import Settings
from tridens.xopt._batching import BatchedUnit

from ..xopt.test_batching import ADAPTIVE, HpSpace, cnn, evaluator, make_jobs, run

# bf16 rounds each convolution/matmul output to 8 bits of mantissa: where the grouped kernels'
# other reduction order flips one of those roundings, fused and separate mixed-precision training
# part by more than float32 rounding. Bound: per-epoch metrics within 1e-3 after two epochs on
# digits (on this model they agree to ~2e-7: the accumulation is float32 in both).
BF16_TOL = 1e-3


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


def test_bf16_mixed_trains_in_bfloat16_and_fused_agrees_with_separate(data):
    ev = evaluator(data, "adamw", precision="bf16-mixed")
    cfg = ev.config(ADAPTIVE[0])
    assert cfg.precision == "bf16-mixed"
    model = cnn(0.0)
    with cfg.autocast():
        assert model(data[0].tensors[0][:4]).dtype == torch.bfloat16
    separate = run(SeparateUnit(make_jobs(ADAPTIVE, cnn), ev))
    unit = BatchedUnit(make_jobs(ADAPTIVE, cnn), ev)
    fused = run(unit)
    assert unit.member.engine == "grouped kernels"
    full = run(SeparateUnit(make_jobs(ADAPTIVE, cnn), evaluator(data, "adamw")))
    apart = 0.0
    for tid, epochs in separate[0].items():
        assert len(epochs) == 2
        for a, b, c in zip(epochs, fused[0][tid], full[0][tid]):
            assert abs(a["val_loss"] - b["val_loss"]) <= BF16_TOL, (tid, a, b)
            assert abs(a["val_acc"] - b["val_acc"]) <= BF16_TOL, (tid, a, b)
            assert abs(a["train_loss"] - b["train_loss"]) <= BF16_TOL, (tid, a, b)
            apart = max(apart, abs(a["val_loss"] - c["val_loss"]))
    assert apart > 1e-4  # separate bf16-mixed training is not float32 training
    # the weights stay float32 (autocast casts per op)
    assert all(v.dtype == torch.float32 for v in fused[1][0].values() if v.is_floating_point())


def test_precision_is_recorded_and_shown(data, tmp_path, caplog):
    from tridens.engine._progress import trials_table
    from rich.console import Console

    train, val = data
    ev = td.evaluators.Classification(train, val, epochs=1, batch_size=64, optimizer="sgd",
                                      lr=td.choice("lr", [0.1, 0.05]), weight_decay=td.choice("wd", [0.0, 1e-3]),
                                      precision="bf16-mixed")
    exp = td.Experiment(HpSpace(), ev, td.strategy.GridSearch(), budget=4, store=tmp_path / "p.db", name="p",
                        executor=td.executors.Inline(optimize=Settings().with_batching(mode="force")),
                        options=td.RunOptions(verbose=False, seed=3))
    with caplog.at_level(logging.INFO, logger="tridens"):
        exp.run()
    assert "batched unit of" in caplog.text
    trials = td.Experiment.load(tmp_path / "p.db", "p").trials()
    assert len(trials) == 4 and all(t.status is TrialStatus.COMPLETED for t in trials)
    assert {t.info["precision"] for t in trials} == {"bf16-mixed"}
    console = Console(width=200, record=True)
    console.print(trials_table(trials, ev.objective))
    text = console.export_text()
    assert "precision" in text and "bf16-mixed" in text


def test_16_mixed_on_cpu_and_unknown_precisions_are_one_line_errors(data):
    train, val = data
    with pytest.raises(InvalidParameter, match="'16-mixed' .* needs CUDA; on cpu use 'bf16-mixed'") as info:
        td.evaluators.Classification(train, val, precision="16-mixed", device="cpu").config()
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidParameter, match="precision"):
        td.evaluators.Regression(train, val, precision="bf16").config()


@pytest.mark.cuda
def test_16_mixed_trains_with_a_grad_scaler_on_cuda(data):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    train, val = data
    ev = td.evaluators.Classification(train, val, epochs=1, optimizer="adam", lr=1e-3, precision="16-mixed", device="cuda")
    trainer = ev.trainer(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), {}, seed=0)
    assert trainer.scaler is not None
    trainer.train_epoch()
    assert 0.5 < trainer.validate()["val_acc"] <= 1.0
    assert "scaler" in trainer.state_dict()
