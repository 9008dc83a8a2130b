"""One-shot runs go through the engine's trial protocol, on real digits: callbacks and loggers
receive the supernet's reports and the scored architectures, the budget stops the supernet's
training with the run's stop reason, and the store rows have the shape of a multi-trial run's."""

import sqlite3

import pytest

import tridens as td
from tridens.trial import TrialStatus

from .spaces import DigitsCNN
from .spaces import role as _role


@pytest.fixture
def evaluator(digits_data):
    train, val = digits_data
    return td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="adam", lr=0.01)


class Recorder(td.loggers.Callback):
    def __init__(self):
        self.events = []

    def on_experiment_start(self, name, config):
        self.events.append(("start", name))

    def on_trial_step(self, trial, step, metrics):
        self.events.append(("step", trial.id, step, dict(metrics)))

    def on_trial_end(self, trial):
        self.events.append(("end", trial.id, trial.status, trial.metric, trial.checkpoint))

    def on_experiment_end(self, name, best, trials):
        self.events.append(("experiment_end", name, None if best is None else best.id, [t.id for t in trials]))

    def close(self):
        self.events.append(("close",))


def test_callbacks_receive_the_supernet_reports_and_the_scored_architectures(tmp_path, evaluator):
    rec = Recorder()
    exp = td.Experiment(DigitsCNN(), evaluator, td.oneshot.RandomOneShot(samples=3, search="random", retrain=1),
                        store=tmp_path / "t.db", name="cb", callbacks=[rec], options=td.RunOptions(verbose=False)).run()
    trials = {t.id: t for t in exp.trials()}
    supernet = next(t for t in trials.values() if _role(t) == "supernet")
    assert rec.events[0] == ("start", "cb") and rec.events[-1] == ("close",)
    steps = [e for e in rec.events if e[0] == "step"]
    assert [(e[2], sorted(e[3])) for e in steps if e[1] == supernet.id] == [(0, ["train_loss"]), (1, ["train_loss"])]
    assert [e[3]["train_loss"] for e in steps if e[1] == supernet.id] == pytest.approx(supernet.metrics["train_loss"])
    ends = {e[1]: e for e in rec.events if e[0] == "end"}
    assert set(ends) == set(trials)  # the supernet, every scored subnet and the retrained one
    for tid, (_, _, status, metric, checkpoint) in ends.items():
        assert status is trials[tid].status is TrialStatus.COMPLETED and checkpoint == trials[tid].checkpoint
        assert metric == trials[tid].metric
    assert ends[supernet.id][3] is None  # the supernet never ranks
    for t in trials.values():
        if _role(t) != "supernet":  # each architecture's reports: its validation metrics, per step
            reported = [e[3] for e in steps if e[1] == t.id]
            assert [r["val_acc"] for r in reported] == pytest.approx(t.metrics["val_acc"])
    assert sorted(_role(t) for t in trials.values()) == ["retrain", "subnet", "subnet", "subnet", "supernet"]
    (end,) = [e for e in rec.events if e[0] == "experiment_end"]
    assert end[1] == "cb" and end[2] == exp.best().id and sorted(end[3]) == sorted(trials)


def test_max_duration_stops_the_supernet_training_and_a_second_run_finishes_it(tmp_path, evaluator, capsys):
    db = tmp_path / "t.db"
    strategy = td.oneshot.DARTS(epochs=3, samples=2, population=2)
    exp = td.Experiment(DigitsCNN(), evaluator, strategy, store=db, name="darts",
                        budget=td.Budget(max_duration=1e-6), options=td.RunOptions(verbose=True)).run()
    assert exp.stop_reason == ("max_duration=1e-06 reached during the supernet's training, after epoch 1 of 3 "
                               "(its checkpoint is kept: run again to continue)")
    assert f"[darts] stopped: {exp.stop_reason}" in capsys.readouterr().err
    (supernet,) = exp.trials()  # no subnet scored by a supernet cut short
    assert supernet.status is TrialStatus.STOPPED and supernet.metric is None and supernet.checkpoint
    assert len(supernet.metrics["train_loss"]) == 1
    again = td.Experiment(DigitsCNN(), evaluator, td.oneshot.DARTS(epochs=3, samples=2, population=2), store=db,
                          name="darts", options=td.RunOptions(verbose=False)).run()
    assert again.stop_reason.startswith("DARTS is done: the supernet trained 3 epochs, 2 subnets scored")
    supernet = next(t for t in again.trials() if _role(t) == "supernet")
    assert supernet.status is TrialStatus.COMPLETED and len(supernet.metrics["train_loss"]) == 3


def test_trial_timeout_fails_the_supernet_with_the_protocol_message(tmp_path, evaluator):
    exp = td.Experiment(DigitsCNN(), evaluator, td.oneshot.RandomOneShot(samples=2, search="random"),
                        store=tmp_path / "t.db", name="slow", budget=td.Budget(trial_timeout=1e-9),
                        options=td.RunOptions(verbose=False)).run()
    (supernet,) = exp.trials()
    assert supernet.status is TrialStatus.FAILED
    assert supernet.error.startswith(f"trial {supernet.label} exceeded trial_timeout=1e-09 s after epoch 0")
    assert exp.stop_reason == f"{supernet.error}; its checkpoint after epoch 1 of 2 is kept: run again to continue"


def test_tensorboard_and_mlflow_loggers_receive_a_one_shot_run(tmp_path, evaluator):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tridens.loggers import trial_name

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = td.Experiment(DigitsCNN(), evaluator, td.oneshot.ENAS(samples=2, population=2), store=tmp_path / "t.db",
                        name="enas", callbacks=[td.loggers.TensorBoard(tmp_path / "tb"), td.loggers.MLflow(uri)],
                        options=td.RunOptions(verbose=False)).run()
    trials = exp.trials()
    assert sorted(p.name for p in (tmp_path / "tb" / "enas").iterdir()) == sorted(f"trial-{trial_name(t)}" for t in trials)
    client = MlflowClient(tracking_uri=uri)
    runs = {r.data.tags["tridens.trial_id"]: r for r in
            client.search_runs([client.get_experiment_by_name("enas").experiment_id])}
    assert sorted(runs) == sorted(str(t.id) for t in trials)
    for t in trials:
        events = EventAccumulator(str(tmp_path / "tb" / "enas" / f"trial-{trial_name(t)}"))
        events.Reload()
        name = "train_loss" if _role(t) == "supernet" else "val_acc"
        assert [e.value for e in events.Scalars(name)] == pytest.approx(t.metrics[name])
        assert events.Scalars("tridens/best")[-1].value == (1.0 if t.id == exp.best().id else 0.0)
        run = runs[str(t.id)]
        history = client.get_metric_history(run.info.run_id, name)
        assert [m.step for m in history] == list(range(len(t.metrics[name])))
        assert [m.value for m in history] == pytest.approx(t.metrics[name])
        assert run.info.status == "FINISHED" and run.data.tags["tridens.status"] == "completed"
        assert (run.data.tags.get("tridens.best") == "true") == (t.id == exp.best().id)


def _rows(db, name):
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute("SELECT t.* FROM trials t JOIN experiments e ON e.id = t.experiment_id WHERE e.name = ?",
                            (name,)).fetchall()
        steps = {r["id"]: [s for (s,) in conn.execute("SELECT DISTINCT step FROM metrics WHERE trial_id = ? ORDER BY step",
                                                       (r["id"],))] for r in rows}
        checkpoints = {r["id"]: conn.execute("SELECT COUNT(*) FROM checkpoints WHERE trial_id = ?", (r["id"],)).fetchone()[0]
                       for r in rows}
    finally:
        conn.close()
    return rows, steps, checkpoints


def test_store_rows_have_the_shape_of_a_multi_trial_runs(tmp_path, evaluator):
    db = tmp_path / "t.db"
    td.Experiment(DigitsCNN(), evaluator, td.strategy.Random(), budget=2, store=db, name="multi",
                  options=td.RunOptions(verbose=False)).run()
    td.Experiment(DigitsCNN(), evaluator, td.oneshot.RandomOneShot(samples=2, search="random", retrain=1), store=db,
                  name="one", options=td.RunOptions(verbose=False)).run()
    multi, multi_steps, multi_ckpt = _rows(db, "multi")
    one, one_steps, one_ckpt = _rows(db, "one")

    def filled(row):  # the columns a finished trial has a value in (ids and parents aside)
        return {k for k in row.keys() if row[k] is not None and k not in ("parent_id", "parent", "error")}

    shape = filled(multi[0])
    assert all(filled(r) == shape for r in multi)
    for row in one:
        role = "supernet" if row["fingerprint"].startswith("supernet:") else "architecture"
        assert row["status"] == "completed"
        expected = shape - {"metric"} if role == "supernet" else shape  # the supernet has no objective value
        assert filled(row) - {"metric_nan"} == expected - {"metric_nan"}, role
        assert one_ckpt[row["id"]] >= 1
    assert all(multi_steps[r["id"]] == [0, 1] for r in multi)
    assert sorted(len(s) for s in one_steps.values()) == [1, 1, 2, 2]  # subnets: one scoring; supernet, retrain: epochs
    assert all(s == list(range(len(s))) for s in one_steps.values())
