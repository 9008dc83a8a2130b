"""MLflow keeps every parameter of a trial whose labels are over 250 characters or collide once
cleaned (``a:b`` and ``a?b``): each label gets its own key (cut, and marked with a digest of the
original). A real run of a function, logged to a real MLflow sqlite store, read back."""

import pytest

import tridens as td


def _value(**sample):
    return float(len(sample))


def test_long_and_colliding_labels_keep_every_parameter(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    long = "w" * 300
    labels = {long: [1, 2], "a:b": [3], "a?b": [4], "lr": [0.1]}
    evaluator = td.evaluators.FunctionalEvaluator(_value, **{k.replace(":", "_c_").replace("?", "_q_"): td.choice(k, v)
                                                             for k, v in labels.items()})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = td.Experiment(None, evaluator, "grid", budget=2, store=tmp_path / "runs.db", name="e",
                        callbacks=[td.loggers.MLflow(uri)], options=td.RunOptions(verbose=False))
    exp.run()
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert len(runs) == 2
    for run in runs:
        params = run.data.params
        assert len(params) == 4, params
        assert params["lr"] == "0.1"
        assert sorted(v for k, v in params.items() if k.startswith("a_b--")) == ["3", "4"]
        (key,) = [k for k in params if k.startswith("www")]
        assert len(key) == 250 and params[key] in ("1", "2")
