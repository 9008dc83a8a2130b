"""The dashboard's JSON API on real stores: pages and aggregates with 10,000 trials written through
the store's API, filters and sorting, the Pareto front, the plan, and read-only access."""

import hashlib
import json
import math
import random
import shutil

import pytest

from tridens.dashboard import Server, create_app
from tridens.dashboard._reader import MAX_CURVES, MAX_PAGE, MAX_POINTS, StoreReader
from tridens.dashboard._views import Importance, pareto
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
                              fingerprint=f"fp{width}{op}", info={"params": width * 100, "flops": width * 2000, "train_seconds": 0.5},
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
    client = starlette_testclient.TestClient(create_app(big_store), base_url="http://localhost")
    listing = client.get("/api/experiments").json()["experiments"]
    assert [e["name"] for e in listing] == ["big"] and listing[0]["trials"] == N
    assert listing[0]["by_status"]["completed"] == 6000 and listing[0]["progress"] == 0.9

    page = client.get("/api/experiments/big/trials?limit=50").json()
    assert page["total"] == N and len(page["rows"]) == 50
    assert [r["number"] for r in page["rows"]] == list(range(50))
    row = page["rows"][0]
    assert set(row["sample"]) == {"width", "op", "lr"} and row["params"] == row["sample"]["width"] * 100
    assert row["epochs"] == 3 and row["seed"] == 0 and row["flops"] == row["sample"]["width"] * 2000
    by_flops = client.get("/api/experiments/big/trials?sort=flops&desc=1&limit=500").json()["rows"]
    assert all(r["flops"] == 128_000 for r in by_flops)  # the widest first

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
    assert len(hparams["values"]) == len(hparams["samples"]) == MAX_POINTS < 8000
    assert hparams["total"] == 8000 and hparams["sampled"] is True
    importance = client.get("/api/experiments/big/importance?evaluator=ped-anova").json()
    assert set(importance["importances"]) == {"width", "op", "lr"}
    assert importance["trials"] == 8000 and "step 2" in importance["basis"]  # completed and stopped, at step 2
    plan = client.get("/api/experiments/big/plan").json()
    assert len(plan["groups"]) == 200 and plan["groups"][-1] == {"group": N // 16 - 1, "trials": 16, "train_seconds": 8.0}
    assert plan["units_recorded"] is False and math.isclose(plan["train_seconds"], 0.5 * N)

    assert _digest(big_store) == before  # the dashboard never writes


def test_hyperparameter_views_of_many_trials_are_bounded_and_keep_the_best(big_store):
    """Past MAX_POINTS finished trials, /hparams sends the best tenth and a uniform sample of the
    others (the same trials on every call), and says how many there are."""
    client = starlette_testclient.TestClient(create_app(big_store), base_url="http://localhost")
    full = StoreReader(big_store).finished_points("big")
    assert len(full["values"]) == 8000 and full["sampled"] is False
    small = client.get("/api/experiments/big/hparams?limit=400").json()
    assert len(small["ids"]) == 400 and small["total"] == 8000 and small["sampled"] and small["best"] == 40
    assert len(client.get("/api/experiments/big/hparams?limit=100000").json()["ids"]) == MAX_POINTS
    assert small == client.get("/api/experiments/big/hparams?limit=400").json()  # the same sample again
    best = sorted(full["values"], reverse=True)[:40]
    assert sorted(small["values"], reverse=True)[:40] == best
    by_id = dict(zip(full["ids"], zip(full["samples"], full["values"], full["numbers"])))
    assert all(by_id[i] == (s, v, n) for i, s, v, n in zip(small["ids"], small["samples"], small["values"], small["numbers"]))
    assert small["ids"] == sorted(small["ids"])
    # the sample spreads over the whole run, not its first trials
    assert min(small["numbers"]) < N // 10 and max(small["numbers"]) > N - N // 10
    widths = [s["width"] for s in small["samples"]]
    assert all(abs(widths.count(w) / len(widths) - 1 / 3) < 0.08 for w in (16, 32, 64))


def test_importance_of_many_trials_on_a_sample_ranks_the_labels_as_on_all_of_them(big_store):
    reader = StoreReader(big_store)
    every = Importance(reader)("big")
    assert every["trials"] == 8000 and "sample" not in every["basis"]
    sampled = Importance(reader, max_trials=2000)("big")
    assert sampled["trials"] == 2000 and "a uniform sample of 2,000 of the 8,000" in sampled["basis"]
    rank = lambda result: sorted(result["importances"], key=result["importances"].get, reverse=True)  # noqa: E731
    assert rank(sampled) == rank(every) == ["width", "op", "lr"]
    assert all(abs(sampled["importances"][k] - every["importances"][k]) < 0.1 for k in every["importances"])


def test_errors_name_what_is_wrong(big_store):
    client = starlette_testclient.TestClient(create_app(big_store), base_url="http://localhost")
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
    client = starlette_testclient.TestClient(create_app(db), base_url="http://localhost")
    front = client.get("/api/experiments/mo/pareto").json()
    on_front = {n for n, f in zip(front["numbers"], front["front"]) if f}
    assert on_front == {0, 1, 4}  # (0.85, 400) is dominated by (0.9, 300); (0.7, 100) by (0.8, 100)
    plan = client.get("/api/experiments/mo/plan").json()
    assert plan["relations"] == [{"trial": 5, "id": child.id, "parent": 0, "warm_start": {"parent": 1, "score": 0.75},
                                  "inherit": None, "duplicate_of": None, "unit": None, "oneshot": None, "exploits": []}]
    assert plan["units"] == [] and plan["saved_seconds"] is None
    trial = client.get("/api/experiments/mo/trials/0").json()
    assert trial["children"] == [5] and trial["metrics"]["val_acc"]["values"] == [0.9]


def _vm_steps(reader, call):
    """SQLite virtual-machine instructions the reader's connection runs for ``call()``: the work
    done, counted the same on every machine."""
    steps = [0]

    def count():
        steps[0] += 1
        return 0

    conn = reader._conn()
    conn.set_progress_handler(count, 1)
    try:
        result = call()
    finally:
        conn.set_progress_handler(None, 1)
    return steps[0], result


def test_polled_summary_reads_only_what_changed(tmp_path):
    """The summary the page polls reads every trial once; a later poll reads the trials added since
    and those still running, and sees what they changed: a new label, a new metric name from a
    running trial, a new best, a new stop step."""
    db = tmp_path / "poll.db"
    rng = random.Random(1)
    with Store(db) as store:
        store.create_experiment("e", {"objective": {"metric": "val_acc", "mode": "max"}})
        with store.transaction():
            for i in range(3000):
                status = STATUSES[i % len(STATUSES)]
                acc = rng.uniform(0.1, 0.8)
                trial = Trial(id=-1, sample={"width": rng.choice([16, 32]), "lr": rng.uniform(0.01, 0.1)}, seed=i,
                              status=status, started_at=1000.0 + i,
                              metrics={"val_acc": [acc / 2, acc][:1 + (status is not TrialStatus.STOPPED)]})
                if status in (TrialStatus.COMPLETED, TrialStatus.STOPPED):
                    trial.metric, trial.finished_at = trial.metrics["val_acc"][-1], 1001.0 + i
                store.add_trial("e", trial)
        running = next(t for t in store.trials("e") if t.status is TrialStatus.RUNNING)
    reader = StoreReader(db)
    first_steps, first = _vm_steps(reader, lambda: reader.experiment("e"))
    assert first["labels"] == ["width", "lr"] and first["metrics"] == ["val_acc"] and first["stop_steps"] == [0]
    again_steps, again = _vm_steps(reader, lambda: reader.experiment("e"))
    assert again == first
    assert again_steps * 4 < first_steps, (again_steps, first_steps)

    with Store(db) as store:
        store.add_metrics(running.id, 0, {"val_acc": 0.5, "train_loss": 1.0})  # a running trial's new metric
        store.add_trial("e", Trial(id=-1, sample={"width": 16, "lr": 0.05, "depth": 2}, seed=1, finished_at=9000.0,
                                   status=TrialStatus.COMPLETED, metric=0.99, metrics={"val_acc": [0.99]}))
        store.add_trial("e", Trial(id=-1, sample={"width": 16, "lr": 0.05}, seed=2, status=TrialStatus.STOPPED,
                                   finished_at=9001.0, metric=0.2, metrics={"val_acc": [0.1, 0.15, 0.2]}))
    poll_steps, poll = _vm_steps(reader, lambda: reader.experiment("e"))
    assert poll["labels"] == ["width", "lr", "depth"] and poll["metrics"] == ["train_loss", "val_acc"]
    assert poll["best"] == 0.99 and poll["best_over_time"][-2:] == [
        {"time": 9000.0, "best": 0.99, "trial": poll["best_over_time"][-2]["trial"]},
        {"time": 9001.0, "best": 0.99, "trial": poll["best_over_time"][-2]["trial"]}]
    assert poll["stop_steps"] == [0, 2] and poll["by_status"]["completed"] == first["by_status"]["completed"] + 1
    assert poll_steps * 4 < first_steps, (poll_steps, first_steps)
    # what a fresh reader computes from scratch
    fresh = StoreReader(db).experiment("e")
    assert {k: v for k, v in fresh.items() if k != "updated_at"} == {k: v for k, v in poll.items() if k != "updated_at"}


def test_pareto_of_many_trials_is_bounded_and_is_optunas_front(tmp_path):
    """The Pareto view reads the two objective columns (no Optuna study), finds the front Optuna's
    best_trials finds (ties, stopped and failed trials, a missing second value included), and past
    max_points sends the whole front and a uniform sample of the others."""
    import optuna

    db = tmp_path / "mo.db"
    rng = random.Random(2)
    with Store(db) as store:
        store.create_experiment("mo", {"objective": {"metric": "val_acc", "mode": "max"},
                                       "second_objective": ["params", "min"]})
        with store.transaction():
            for i in range(600):
                status = ([TrialStatus.COMPLETED] * 3 + [TrialStatus.STOPPED, TrialStatus.FAILED])[i % 5]
                u = rng.uniform(0, 1)  # the more accurate, the larger; rounded, so that points tie
                acc, params = round(u, 1), 100 * round(10 * u + rng.choice([0, 1, 2]))
                info = {} if i % 50 == 7 else {"params": params}  # no second value: not on the front
                store.add_trial("mo", Trial(id=-1, sample={"w": i}, seed=i, status=status, info=info,
                                            metric=acc if status is not TrialStatus.FAILED else None))
    reader = StoreReader(db)
    whole = pareto(reader, "mo", max_points=10_000)
    assert whole["sampled"] is False and whole["total"] == len(whole["ids"])
    study = optuna.create_study(directions=["maximize", "minimize"])
    for tid, status, value, second in zip(whole["ids"], reader.objective_pairs("mo", "params")["statuses"],
                                          whole["values"], whole["second"]):
        if status == "completed" and second is not None:
            study.add_trial(optuna.trial.create_trial(values=[value, second], user_attrs={"id": tid}))
    expected = {t.user_attrs["id"] for t in study.best_trials}
    assert {i for i, f in zip(whole["ids"], whole["front"]) if f} == expected and len(expected) > 10

    bound = len(expected) + 40
    small = pareto(reader, "mo", max_points=bound)
    assert len(small["ids"]) == bound and small["total"] == whole["total"] > 400 and small["sampled"] is True
    assert {i for i, f in zip(small["ids"], small["front"]) if f} == expected
    assert small == pareto(reader, "mo", max_points=bound) and small["ids"] == sorted(small["ids"])
    by_id = dict(zip(whole["ids"], zip(whole["numbers"], whole["values"], whole["second"])))
    assert all(by_id[i] == p for i, p in zip(small["ids"], zip(small["numbers"], small["values"], small["second"])))
    assert max(small["numbers"]) > 400  # spread over the run


def test_pareto_needs_no_optuna_study(tmp_path):
    """A real dashboard process answers /pareto without importing Optuna (it builds no study)."""
    import subprocess
    import sys

    db = tmp_path / "mo.db"
    with Store(db) as store:
        store.create_experiment("mo", {"objective": {"metric": "val_acc", "mode": "max"},
                                       "second_objective": ["params", "min"]})
        for i, (acc, params) in enumerate([(0.9, 300), (0.8, 100), (0.85, 400)]):
            store.add_trial("mo", Trial(id=-1, sample={"w": i}, seed=i, status=TrialStatus.COMPLETED, metric=acc,
                                        info={"params": params}))
    code = ("import sys, json; from starlette.testclient import TestClient; from tridens.dashboard import create_app; "
            f"r = TestClient(create_app({str(db)!r}), base_url='http://localhost').get('/api/experiments/mo/pareto').json(); "
            "print(json.dumps([r['front'], 'optuna' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [[True, True, False], False]


def test_architecture_only_from_code_already_imported(tiny_store, tmp_path):
    client = starlette_testclient.TestClient(create_app(tiny_store), base_url="http://localhost")
    arch = client.get("/api/experiments/tiny/trials/0/architecture").json()
    assert arch["available"] is True and "Linear" in arch["text"]  # tests.interfaces.tiny_search is imported here
    assert "no second objective" in client.get("/api/experiments/tiny/pareto").json()["message"]
    db = tmp_path / "foreign.db"
    with Store(db) as store:
        store.create_experiment("foreign", {"space": {"kind": "model_space", "path": "someone_elses_module:Net",
                                                      "file": None, "args": [], "kwargs": {}}})
        store.add_trial("foreign", Trial(id=-1, sample={"w": 1}, seed=0, fingerprint="abc123"))
    arch = starlette_testclient.TestClient(create_app(db), base_url="http://localhost").get("/api/experiments/foreign/trials/0/architecture").json()
    assert arch["available"] is False and "someone_elses_module:Net" in arch["reason"]
    assert arch["fingerprint"] == "abc123" and arch["sample"] == {"w": 1}
    import sys
    assert "someone_elses_module" not in sys.modules


def test_fanova_fits_on_a_bounded_sample_of_the_best_and_the_rest(big_store):
    """fANOVA's forest is fitted on at most max_fanova_trials trials, the best tenth and a uniform
    sample of the others, and the response says so; PED-ANOVA keeps its own, larger bound."""
    reader = StoreReader(big_store)
    fanova = Importance(reader, max_fanova_trials=300)("big", "fanova")
    assert fanova["trials"] == 300 and fanova["total"] == 8000
    assert "fitted on 300 of the 8,000: the best 30 and a uniform sample of the others" in fanova["basis"]
    assert set(fanova["importances"]) == {"width", "op", "lr"}
    assert max(fanova["importances"], key=fanova["importances"].get) == "width"
    # the sample holds the 30 best values at the common step, and the same trials on every call
    at_step = reader.values_at_common_step("big")
    chosen = reader.values_at_common_step("big", limit=300, best=30)
    assert len(chosen["ids"]) == 300 and chosen["ids"] == sorted(chosen["ids"])
    assert sorted(chosen["values"], reverse=True)[:30] == sorted(at_step["values"], reverse=True)[:30]
    assert chosen == reader.values_at_common_step("big", limit=300, best=30)
    ped = Importance(reader, max_fanova_trials=300)("big", "ped-anova")
    assert ped["trials"] == 8000 and ped["total"] == 8000 and "sample" not in ped["basis"]


@pytest.mark.slow
def test_fanova_at_its_default_bound_over_http(big_store):
    """The dashboard's own fANOVA endpoint on 8,000 finished trials fits on MAX_FANOVA_TRIALS."""
    from tridens.dashboard._views import MAX_FANOVA_TRIALS

    client = starlette_testclient.TestClient(create_app(big_store), base_url="http://localhost")
    result = client.get("/api/experiments/big/importance?evaluator=fanova").json()
    assert result["trials"] == MAX_FANOVA_TRIALS == 1000 and result["total"] == 8000
    assert f"fitted on 1,000 of the 8,000: the best {MAX_FANOVA_TRIALS // 10}" in result["basis"]
    assert max(result["importances"], key=result["importances"].get) == "width"


def test_importance_with_either_optuna_evaluator(tiny_store):
    client = starlette_testclient.TestClient(create_app(tiny_store), base_url="http://localhost")
    for evaluator in ("ped-anova", "fanova"):
        result = client.get(f"/api/experiments/tiny/importance?evaluator={evaluator}").json()
        assert result["evaluator"] == evaluator and result["trials"] == 4, result
        assert set(result["importances"]) == {"hidden", "lr"} and all(v >= 0 for v in result["importances"].values())


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
    view = starlette_testclient.TestClient(create_app(db), base_url="http://localhost").get("/api/experiments/spos/oneshot").json()
    assert [s["id"] for s in view["supernets"]] == [supernet.id]
    assert view["supernets"][0]["metrics"]["train_loss"] == {"steps": [0, 1, 2], "values": [2.1, 1.4, 0.9]}
    assert [(s["sample"], s["metric"]) for s in view["subnets"]] == [({"width": 16}, 0.81), ({"width": 32}, 0.86)]


def test_plan_units_and_their_savings(tmp_path):
    """Units as the planner records them (``info["unit"]``, ``info["stages"]``): a stage tree's
    saving from its epochs against its trials' epochs, a fused unit's from a recorded speed-up,
    nothing where the store cannot tell."""
    db = tmp_path / "plan.db"
    tree = {"kind": "stage tree", "trials": [], "shared": ["training prefixes"], "reason": "shared prefixes"}
    with Store(db) as store:
        store.create_experiment("plan", {"objective": {"metric": "val_acc", "mode": "max"}})
        ids = [store.add_trial("plan", Trial(id=-1, sample={"lr": i}, seed=0)).id for i in range(6)]
        tree["trials"] = ids[:3]
        # a tree of 3 trials of 3 epochs: node a (epochs 0-1) for all, then b (1-3) for two, c (1-3) for one
        paths = [[["a", None, 0], ["b", "a", 1]], [["a", None, 0], ["b", "a", 1]], [["a", None, 0], ["c", "a", 1]]]
        fused = {"kind": "batched", "trials": ids[3:5], "shared": ["one data pipeline"],
                 "speedups": [{"trials": ids[3:5], "speedup": 2.5, "fused": True}]}
        separate = {"kind": "separate", "trials": ids[5:], "shared": []}
        units = [(tree, paths[0]), (tree, paths[1]), (tree, paths[2]), (fused, None), (fused, None), (separate, None)]
        for tid, (unit, path) in zip(ids, units):
            trial = store.trial(tid)
            trial.status, trial.metric, trial.metrics = TrialStatus.COMPLETED, 0.5, {"val_acc": [0.3, 0.4, 0.5]}
            trial.info.update({"unit": unit, "train_seconds": 1.0, **({"stages": path} if path else {})})
            store.update_trial(trial)
            for step, value in enumerate(trial.metrics["val_acc"]):
                store.add_metrics(tid, step, {"val_acc": value})
    plan = starlette_testclient.TestClient(create_app(db), base_url="http://localhost").get("/api/experiments/plan/plan").json()
    by_kind = {u["kind"]: u for u in plan["units"]}
    assert [u["kind"] for u in plan["units"]] == ["stage tree", "batched", "separate"]
    assert by_kind["stage tree"]["trials"] == [0, 1, 2] and by_kind["stage tree"]["train_seconds"] == 3.0
    assert (by_kind["stage tree"]["epochs_trained"], by_kind["stage tree"]["trial_epochs"]) == (5, 9)
    assert math.isclose(by_kind["stage tree"]["saved_seconds"], 3.0 * (9 - 5) / 5)
    assert math.isclose(by_kind["batched"]["saved_seconds"], 2.0 * 1.5)  # 2 s fused at 2.5x: 5 s apart
    assert by_kind["separate"]["saved_seconds"] == 0.0
    assert math.isclose(plan["saved_seconds"], 2.4 + 3.0) and plan["units_recorded"] is True


def test_stage_tree_of_a_real_grid(tmp_path):
    """A grid over step-schedule milestones and decay trains as one stage tree; the API gives it
    back as the store holds it: one root, every other stage below it, the trials of each."""
    from tests.interfaces.views_search import FixedNet

    import tridens as td

    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, batch_size=128, lr=0.05, schedule="step", epochs=3,
                                             milestones=td.choice("milestones", [[1], [2]]),
                                             gamma=td.choice("gamma", [0.1, 0.5]))
    db = tmp_path / "tree.db"
    td.Experiment(FixedNet(), evaluator, td.strategy.GridSearch(batch_size=16), store=db, name="tree",
                  options=td.RunOptions(seeds="per-architecture", verbose=False)).run()
    client = starlette_testclient.TestClient(create_app(db), base_url="http://localhost")
    tree = client.get("/api/experiments/tree/stages").json()
    stages = tree["stages"]
    roots = [s for s in stages if s["parent"] is None]
    assert len(roots) == 1 and roots[0]["epochs"] == [0, 1] and sorted(roots[0]["trials"]) == [0, 1, 2, 3]
    assert tree["total"] == len(stages) and tree["epochs_here"] == sum(s["epochs"][1] - s["epochs"][0] for s in stages)
    assert tree["epochs_here"] < 4 * 3 and tree["epochs_reused"] == 0  # fewer epochs than 4 trials alone
    assert all(s["status"] == "done" and s["checkpoint"] and s["lr"] for s in stages)
    ids = {s["id"] for s in stages}
    assert all(s["parent"] in ids for s in stages if s is not roots[0])
    unit = client.get("/api/experiments/tree/plan").json()["units"]
    assert [u["kind"] for u in unit] == ["stage tree"] and unit[0]["epochs_trained"] == tree["epochs_here"]
    assert unit[0]["trial_epochs"] == 12 and unit[0]["saved_seconds"] > 0
    assert client.get("/api/experiments/tree/stages").status_code == 200
    assert client.get("/api/experiments/nope/stages").status_code == 404


def test_a_fused_units_measured_speedup_reaches_the_plan(tmp_path):
    """Same-shaped trials train as one batched unit that decides on its first real steps (the
    measured ratio overridden, so the decision is known); the store keeps the decision with each
    trial's unit, the plan tells the seconds saved. A second experiment in the same process plans
    in its own run's context: it decides on its own first steps again."""
    import tridens as td
    from tridens.xopt import Settings

    from .views_search import FixedNet

    train, val = td.datasets.digits()
    evaluator = td.evaluators.Classification(train, val, batch_size=128, epochs=2, lr=td.choice("lr", [0.01, 0.03, 0.1, 0.3]))
    db = tmp_path / "fused.db"
    for name in ("first", "second"):
        td.Experiment(FixedNet(), evaluator, td.strategy.GridSearch(batch_size=16), store=db, name=name,
                      executor=td.executors.Inline(optimize=Settings().with_batching(mode="auto", override_speedup=3.0)),
                      options=td.RunOptions(verbose=False)).run()
    client = starlette_testclient.TestClient(create_app(db), base_url="http://localhost")
    for name in ("first", "second"):
        plan = client.get(f"/api/experiments/{name}/plan").json()
        [unit] = plan["units"]
        assert unit["kind"] == "batched" and unit["speedups"] == [{"trials": [0, 1, 2, 3], "speedup": 3.0, "fused": True}]
        assert math.isclose(unit["saved_seconds"], 2.0 * unit["train_seconds"]) and unit["saved_seconds"] > 0
    assert "as measured on their first real steps" in unit["reason"]  # the second run measured again


def test_importance_under_early_stopping_counts_the_stopped_trials(views_store):
    """ASHA stopped most trials at its first rung: importance compares every finished trial at the
    step all of them reached, and says so, instead of ranking labels on the few completed ones."""
    client = starlette_testclient.TestClient(create_app(views_store), base_url="http://localhost")
    counts = client.get("/api/experiments/asha").json()["by_status"]
    assert counts.get("stopped", 0) >= 2
    result = client.get("/api/experiments/asha/importance?evaluator=fanova").json()
    assert result["trials"] == counts["completed"] + counts["stopped"], result
    assert "step 0" in result["basis"] and "stopped" in result["basis"]


def test_log_labels_progress_of_a_run_without_a_limit_and_the_favicon(views_store):
    client = starlette_testclient.TestClient(create_app(views_store), base_url="http://localhost")
    assert client.get("/api/experiments/logscale/hparams").json()["log_labels"] == ["lr"]
    assert client.get("/api/experiments/asha/hparams").json()["log_labels"] == []
    oneshot = next(e for e in client.get("/api/experiments").json()["experiments"] if e["name"] == "oneshot")
    assert oneshot["max_trials"] is None and oneshot["status"] == "done" and oneshot["progress"] == 1.0
    icon = client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")


def test_a_store_not_created_yet_is_waited_for(tiny_store, tmp_path):
    """The dashboard starts before its store exists: the experiment list is empty (and says it
    waits), and fills once a run creates the store, without a restart."""
    later = tmp_path / "later.db"
    client = starlette_testclient.TestClient(create_app(later), base_url="http://localhost")
    body = client.get("/api/experiments").json()
    assert body == {"store": str(later), "exists": False, "experiments": []}
    assert client.get("/api/experiments/tiny").status_code == 404
    shutil.copy(tiny_store, later)
    assert [e["name"] for e in client.get("/api/experiments").json()["experiments"]] == ["tiny"]
    assert client.get("/api/experiments/tiny").json()["finished"] == 4
