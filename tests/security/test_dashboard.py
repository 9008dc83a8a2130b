"""The dashboard answers only for its own addresses (a ``Host:`` allow-list against DNS
rebinding), and serves infinite or NaN metrics as null instead of failing; a function whose value
is not finite fails instead of ranking best."""

import http.client
import json
import math

import pytest

import tridens as td
from tridens.dashboard import Server, create_app
from tridens.store import Store
from tridens.trial import Trial, TrialStatus

starlette_testclient = pytest.importorskip("starlette.testclient")


def _store_with_infinities(db):
    with Store(db) as store:
        store.create_experiment("e", {"objective": {"metric": "loss", "mode": "min"}})
        for i, value in enumerate([math.inf, -math.inf, math.nan, 0.5]):
            trial = store.add_trial("e", Trial(id=-1, sample={"w": i}, seed=i, info={"params": 10}))
            store.add_metrics(trial.id, 0, {"loss": value, "other": 1.0})
            store.add_metrics(trial.id, 1, {"loss": value, "other": math.inf})
            trial.status, trial.metric = TrialStatus.COMPLETED, value
            store.finish_trial(trial)


def _get(url, path, host):
    address = url.removeprefix("http://")
    conn = http.client.HTTPConnection(address, timeout=30)
    conn.request("GET", path, headers={"Host": host})
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, body


def test_a_foreign_host_header_is_refused(tmp_path):
    db = tmp_path / "runs.db"
    _store_with_infinities(db)
    with Server(db, port=0) as server:
        port = server.url.rsplit(":", 1)[1]
        for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example", ""):
            status, body = _get(server.url, "/api/experiments", host)
            assert status == 403 and str(db) not in body.decode(), (host, body)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST"):
            status, body = _get(server.url, "/api/experiments", host)
            assert status == 200 and json.loads(body)["experiments"][0]["name"] == "e", (host, body)
    with Server(db, port=0, allowed_hosts=["tridens.lan"]) as server:
        assert _get(server.url, "/api/experiments", "tridens.lan:80")[0] == 200
        assert _get(server.url, "/", "other.lan")[0] == 403


def test_infinite_and_nan_metrics_are_served_as_null(tmp_path):
    db = tmp_path / "runs.db"
    _store_with_infinities(db)
    client = starlette_testclient.TestClient(create_app(db), base_url="http://localhost")
    for number in range(4):
        response = client.get(f"/api/experiments/e/trials/{number}")
        assert response.status_code == 200, response.text
    assert client.get("/api/experiments/e/trials/0").json()["metrics"]["loss"]["values"] == [None, None]
    curves = client.get("/api/experiments/e/curves?ids=0,1,2,3")
    assert curves.status_code == 200, curves.text
    for path in ("", "/trials", "/hparams", "/pareto", "/plan", "/importance"):
        response = client.get("/api/experiments/e" + path)
        assert response.status_code in (200, 400), (path, response.text)
    assert client.get("/api/experiments").status_code == 200


def _diverges(w):
    return math.inf if w == 1 else -math.inf if w == 2 else float(w)


def test_a_function_returning_infinity_fails_and_does_not_rank(tmp_path):
    evaluator = td.evaluators.FunctionalEvaluator(_diverges, w=td.choice("w", [0, 1, 2, 3]))
    for mode in ("max", "min"):
        exp = td.Experiment(None, evaluator, "grid", budget=4, store=tmp_path / f"{mode}.db", name="e",
                            objective=td.Objective("value", mode), options=td.RunOptions(verbose=False))
        exp.run()
        by_w = {t.sample["w"]: t for t in exp.trials()}
        assert by_w[1].status is TrialStatus.FAILED and "inf" in by_w[1].error and "finite" in by_w[1].error
        assert by_w[2].status is TrialStatus.FAILED
        assert exp.best().sample["w"] == (3 if mode == "max" else 0)
