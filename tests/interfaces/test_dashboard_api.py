"""The dashboard's JSON API on real stores: pages and aggregates with 10,000 trials written through
the store's API, filters and sorting, the Pareto front, the plan, and read-only access."""

import hashlib
import json
import math
import random

import pytest

from tridens.dashboard import Server, create_app
from tridens.dashboard._reader import MAX_CURVES, MAX_PAGE
from tridens.store import Store
from tridens.trial import Trial, TrialStatus

starlette_testclient = pytest.importorskip("starlette.testclient")

N = 10_000
STATUSES = [TrialStatus.COMPLETED] * 6 + [TrialStatus.STOPPED] * 2 + [TrialStatus.FAILED, TrialStatus.RUNNING]


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """10,000 trials with samples, metrics per step, params and errors, written with Store's API."""
    db = tmp_path_factory.mktemp("big") / "big.db"
    rng = random.Random(0)
    with Store(db) as store:
        store.create_experiment("big", {"objective": {"metric": "val_acc", "mode": "max"}, "max_trials": N})
        with store.transaction():
            for i in range(N):
                status = STATUSES[i % len(STATUSES)]
                width, op, lr = rng.choice([16, 32, 64]), rng.choice(["conv", "pool", "skip"]), 10 ** rng.uniform(-3, -1)
                acc = 0.5 + 0.3 * (width / 64) + 0.1 * (op == "conv") - 0.2 * abs(math.log10(lr) + 2) / 2 + rng.gauss(0, 0.02)
                curve = [acc * (s + 1) / 3 for s in range(3)]
                trial = Trial(id=-1, sample={"width": width, "op": op, "lr": lr}, seed=i, status=status,
                              fingerprint=f"fp{width}{op}", info={"params": width * 100, "train_seconds": 0.5},
                              group=i // 16, started_at=1000.0 + i, metrics={"val_acc": curve, "loss": [1 - c for c in curve]})
                if status in (TrialStatus.COMPLETED, TrialStatus.STOPPED):
                    trial.metric, trial.finished_at = curve[-1], 1001.0 + i
                if status is TrialStatus.FAILED:
                    trial.error, trial.finished_at = f"Traceback (most recent call last):\nValueError: bad width {width}", 1001.0 + i
                store.add_trial("big", trial)
    return db


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pages_of_ten_thousand_trials(big_store):
    before = _digest(big_store)
    client = starlette_testclient.TestClient(create_app(big_store))
    listing = client.get("/api/experiments").json()["experiments"]
    assert [e["name"] for e in listing] == ["big"] and listing[0]["trials"] == N
    assert listing[0]["by_status"]["completed"] == 6000 and listing[0]["progress"] == 0.9

    page = client.get("/api/experiments/big/trials?limit=50").json()
    assert page["total"] == N and len(page["rows"]) == 50
    assert [r["number"] for r in page["rows"]] == list(range(50))
    row = page["rows"][0]
    assert set(row["sample"]) == {"width", "op", "lr"} and row["params"] == row["sample"]["width"] * 100
    assert row["epochs"] == 3 and row["seed"] == 0

    tail = client.get("/api/experiments/big/trials?offset=9990&limit=50").json()
    assert [r["number"] for r in tail["rows"]] == list(range(9990, N))
    assert len(client.get("/api/experiments/big/trials?limit=100000").json()["rows"]) == MAX_PAGE

    best = client.get("/api/experiments/big/trials?sort=metric&desc=1&limit=20").json()["rows"]
    metrics = [r["metric"] for r in best]
    assert metrics == sorted(metrics, reverse=True)
    summary = client.get("/api/experiments/big").json()
    assert metrics[0] == summary["best"]
    assert summary["labels"] == ["width", "op", "lr"] and summary["metrics"] == ["loss", "val_acc"]
    over_time = summary["best_over_time"]
    assert 1 <= len(over_time) < 200 and [p["best"] for p in over_time] == sorted(p["best"] for p in over_time)

    failed = client.get("/api/experiments/big/trials?status=failed&limit=5").json()
    assert failed["total"] == 1000 and all(r["status"] == "failed" and "ValueError" in r["error"] for r in failed["rows"])
    convs = client.get("/api/experiments/big/trials?label.op=conv&status=completed,stopped&limit=500").json()
    assert 0 < convs["total"] < 8000 and all(r["sample"]["op"] == "conv" for r in convs["rows"])
    quoted = client.get('/api/experiments/big/trials?label.op="conv"&status=completed,stopped&limit=1').json()
    assert quoted["total"] == convs["total"]
    wide = client.get("/api/experiments/big/trials?label.width=64&sort=label:lr&limit=100").json()
    assert all(r["sample"]["width"] == 64 for r in wide["rows"])
    lrs = [r["sample"]["lr"] for r in wide["rows"]]
    assert lrs == sorted(lrs)

    ids = ",".join(str(r["id"]) for r in client.get("/api/experiments/big/trials?limit=80").json()["rows"])
    curves = client.get(f"/api/experiments/big/curves?ids={ids}&metric=val_acc").json()
    assert len(curves) == MAX_CURVES and all(list(c["metrics"]) == ["val_acc"] for c in curves.values())
    assert all(c["metrics"]["val_acc"]["steps"] == [0, 1, 2] for c in curves.values())

    hparams = client.get("/api/experiments/big/hparams").json()
    assert len(hparams["values"]) == len(hparams["samples"]) == 8000
    importance = client.get("/api/experiments/big/importance?evaluator=ped-anova").json()
    assert set(importance["importances"]) == {"width", "op", "lr"} and importance["trials"] == 6000
    plan = client.get("/api/experiments/big/plan").json()
    assert len(plan["groups"]) == 200 and plan["groups"][-1] == {"group": N // 16 - 1, "trials": 16, "train_seconds": 8.0}
    assert plan["units_recorded"] is False and math.isclose(plan["train_seconds"], 0.5 * N)

    assert _digest(big_store) == before  # the dashboard never writes


def test_errors_name_what_is_wrong(big_store):
    client = starlette_testclient.TestClient(create_app(big_store))
    missing = client.get("/api/experiments/nope/trials")
    assert missing.status_code == 404 and "'nope'" in missing.json()["error"] and "'big'" in missing.json()["error"]
    bad_sort = client.get("/api/experiments/big/trials?sort=colour")
    assert bad_sort.status_code == 400 and "colour" in bad_sort.json()["error"]
    bad_trial = client.get("/api/experiments/big/trials/10000")
    assert bad_trial.status_code == 404 and "0..9999" in bad_trial.json()["error"]
    assert client.get("/api/experiments/big/importance?evaluator=shap").status_code == 400


def test_pareto_front_and_relations(tmp_path):
    db = tmp_path / "pareto.db"
    with Store(db) as store:
        store.create_experiment("mo", {"objective": {"metric": "val_acc", "mode": "max"},
                                       "second_objective": ["params", "min"]})
        points = [(0.9, 300), (0.8, 100), (0.85, 400), (0.7, 100), (0.95, 900)]
        for i, (acc, params) in enumerate(points):
            store.add_trial("mo", Trial(id=-1, sample={"w": i}, seed=i, status=TrialStatus.COMPLETED, metric=acc,
                                        info={"params": params}, metrics={"val_acc": [acc]}))
        child = store.add_trial("mo", Trial(id=-1, sample={"w": 9}, seed=9, status=TrialStatus.COMPLETED, metric=0.5,
                                            parent=1, info={"params": 1000, "warm_start": {"parent": 1, "score": 0.75}}))
    client = starlette_testclient.TestClient(create_app(db))
    front = client.get("/api/experiments/mo/pareto").json()
    on_front = {n for n, f in zip(front["numbers"], front["front"]) if f}
    assert on_front == {0, 1, 4}  # (0.85, 400) is dominated by (0.9, 300); (0.7, 100) by (0.8, 100)
    plan = client.get("/api/experiments/mo/plan").json()
    assert plan["relations"] == [{"trial": 5, "id": child.id, "parent": 0, "warm_start": {"parent": 1, "score": 0.75},
                                  "inherit": None, "duplicate_of": None, "unit": None, "oneshot": None}]
    trial = client.get("/api/experiments/mo/trials/0").json()
    assert trial["children"] == [5] and trial["metrics"]["val_acc"]["values"] == [0.9]


def test_architecture_only_from_code_already_imported(tiny_store, tmp_path):
    client = starlette_testclient.TestClient(create_app(tiny_store))
    arch = client.get("/api/experiments/tiny/trials/0/architecture").json()
    assert arch["available"] is True and "Linear" in arch["text"]  # tests.interfaces.tiny_search is imported here
    assert "no second objective" in client.get("/api/experiments/tiny/pareto").json()["message"]
    db = tmp_path / "foreign.db"
    with Store(db) as store:
        store.create_experiment("foreign", {"space": {"kind": "model_space", "path": "someone_elses_module:Net",
                                                      "file": None, "args": [], "kwargs": {}}})
        store.add_trial("foreign", Trial(id=-1, sample={"w": 1}, seed=0, fingerprint="abc123"))
    arch = starlette_testclient.TestClient(create_app(db)).get("/api/experiments/foreign/trials/0/architecture").json()
    assert arch["available"] is False and "someone_elses_module:Net" in arch["reason"]
    assert arch["fingerprint"] == "abc123" and arch["sample"] == {"w": 1}
    import sys
    assert "someone_elses_module" not in sys.modules


def test_listens_on_localhost_unless_asked_and_warns(tiny_store, capsys):
    import urllib.request

    with Server(tiny_store, port=0) as server:
        assert server.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.url + "/api/experiments") as response:
            assert [e["name"] for e in json.load(response)["experiments"]] == ["tiny"]
    assert "warning" not in capsys.readouterr().err
    with Server(tiny_store, host="0.0.0.0", port=0):
        pass
    assert "tridens: warning: the dashboard listens on 0.0.0.0" in capsys.readouterr().err


def test_one_shot_supernet_curves_and_scored_subnets(tmp_path):
    """A store laid out as a one-shot run writes it (tridens.oneshot: a supernet trial, scored subnets)."""
    db = tmp_path / "oneshot.db"
    with Store(db) as store:
        store.create_experiment("spos", {"objective": {"metric": "val_acc", "mode": "max"}})
        supernet = store.add_trial("spos", Trial(id=-1, sample={}, seed=0, status=TrialStatus.COMPLETED,
                                                 info={"oneshot": {"role": "supernet", "strategy": "RandomOneShot"}}))
        for epoch, loss in enumerate([2.1, 1.4, 0.9]):
            store.add_metrics(supernet.id, epoch, {"train_loss": loss})
        for width, acc in ((16, 0.81), (32, 0.86)):
            store.add_trial("spos", Trial(id=-1, sample={"width": width}, seed=0, status=TrialStatus.COMPLETED, metric=acc,
                                          metrics={"val_acc": [acc]},
                                          info={"oneshot": {"role": "subnet", "strategy": "RandomOneShot", "inherited": True}}))
    view = starlette_testclient.TestClient(create_app(db)).get("/api/experiments/spos/oneshot").json()
    assert [s["id"] for s in view["supernets"]] == [supernet.id]
    assert view["supernets"][0]["metrics"]["train_loss"] == {"steps": [0, 1, 2], "values": [2.1, 1.4, 0.9]}
    assert [(s["sample"], s["metric"]) for s in view["subnets"]] == [({"width": 16}, 0.81), ({"width": 32}, 0.86)]
