"""The dashboard in a real headless browser (Debian's chromium through Selenium): the pages load,
the table shows a real experiment's trials, a learning curve draws, and a trial written by a
running experiment appears without a reload; the plan, the stage tree, stopped and promoted
curves and a one-shot run drawn from real searches. Screenshots of each page and view go to the
test's tmp dir (``screenshots/``; the path is printed)."""

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tridens.dashboard import Server
from tridens.store import Store

from .test_dashboard_api import big_store  # noqa: F401  (10,000 trials written through the store's API)

webdriver = pytest.importorskip("selenium.webdriver")

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
HERE = Path(__file__).parent


@pytest.fixture
def browser():
    if not CHROMIUM or not DRIVER:
        pytest.skip("Debian's chromium and chromium-driver are not installed (`make test` installs them)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,2600",
                "--use-angle=swiftshader", "--enable-unsafe-swiftshader"):  # WebGL (parallel coordinates) in software
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _wait(driver, condition, timeout=30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(condition)


def _rows(driver):
    return driver.execute_script("return [...document.querySelectorAll('#trials-table tbody tr')]"
                                 ".map(r => [r.dataset.number, r.children[2].textContent, r.children[10].textContent])")


def test_dashboard_pages_in_chromium(browser, tiny_copy, tmp_path):
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with Server(tiny_copy, port=0) as server:
        browser.get(server.url + "/")
        _wait(browser, lambda d: d.execute_script(
            "return document.querySelector('#experiments-table tr[data-name=tiny]') !== null"
            " && document.getElementById('best-over-time').data !== undefined"))
        assert "4/4" in browser.find_element("css selector", "#experiments-table tr[data-name=tiny]").text
        browser.save_screenshot(str(shots / "experiments.png"))

        browser.find_element("link text", "tiny").click()
        _wait(browser, lambda d: len(_rows(d)) == 4)
        rows = _rows(browser)
        assert [r[0] for r in rows] == ["0", "1", "2", "3"] and all(r[1] == "completed" for r in rows)
        assert all("hidden=" in r[2] and "lr=" in r[2] for r in rows)
        # the default curves: the best trials' objective per epoch, drawn by Plotly
        _wait(browser, lambda d: d.execute_script(
            "const c = document.getElementById('curves'); return c.data && c.data.length === 4"
            " && c.querySelectorAll('.scatterlayer .trace').length === 4"))
        browser.find_element("css selector", "#trials-table tbody tr[data-number='2'] input.select-trial").click()
        _wait(browser, lambda d: d.execute_script(
            "return document.getElementById('curves').data.map(t => t.name).join()") == "#2 (completed)")
        points = browser.execute_script("return document.getElementById('curves').data[0].y.length")
        assert points == 3  # three epochs
        # any recorded metric: the training loss of the same trial
        with Store(tiny_copy, readonly=True) as store:
            losses = sorted(store.trials("tiny"), key=lambda t: t.id)[2].metrics["train_loss"]
        from selenium.webdriver.support.ui import Select
        Select(browser.find_element("id", "metric-select")).select_by_value("train_loss")
        _wait(browser, lambda d: d.execute_script("return document.getElementById('curves').data[0].y") == losses)
        Select(browser.find_element("id", "metric-select")).select_by_value("val_acc")
        _wait(browser, lambda d: d.execute_script(
            "const p = document.getElementById('parcoords'); return p.data && p.data[0].type === 'parcoords'"))
        browser.save_screenshot(str(shots / "experiment.png"))
        _wait(browser, lambda d: d.execute_script(
            "return document.querySelectorAll('#scatters .scatter .scatterlayer .trace').length === 2"))
        _section_shot(browser, "hyperparameters", shots / "experiment-hyperparameters.png")

        # a running experiment adds a trial: it appears without a reload
        browser.execute_script("window.notReloaded = true")
        run = subprocess.Popen([sys.executable, str(HERE / "tiny_search.py"), str(tiny_copy), "5"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            _wait(browser, lambda d: len(_rows(d)) == 5, timeout=120)  # the row appears once the run writes it
        finally:
            output = run.communicate(timeout=300)[0]
        assert run.returncode == 0, output
        _wait(browser, lambda d: _rows(d)[4][1] == "completed")
        assert browser.execute_script("return window.notReloaded === true")
        assert browser.find_element("id", "total").text == "5"
        browser.save_screenshot(str(shots / "experiment-new-trial.png"))

        # sorting and filtering in the page: by the objective, by status, by a label's value
        with Store(tiny_copy, readonly=True) as store:
            trials = sorted(store.trials("tiny"), key=lambda t: t.id)
        browser.find_element("css selector", "#trials-table th[data-sort=metric]").click()
        # best first; ties (trials stuck at one class score alike) latest first, as the server orders them
        best_first = [str(i) for i, _ in sorted(enumerate(trials), key=lambda p: (-p[1].metric, -p[1].id))]
        _wait(browser, lambda d: [r[0] for r in _rows(d)] == best_first)
        browser.find_element("css selector", "#status-filter input[value=stopped]").click()
        _wait(browser, lambda d: _rows(d) == [] and d.find_element("id", "total").text == "0")
        browser.find_element("css selector", "#status-filter input[value=stopped]").click()
        hidden = trials[0].sample["hidden"]
        Select(browser.find_element("id", "label-filter-label")).select_by_value("hidden")
        browser.find_element("id", "label-filter-value").send_keys(str(hidden))
        browser.find_element("xpath", "//button[text()='add filter']").click()
        wanted = sorted((str(i) for i, t in enumerate(trials) if t.sample["hidden"] == hidden),
                        key=lambda n: (-trials[int(n)].metric, -int(n)))
        _wait(browser, lambda d: [r[0] for r in _rows(d)] == wanted)
        assert all(f"hidden={hidden}," in r[2] for r in _rows(browser))

        browser.get(server.url + "/experiments/tiny/trials/4")
        _wait(browser, lambda d: len(d.find_elements("css selector", "#trial-metrics tr")) == 4
              and d.find_elements("id", "graph-text"))
        assert "Linear" in browser.find_element("id", "graph-text").text
        assert "completed" in browser.find_element("id", "trial-facts").text
        browser.save_screenshot(str(shots / "trial.png"))
    for name in ("experiments", "experiment", "experiment-hyperparameters", "experiment-new-trial", "trial"):
        assert (shots / f"{name}.png").stat().st_size > 10_000
    print(f"screenshots in {shots}")


def _section_shot(driver, section_id, path):
    """A screenshot of one section of the page (scrolled into view)."""
    element = driver.find_element("id", section_id)
    driver.execute_script("arguments[0].scrollIntoView()", element)
    element.screenshot(str(path))
    assert path.stat().st_size > 5_000


def test_plan_stage_tree_and_promoted_curves_in_chromium(browser, views_store, tmp_path):
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with Server(views_store, port=0) as server:
        browser.get(server.url + "/")
        _wait(browser, lambda d: len(d.find_elements("css selector", "#experiments-table tbody tr")) == 4)
        browser.save_screenshot(str(shots / "experiments.png"))

        browser.get(server.url + "/experiments/stages")
        _wait(browser, lambda d: d.find_elements("css selector", "#plan-units tr[data-kind='stage tree']")
              and d.find_elements("css selector", "#stage-tree li"))
        unit = browser.find_element("css selector", "#plan-units tr[data-kind='stage tree']").text
        assert "#0 #1 #2 #3 #4 #5 #6 #7" in unit and "/ 20" in unit  # the tree's epochs against 20 trial-epochs alone
        cells = browser.find_elements("css selector", "#plan-units tr[data-kind='stage tree'] td")
        assert float(cells[-1].text) > 0  # the seconds it saved, estimated
        assert "saved by the plan (estimate): " in browser.find_element("id", "plan-totals").text
        stages = browser.execute_script("return [...document.querySelectorAll('#stage-tree li')].map(li => li.dataset.stage)")
        nested = browser.execute_script("return document.querySelectorAll('#stage-tree li li').length")
        assert len(stages) == 8 and nested == 7  # one root stage, the others forked below it
        # each trial under the stages its own path went through: every trial at the root, and at
        # each epoch exactly once
        trials_at = browser.execute_script(
            "return [...document.querySelectorAll('#stage-tree li')].map(li => li.firstElementChild.textContent"
            " + '|' + li.childNodes[1].textContent)")
        for epochs in ("epochs 0–1", "epochs 1–2", "epochs 2–3"):
            listed = [n for line in trials_at if epochs in line for n in re.findall(r"#(\d)", line.split("|")[1])]
            assert sorted(listed) == sorted(set(listed)), (epochs, trials_at)
        assert sorted(re.findall(r"#(\d)", trials_at[0].split("|")[1])) == [str(i) for i in range(8)]
        with Store(views_store, readonly=True) as store:
            three = sorted(i for i, t in enumerate(sorted(store.trials("stages"), key=lambda t: t.id))
                           if t.sample["epochs"] == 3)
        last = [n for line in trials_at if "epochs 2–3" in line for n in re.findall(r"#(\d)", line.split("|")[1])]
        assert sorted(int(n) for n in last) == three  # only the 3-epoch trials trained a third epoch
        assert "8 stages · 8 epoch(s) trained here" in browser.find_element("id", "stage-totals").text
        _section_shot(browser, "plan-section", shots / "plan.png")
        _section_shot(browser, "stages-section", shots / "stage-tree.png")

        # one trial of the tree: the stages it went through, the unit it trained in
        browser.get(server.url + "/experiments/stages/trials/7")
        _wait(browser, lambda d: d.find_elements("id", "trial-stages"))
        path = browser.find_element("id", "trial-stages").text
        assert path == "1.0 · epochs 0–1 · lr 0.05 → 1.2 · epochs 1–2 · lr 0.05 → 1.3 · epochs 2–3 · lr 0.025", path
        unit = browser.find_element("id", "trial-unit").text
        assert unit.startswith("stage tree unit with #0 #1 #2 #3 #4 #5 #6 #7"), unit
        browser.save_screenshot(str(shots / "trial-of-a-stage-tree.png"))

        browser.get(server.url + "/experiments/asha")
        _wait(browser, lambda d: d.execute_script(
            "const c = document.getElementById('curves'); return c.data && c.data.length === 5"))
        traces = browser.execute_script(
            "return document.getElementById('curves').data.map(t => [t.name, t.line.dash, t.marker.symbol])")
        stopped = [t for t in traces if "(stopped" in t[0]]
        promoted = [t for t in traces if "promoted at step 0" in t[0]]
        assert stopped and all(t[1] == "dash" and t[2][-1] == "x" for t in stopped)
        assert promoted and all(t[1] == "solid" and t[2][0] == "triangle-up" for t in promoted)
        _section_shot(browser, "learning-curves", shots / "curves-stopped-promoted.png")
        # the six trials of ASHA's group trained in pairs on one data pipeline, each pair fused or
        # not on the speed-up measured on its first real steps
        _wait(browser, lambda d: d.find_elements("css selector", "#plan-units tr[data-kind=cse]"))
        cells = browser.find_elements("css selector", "#plan-units tr[data-kind=cse] td")
        assert re.fullmatch(r"(\d+\.\d\dx (fused|separate) \(#\d #\d\)(; )?){3}", cells[4].text), cells[4].text
        assert float(cells[-1].text) >= 0  # training seconds saved: measured speed-up less one, times seconds
        _section_shot(browser, "plan-section", shots / "plan-fused.png")

        browser.get(server.url + "/experiments/oneshot")
        _wait(browser, lambda d: d.find_elements("css selector", "#subnets tr")
              and d.execute_script("const p = document.getElementById('supernet-curves'); return p && p.data && p.data.length > 0"))
        subnets = browser.find_elements("css selector", "#subnets tr")
        assert len(subnets) == 6  # the header, the 4 scored subnets and the best one retrained
        assert all("hidden=" in r.text and "act=" in r.text for r in subnets[1:])
        assert [r.find_element("tag name", "a").text for r in subnets[1:]] == ["#1", "#2", "#3", "#4", "#5"]
        assert browser.execute_script("return document.getElementById('supernet-curves').data[0].y.length") == 3
        _section_shot(browser, "oneshot-section", shots / "oneshot.png")
    for name in ("experiments", "plan", "stage-tree", "trial-of-a-stage-tree", "curves-stopped-promoted", "plan-fused",
                 "oneshot"):
        assert (shots / f"{name}.png").stat().st_size > 5_000
    print(f"screenshots in {shots}")


_BROKEN_WORDS = """
const broken = [];
for (const td of document.querySelectorAll(arguments[0])) {
  const walker = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
  let node;
  while ((node = walker.nextNode())) {
    const re = /[^\\s-]+/g;  // words; a hyphen is a place to wrap
    let m;
    while ((m = re.exec(node.textContent))) {
      if (m[0].length > 24) continue;  // a token longer than a column may wrap where it must
      const r = document.createRange();
      r.setStart(node, m.index);
      r.setEnd(node, m.index + m[0].length);
      if (new Set([...r.getClientRects()].map(x => Math.round(x.top))).size > 1) broken.push(m[0]);
    }
  }
}
return broken;
"""


def test_log_axes_many_curves_and_one_shot_roles_in_chromium(browser, views_store, tmp_path):
    """A log-uniform label on log axes (objective vs label, parallel coordinates); 40 ticked
    curves all in a legend that scrolls; a one-shot run's roles in the trial table, the subnets and
    the relations (as sentences, not JSON); the plan's "why" text never broken inside a word."""
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with Server(views_store, port=0) as server:
        browser.get(server.url + "/experiments/logscale")
        _wait(browser, lambda d: len(_rows(d)) == 40 and d.execute_script(
            "const s = document.querySelector('#scatters .scatter[data-label=lr]');"
            " const p = document.getElementById('parcoords'); return s && s.layout && p.data && p.data.length === 1"))
        assert browser.execute_script(
            "return document.querySelector('#scatters .scatter[data-label=lr]').layout.xaxis.type") == "log"
        assert browser.execute_script(
            "return document.querySelector('#scatters .scatter[data-label=hidden]').layout.xaxis.type") != "log"
        with Store(views_store, readonly=True) as store:
            lrs = [t.sample["lr"] for t in store.trials("logscale")]
        dim = browser.execute_script("return document.getElementById('parcoords').data[0].dimensions"
                                     ".find(d => d.label.startsWith('lr'))")
        assert dim["label"] == "lr (log)" and dim["values"] == pytest.approx([math.log10(v) for v in lrs])
        assert dim["ticktext"][0] == "0.001" and dim["ticktext"][-1] == "1"
        _section_shot(browser, "hyperparameters", shots / "log-axes.png")
        browser.execute_script("document.querySelectorAll('#trials-table input.select-trial').forEach(b => b.click())")
        _wait(browser, lambda d: d.execute_script(
            "const c = document.getElementById('curves'); return c.data && c.data.length === 40"
            " && c.querySelectorAll('.legend .traces').length === 40"))
        legend = browser.execute_script(
            "const c = document.getElementById('curves'); const l = c.querySelector('.legend .bg').getBoundingClientRect();"
            " const p = c.getBoundingClientRect(); return [l.top >= p.top - 1, l.bottom <= p.bottom + 1,"
            " c.querySelector('.legend .scrollbar') !== null, c.layout.legend.orientation]")
        assert legend == [True, True, True, "v"], legend  # inside the plot, scrolling through all 40
        _section_shot(browser, "learning-curves", shots / "forty-curves.png")

        browser.get(server.url + "/experiments/oneshot")
        _wait(browser, lambda d: d.find_elements("css selector", "#subnets tr[data-role=retrained]")
              and d.find_elements("css selector", "#plan-relations tr") and len(_rows(d)) == 6)
        roles = browser.execute_script("return [...document.querySelectorAll('#trials-table tbody td.role')]"
                                       ".map(td => td.textContent)")
        assert roles == ["supernet"] + ["supernet-scored"] * 4 + ["retrained"]
        retrained = browser.find_element("css selector", "#subnets tr[data-role=retrained]").text
        assert "retrained from scratch (the architecture of #" in retrained
        scored = browser.find_elements("css selector", "#subnets tr[data-role=supernet-scored]")
        assert len(scored) == 4 and all("weights inherited from the supernet #0" in r.text for r in scored)
        relations = browser.find_element("id", "plan-relations").text
        assert "{" not in relations and "supernet-scored" in relations and "retrained" in relations
        _section_shot(browser, "oneshot-section", shots / "oneshot-roles.png")

        browser.set_window_size(1100, 2600)  # the width at which "pipeline" was broken as "pipelin e"
        for name in ("stages", "asha"):
            browser.get(server.url + f"/experiments/{name}")
            _wait(browser, lambda d: d.find_elements("css selector", "#plan-units td.sample"))
            assert browser.execute_script(_BROKEN_WORDS, "#plan-units td.sample, #plan-relations td.sample") == []
    print(f"screenshots in {shots}")


@pytest.mark.slow  # ~15 s; the default run covers 10,000 trials through the API (test_dashboard_api)
def test_ten_thousand_trials_page_by_page(browser, big_store, tmp_path):  # noqa: F811
    """An experiment of 10,000 trials: the page shows its first 50, pages on, sorts on the server,
    and draws the default curves and the hyperparameter views."""
    with Server(big_store, port=0) as server:
        browser.get(server.url + "/experiments/big")
        _wait(browser, lambda d: len(_rows(d)) == 50 and d.find_element("id", "total").text == "10000")
        assert [r[0] for r in _rows(browser)] == [str(i) for i in range(50)]
        browser.find_element("xpath", "//button[text()='next ▶']").click()
        _wait(browser, lambda d: [r[0] for r in _rows(d)] == [str(i) for i in range(50, 100)])
        browser.find_element("css selector", "#trials-table th[data-sort=metric]").click()
        _wait(browser, lambda d: _rows(d) and _rows(d)[0][1] in ("completed", "stopped")
              and d.find_element("css selector", "#trials-table th[data-sort=metric]").text.endswith("▼"))
        values = browser.execute_script(
            "return [...document.querySelectorAll('#trials-table tbody tr')].map(r => parseFloat(r.children[3].textContent))")
        assert values == sorted(values, reverse=True) and len(values) == 50
        _wait(browser, lambda d: d.execute_script(
            "const c = document.getElementById('curves'); const p = document.getElementById('parcoords');"
            " return c.data && c.data.length === 5 && p.data && p.data[0].dimensions[0].values.length === 8000"), timeout=60)
        shots = tmp_path / "screenshots"
        shots.mkdir()
        browser.save_screenshot(str(shots / "experiment-10000-trials.png"))
        print(f"screenshots in {shots}")
