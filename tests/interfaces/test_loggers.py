"""td.loggers against the real trackers: a real run logs to TensorBoard (read back with
TensorBoard's event reader, HParams plugin data included) and to MLflow (read back with
MlflowClient from a local SQLite store); `tridens export-optuna` read back with optuna.load_study."""

import math

import pytest
import torch
from torch import nn

import tridens as td
from tridens.cli import main
from tridens.loggers import trial_name
from tridens.store import Store

from . import tiny_search


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    tmp = tmp_path_factory.mktemp("logged")
    tb, uri = tmp / "tb", f"sqlite:///{tmp / 'mlflow.db'}"
    tiny_search.experiment(tmp / "tridens.db", 3, callbacks=[td.loggers.TensorBoard(tb), td.loggers.MLflow(uri)]).run()
    with Store(tmp / "tridens.db", readonly=True) as store:
        trials = store.trials("tiny")
    best = max(trials, key=lambda t: (t.metric, -t.id))
    return tb, uri, trials, best


def test_tensorboard_runs_with_hparams(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    tb, _, trials, best = logged
    names = {t.id: f"trial-{trial_name(t)}" for t in trials}  # trial-<number> (the store id where none)
    assert sorted(p.name for p in (tb / "tiny").iterdir()) == sorted(names.values())
    for trial in trials:
        events = EventAccumulator(str(tb / "tiny" / names[trial.id]))
        events.Reload()
        acc = events.Scalars("val_acc")
        assert [e.step for e in acc] == [0, 1, 2]
        assert all(math.isclose(e.value, v, rel_tol=1e-6) for e, v in zip(acc, trial.metrics["val_acc"]))
        content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
        assert hparams["hidden"].number_value == trial.sample["hidden"]
        assert math.isclose(hparams["lr"].number_value, trial.sample["lr"])
        assert events.Scalars("tridens/best")[-1].value == (1.0 if trial.id == best.id else 0.0)


def test_mlflow_runs_with_params_metrics_and_best(logged):
    from mlflow import MlflowClient

    _, uri, trials, best = logged
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tiny")
    runs = {r.data.tags["tridens.trial_id"]: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == sorted(str(t.id) for t in trials)
    for trial in trials:
        run = runs[str(trial.id)]
        assert run.data.params == {"hidden": str(trial.sample["hidden"]), "lr": str(trial.sample["lr"])}
        history = client.get_metric_history(run.info.run_id, "val_acc")
        assert [m.step for m in history] == [0, 1, 2]
        assert [m.value for m in history] == pytest.approx(trial.metrics["val_acc"])
        assert run.info.status == "FINISHED" and run.data.tags["tridens.status"] == "completed"
        assert run.data.tags["tridens.fingerprint"] == trial.fingerprint
        assert (run.data.tags.get("tridens.best") == "true") == (trial.id == best.id)


def test_export_optuna_reads_back(tiny_store, tmp_path, capsys):
    import optuna

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert main(["export-optuna", "tiny", "--to", url, "--db", str(tiny_store)]) == 0
    assert "4 trials" in capsys.readouterr().out
    study = optuna.load_study(study_name="tiny", storage=url)
    with Store(tiny_store, readonly=True) as store:
        trials = sorted(store.trials("tiny"), key=lambda t: t.id)
    assert [t.value for t in study.trials] == pytest.approx([t.metric for t in trials])
    assert [t.params for t in study.trials] == [t.sample for t in trials]
    assert [list(t.intermediate_values.values()) for t in study.trials] == [t.metrics["val_acc"] for t in trials]
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    assert study.best_trial.user_attrs["tridens_trial_id"] == max(trials, key=lambda t: (t.metric, -t.id)).id
    # Optuna's own plots (what optuna-dashboard draws) read it
    from optuna import visualization

    history = visualization.plot_optimization_history(study)
    assert list(history.data[0].y) == pytest.approx([t.metric for t in trials])
    curves = visualization.plot_intermediate_values(study)
    assert sorted(len(trace.y) for trace in curves.data) == [3, 3, 3, 3]
    assert set(visualization.plot_param_importances(study).data[0].y) == {"hidden", "lr"}
    # a second export to the same study is refused, the study left as it was
    assert main(["export-optuna", "tiny", "--to", url, "--db", str(tiny_store)]) == 1
    assert "already holds a study 'tiny'" in capsys.readouterr().err
    assert len(optuna.load_study(study_name="tiny", storage=url).trials) == 4


def test_a_callback_that_is_not_one_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'callbacks' parameter of Experiment"):
        tiny_search.experiment(tmp_path / "x.db", 1, callbacks=["tb"]).run()


def test_export_optuna_keeps_the_declared_distributions_so_optuna_continues(tmp_path):
    """The exported study holds the space's declared domains (log scale, integer step, the
    categorical choices), not bounds of the values seen: Optuna continues it with the same
    suggest calls, and its sampler reads the stored trials."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=256,
                                             lr=td.loguniform("lr", 1e-4, 1e-1),
                                             momentum=td.uniform("momentum", 0.5, 0.95))
    space = tiny_search.TinyNet()
    db = tmp_path / "tridens.db"
    td.Experiment(space, evaluator, td.strategy.Random(), budget=3, store=db, name="declared",
                  options=td.RunOptions(seed=3, verbose=False)).run()
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert main(["export-optuna", "declared", "--to", url, "--db", str(db)]) == 0
    study = optuna.load_study(study_name="declared", storage=url)
    assert study.trials[0].distributions == {
        "hidden": CategoricalDistribution([4, 8, 16, 32]), "lr": FloatDistribution(1e-4, 1e-1, log=True),
        "momentum": FloatDistribution(0.5, 0.95)}

    def objective(trial):
        hidden = trial.suggest_categorical("hidden", [4, 8, 16, 32])
        lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        momentum = trial.suggest_float("momentum", 0.5, 0.95)
        return hidden * lr * momentum

    study.sampler = optuna.samplers.TPESampler(seed=0, n_startup_trials=1)
    study.optimize(objective, n_trials=2)
    assert [t.state for t in study.trials[3:]] == [optuna.trial.TrialState.COMPLETE] * 2


def test_export_optuna_declared_integer_and_index_choices(tmp_path):
    """A randint label is an IntDistribution over its declared range; a choice among modules (stored
    as indices) a CategoricalDistribution of every index, seen or not."""
    import optuna
    from optuna.distributions import CategoricalDistribution, IntDistribution

    from tridens import nn as tnn

    class Net(tnn.ModelSpace):
        def __init__(self):
            super().__init__()
            hidden = td.randint("hidden", 4, 40)
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), tnn.LayerChoice(
                [nn.ReLU(), nn.Tanh(), nn.Sigmoid()], label="act"), nn.Linear(hidden, 10))
            self.example_inputs = (torch.zeros(2, 1, 8, 8),)

        def forward(self, x):
            return self.body(x)

    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train=train, val=val, epochs=1, batch_size=256, lr=0.1)
    db = tmp_path / "tridens.db"
    td.Experiment(Net(), evaluator, td.strategy.Random(), budget=2, store=db, name="ints",
                  options=td.RunOptions(seed=1, verbose=False)).run()
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert main(["export-optuna", "ints", "--to", url, "--db", str(db)]) == 0
    study = optuna.load_study(study_name="ints", storage=url)
    assert study.trials[0].distributions == {"hidden": IntDistribution(4, 40),
                                             "act": CategoricalDistribution([0, 1, 2])}
    study.optimize(lambda t: t.suggest_int("hidden", 4, 40) + t.suggest_categorical("act", [0, 1, 2]), n_trials=1)
    assert len(study.trials) == 3
