"""Damaged rows in a store someone else wrote (or a disk damaged) do not crash its readers: a
trial row that is not what tridens writes is named in one line and left out while the rest is
shown (``ls``, ``show``, ``top``, ``--json``), the dashboard serves it marked damaged beside the
others (never a 500), huge integers in a request are a 400, a driver pid of 2**70 is "unknown",
and a stage whose stored history is damaged counts as absent: it is trained again."""

import json
import logging
import sqlite3

import pytest

from tridens.dashboard import Server, create_app
from tridens.store import Store
from tridens.trial import Trial, TrialStatus

from .test_stores import make_store, tridens_here  # noqa: F401  (the fixture)

starlette_testclient = pytest.importorskip("starlette.testclient")

TRIAL_DAMAGES = {
    "sample not JSON": ("UPDATE trials SET sample = '{bad' WHERE id = 1", "the sample of trial 1 .*not valid JSON"),
    "sample a list": ("UPDATE trials SET sample = '[1, 2]' WHERE id = 1", "the sample of trial 1 .*a JSON list"),
    "unknown status": ("UPDATE trials SET status = 'weird' WHERE id = 1", "unknown status 'weird'"),
    "info a list": ("UPDATE trials SET info = '[1]' WHERE id = 1", "the info of trial 1 .*a JSON list"),
    "params text": ("UPDATE trials SET info = '{\"params\": \"x\", \"unit\": 3}' WHERE id = 1",
                    "the info of trial 1 .*params='x', not an int"),
}


def two_trials(db):
    """Experiment 'e' with trials 0 and 1 (store ids 1, 2), both completed with a checkpoint."""
    store = make_store(db, {})
    trial = store.add_trial("e", Trial(id=-1, sample={"w": 2}, seed=1))
    trial.status, trial.metric = TrialStatus.COMPLETED, 0.75
    store.finish_trial(trial)
    store.close()


def damage(db, sql):
    conn = sqlite3.connect(db)
    conn.execute(sql)
    conn.commit()
    conn.close()


@pytest.mark.parametrize("kind", list(TRIAL_DAMAGES))
def test_a_damaged_trial_row_is_named_and_left_out_by_every_command(tmp_path, kind, tridens_here):  # noqa: F811
    import re

    db = tmp_path / "runs.db"
    two_trials(db)
    sql, expected = TRIAL_DAMAGES[kind]
    damage(db, sql)
    for command in (["ls"], ["show", "e"], ["top", "e"], ["show", "e", "--json"], ["show", "e", "1"]):
        res = tridens_here(*command, "--db", db)
        assert res.returncode == 0, (command, res.stderr)
        assert res.stderr.count("\n") == 1 and re.search(expected, res.stderr), (command, res.stderr)
        assert "number 0 of 'e'" in res.stderr and str(db) in res.stderr
    shown = json.loads(tridens_here("show", "e", "--json", "--db", db).stdout)
    assert [(t["number"], t["sample"]) for t in shown] == [(1, {"w": 2})]   # the other keeps its number
    res = tridens_here("show", "e", "0", "--db", db)
    assert res.returncode == 1 and "trial 0 of experiment 'e' cannot be shown: its row in the store is damaged" in res.stderr


def test_a_driver_pid_of_2_70_is_unknown_not_an_overflow(tmp_path, tridens_here):  # noqa: F811
    import socket

    db = tmp_path / "runs.db"
    two_trials(db)
    for pid in (2**70, -1, 0, True):
        driver = json.dumps({"pid": pid, "host": socket.gethostname(), "start": None})
        damage(db, f"UPDATE experiments SET status = 'running', config = json_set(config, '$.driver', json('{driver}'))")
        for command in (["ls"], ["show", "e"], ["top", "e"], ["show", "e", "0"]):
            res = tridens_here(*command, "--db", db)
            assert res.returncode == 0 and res.stderr == "", (pid, command, res.stderr)


ENDPOINTS = ["", "/trials", "/trials/0", "/trials/1", "/trials/0/architecture", "/curves?ids=1,2", "/hparams",
             "/importance", "/pareto", "/plan", "/stages", "/oneshot"]


@pytest.mark.parametrize("kind", [*TRIAL_DAMAGES, "config a list", "config odd values"])
def test_the_dashboard_serves_a_damaged_row_as_damaged_and_the_rest_as_usual(tmp_path, kind):
    db = tmp_path / "runs.db"
    two_trials(db)
    with Store(db) as store:
        store.create_experiment("other", {})
    if kind == "config a list":
        damage(db, "UPDATE experiments SET config = '[1]' WHERE name = 'e'")
    elif kind == "config odd values":
        damage(db, "UPDATE experiments SET config = '{\"objective\": \"x\", \"strategy\": 5, \"evaluator\": [1], "
                   "\"space\": \"x\", \"max_trials\": \"x\", \"search_space\": 3}' WHERE name = 'e'")
    else:
        damage(db, TRIAL_DAMAGES[kind][0])
    client = starlette_testclient.TestClient(create_app(db), base_url="http://localhost")
    listing = client.get("/api/experiments")
    assert listing.status_code == 200, listing.text
    by_name = {e["name"]: e for e in listing.json()["experiments"]}
    assert set(by_name) == {"e", "other"} and by_name["other"]["damaged"] is None
    for path in ENDPOINTS:
        response = client.get("/api/experiments/e" + path)
        assert response.status_code in (200, 400), (path, response.status_code, response.text)
    if kind.startswith("config"):
        assert "config of experiment 'e'" in by_name["e"]["damaged"] or "objective" in by_name["e"]["damaged"]
        return
    rows = {r["number"]: r for r in client.get("/api/experiments/e/trials").json()["rows"]}
    assert rows[0]["damaged"] and "trial 0" in rows[0]["damaged"] and rows[1]["damaged"] is None
    assert rows[1]["sample"] == {"w": 2} and rows[1]["metric"] == 0.75


def test_huge_integers_in_a_request_are_a_400(tmp_path):
    db = tmp_path / "runs.db"
    two_trials(db)
    client = starlette_testclient.TestClient(create_app(db), base_url="http://localhost")
    huge = "9" * 25
    for path in (f"/trials?offset={huge}", f"/trials?limit={huge}", f"/trials/{huge}", f"/trials/-{huge}",
                 f"/curves?ids=1,{huge}", f"/trials/{huge}/architecture", "/trials?offset=" + "9" * 5000):
        response = client.get("/api/experiments/e" + path)
        assert response.status_code == 400 and "at most 2**53" in response.json()["error"], (path, response.text)
    assert client.get("/api/experiments/e/trials?offset=1&limit=-5").json()["rows"][0]["number"] == 1


def test_the_experiments_page_shows_a_damaged_experiment_and_the_others_in_chromium(tmp_path):
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver")
    if not shutil.which("chromium") or not shutil.which("chromedriver"):
        pytest.skip("Debian's chromium and chromium-driver are not installed (`make test` installs them)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    db = tmp_path / "runs.db"
    two_trials(db)
    with Store(db) as store:
        store.create_experiment("other", {})
    damage(db, "UPDATE experiments SET config = 'nope' WHERE name = 'other'")
    damage(db, TRIAL_DAMAGES["sample not JSON"][0])
    options = Options()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    browser.set_page_load_timeout(30)
    try:
        with Server(db, port=0) as server:
            browser.get(server.url + "/")
            WebDriverWait(browser, 30, poll_frequency=0.2).until(lambda d: d.execute_script(
                "return document.querySelector('#experiments-table tr[data-name=other]') !== null"))
            assert browser.find_element("css selector", "#experiments-table tr[data-name=other] .damaged").text == "damaged"
            assert "2/" not in browser.find_element("css selector", "#experiments-table tr[data-name=e]").text
            browser.get(server.url + "/experiments/e")
            WebDriverWait(browser, 30, poll_frequency=0.2).until(lambda d: d.execute_script(
                "return document.querySelectorAll('#trials-table tbody tr').length === 2"))
            damaged = browser.find_element("css selector", "#trials-table tbody tr[data-number='0'] .damaged").text
            assert damaged.startswith("damaged row: the sample of trial 0")
            assert "w=2" in browser.find_element("css selector", "#trials-table tbody tr[data-number='1']").text
    finally:
        browser.quit()


def test_a_stage_whose_stored_history_is_damaged_is_trained_again(tmp_path, caplog):
    import tridens as td

    from tests.xopt.test_stage_store import run

    data = td.datasets.digits()
    store = tmp_path / "studies.db"
    first = run(data, store, "first", [2], [0.1])
    damage(store, "UPDATE stages SET history = '{bad'")
    with caplog.at_level(logging.WARNING, logger="tridens"):
        second = run(data, store, "second", [2], [0.1])
    assert "its stored history is damaged" in caplog.text
    assert all(t.status is TrialStatus.COMPLETED for t in second.values())
    assert {k: t.metrics for k, t in second.items()} == {k: t.metrics for k, t in first.items()}
