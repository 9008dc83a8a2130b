"""Zoo admission/eviction, bad input, and warm start inside td.Experiment."""

import logging
import sqlite3
import warnings

import pytest
import torch
from torch import nn

import tridens as td
from tridens.warmup import Zoo, ZooError, ZooWarning

from .spaces import DigitsMLP

X = torch.zeros(2, 1, 8, 8)


def mlp(h):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))


def test_zoo_persists_json_and_weights(tmp_path):
    zoo = Zoo(tmp_path / "z.db")
    e = zoo.add(mlp(8), X, accuracy=0.7, name="ext")
    assert (zoo.dir / f"{e.id}.json").exists() and (zoo.dir / f"{e.id}.pt").exists()
    again = Zoo(tmp_path / "z.db")
    assert [x.id for x in again] == [e.id] and again.entries[e.id].accuracy == 0.7
    assert set(again.weights(e.id)) == set(mlp(8).state_dict())


def test_admission_rejects_accuracy_outliers(tmp_path):
    zoo = Zoo(tmp_path / "z.db", min_for_outliers=8)
    for i in range(8):
        assert zoo.add(mlp(8 + i), X, accuracy=0.90 + i / 100) is not None
    assert zoo.add(mlp(20), X, accuracy=0.12) is None        # a diverged model
    assert zoo.add(mlp(20), X, accuracy=float("nan")) is None
    assert zoo.add(mlp(20), X, accuracy=0.93) is not None
    assert len(zoo) == 9


def test_eviction_keeps_most_useful_under_byte_cap(tmp_path):
    zoo = Zoo(tmp_path / "z.db")
    a = zoo.add(mlp(8), X, accuracy=0.5)
    b = zoo.add(mlp(8), X, accuracy=0.9)
    c = zoo.add(mlp(8), X, accuracy=0.6)
    ws = zoo.warm_start(mlp(8), X)          # chooses b (same bucket, most accurate); b.uses = 1
    assert ws.parent.id == b.id and ws.score == pytest.approx(1.0)
    zoo.max_bytes = 2 * b.nbytes + 10
    d = zoo.add(mlp(8), X, accuracy=0.7)    # over the cap: the least useful (unused, lowest accuracy) goes
    kept = {e.id for e in zoo}
    assert kept == {b.id, d.id} and a.id not in kept and c.id not in kept
    assert zoo.nbytes() <= zoo.max_bytes
    assert not (zoo.dir / f"{a.id}.pt").exists()


def test_corrupt_weights_warn_and_start_cold(tmp_path):
    zoo = Zoo(tmp_path / "z.db")
    e = zoo.add(mlp(8), X, accuracy=0.9)
    (zoo.dir / f"{e.id}.pt").write_bytes(b"not a checkpoint")
    child = mlp(8)
    before = {k: v.clone() for k, v in child.state_dict().items()}
    with pytest.warns(ZooWarning, match="no longer load"):
        ws = zoo.warm_start(child, X)
    assert not ws and "no zoo model" in ws.reason
    assert all(torch.equal(before[k], v) for k, v in child.state_dict().items())


def test_opaque_model_no_warm_start_with_reason(tmp_path):
    class Opaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
                x = x * 2
            return self.lin(x.flatten(1))

    zoo = Zoo(tmp_path / "z.db")
    zoo.add(mlp(8), X, accuracy=0.9)
    ws = zoo.warm_start(Opaque(), X)
    assert not ws and "opaque" in ws.reason
    with pytest.raises(ZooError, match="opaque"):
        zoo.add(Opaque(), X, accuracy=0.9)


def test_add_untraceable_model_is_a_clear_error(tmp_path):
    """Direct use: a TridensError naming the model and the reason; nothing is written."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def forward(self, x):
            if x.mean() > 0.5:  # data-dependent control flow
                return self.lin(x.flatten(1)) * 2
            return self.lin(x.flatten(1))

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def forward(self, x):
            return self.lin(x.flatten(1))

        def state_dict(self, *args, **kwargs):  # describing the model fails outright
            raise RuntimeError("weights are on a remote parameter server")

    zoo = Zoo(tmp_path / "z.db")
    with pytest.raises(td.TridensError, match=r"'branchy-v1' \(Branchy\) cannot be added to the zoo.*opaque"):
        zoo.add(Branchy(), X, accuracy=0.9, name="branchy-v1")
    with pytest.raises(ZooError, match=r"Broken cannot be added to the zoo: tracing or reading it failed \(RuntimeError: weights"):
        zoo.add(Broken(), X, accuracy=0.9)
    with pytest.raises(ZooError, match="'model' parameter of Zoo.add must be an nn.Module"):
        zoo.add("resnet18", X, accuracy=0.9)
    assert len(zoo) == 0 and not list(zoo.dir.glob("*.json"))


def test_non_store_path_is_a_clear_error(tmp_path):
    bogus = tmp_path / "notes.txt"
    bogus.write_text("hello, not a database\n" * 50)
    with pytest.raises(ZooError, match="not"):
        Zoo(bogus)
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("create table t (x int)")
    with pytest.raises(ZooError, match="tridens store"):
        Zoo(other)
    with pytest.raises(ZooError, match="directory"):
        Zoo(tmp_path)
    ev = td.evaluators.FunctionalEvaluator(lambda m: 0.5)
    exp = td.Experiment(DigitsMLP(), ev, budget=1, store=tmp_path / "s.db",
                        options=td.RunOptions(warm_start=str(bogus), verbose=False))
    with pytest.raises(ZooError):
        exp.run()


def test_experiment_warm_start_on_digits(tmp_path, digits_data, caplog, capsys):
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=128, optimizer="adam", lr=0.01)
    store = tmp_path / "t.db"
    strategy = td.strategy.RegularizedEvolution(population=2, sample_size=2, batch_size=1, mutation_prob=0.5)
    exp = td.Experiment(DigitsMLP(), ev, strategy, budget=5, store=store, name="warm",
                        options=td.RunOptions(warm_start=True, verbose=False))
    with caplog.at_level(logging.INFO, logger="tridens"):
        exp.run()
    trials = [t for t in exp.trials() if t.status is td.TrialStatus.COMPLETED]
    assert all("warm_start" in t.info for t in trials)
    first = trials[0]
    assert first.parent is None and first.info["warm_start"]["parent"] is None
    assert "no warm start" in caplog.text
    warm = [t for t in trials if t.info["warm_start"]["parent"] is not None]
    assert warm, [t.info for t in trials]
    ids = {t.id for t in trials}
    for t in warm:
        assert t.parent in ids and t.parent < t.id and 0 < t.info["warm_start"]["score"] <= 1
    zoo = Zoo(store)
    assert {e.meta["trial"] for e in zoo} == ids
    # the trials table (`tridens show` / `top`) says which trials were warm-started
    from rich.console import Console

    from tridens.engine._progress import trials_table

    console = Console(width=200, record=True)
    console.print(trials_table(exp.trials(), exp._objective()))
    text = console.export_text()
    number = {t.id: t.number for t in trials}
    # the parent named by its number in the experiment, as the table's "trial" column names it
    assert "warm start" in text and f"from #{number[warm[0].parent]} (" in text

    # a second experiment sharing the zoo starts warm from the first one's trials; the line printed
    # per trial (the live view's text when the output is not a terminal) names experiment and number
    capsys.readouterr()
    exp2 = td.Experiment(DigitsMLP(), ev, "random", budget=1, store=store, name="second",
                         options=td.RunOptions(warm_start=zoo, seed=3))
    exp2.run()
    t2 = exp2.trials()[0]
    assert t2.info["warm_start"]["parent"] in ids and t2.parent in ids
    assert f"warm-start from warm #{number[t2.parent]} (" in capsys.readouterr().err


def test_add_experiment_imports_finished_trials(tmp_path, digits_data):
    train, val = digits_data
    ev = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=256, optimizer="adam", lr=0.01)
    store = tmp_path / "cold.db"
    exp = td.Experiment(DigitsMLP(), ev, "random", budget=2, store=store, name="cold",
                        options=td.RunOptions(verbose=False))
    exp.run()
    zoo = Zoo(store)
    assert len(zoo) == 0  # ran without warm start
    added = zoo.add_experiment("cold")
    done = [t for t in exp.trials() if t.status is td.TrialStatus.COMPLETED]
    assert sorted(e.meta["trial"] for e in added) == sorted(t.id for t in done)
    assert zoo.add_experiment("cold") == []  # not twice
    entry = next(e for e in added if e.meta["trial"] == done[0].id)
    assert entry.accuracy == pytest.approx(done[0].metric)


def test_experiment_bad_inputs_never_crash(tmp_path, caplog):
    from .spaces import OpaqueMLP, half

    ev = td.evaluators.FunctionalEvaluator(half)
    store = tmp_path / "t.db"
    zoo = Zoo(store)
    e = zoo.add(mlp(16), X, accuracy=0.9)
    # an opaque model: no warm start, a logged reason, the trial still runs
    with caplog.at_level(logging.INFO, logger="tridens"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        td.Experiment(OpaqueMLP(), ev, "random", budget=1, store=store, name="opaque",
                      options=td.RunOptions(warm_start=zoo, verbose=False)).run()
    t = td.Experiment.load(store, "opaque").trials()[0]
    assert t.status is td.TrialStatus.COMPLETED and t.parent is None
    assert "opaque" in t.info["warm_start"]["reason"] and "opaque" in caplog.text
    assert f"trial {t.number} not added to the zoo" in caplog.text     # and the zoo says why it kept nothing
    # a zoo entry whose weights no longer load: a warning, a cold start, the trial still runs
    (zoo.dir / f"{e.id}.pt").write_bytes(b"\x00garbage")
    with pytest.warns(ZooWarning):
        td.Experiment(DigitsMLP(), ev, "random", budget=1, store=store, name="corrupt",
                      options=td.RunOptions(warm_start=True, verbose=False)).run()
    t = td.Experiment.load(store, "corrupt").trials()[0]
    assert t.status is td.TrialStatus.COMPLETED and t.info["warm_start"]["parent"] is None
