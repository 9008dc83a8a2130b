"""The dashboard in a real headless browser (Debian's chromium through Selenium): the pages load,
the table shows a real experiment's trials, a learning curve draws, and a trial written by a
running experiment appears without a reload. Screenshots of each page go to the test's tmp dir."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tridens.dashboard import Server

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
        _wait(browser, lambda d: d.execute_script(
            "const p = document.getElementById('parcoords'); return p.data && p.data[0].type === 'parcoords'"))
        browser.save_screenshot(str(shots / "experiment.png"))

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

        browser.get(server.url + "/experiments/tiny/trials/4")
        _wait(browser, lambda d: len(d.find_elements("css selector", "#trial-metrics tr")) == 4
              and d.find_elements("id", "graph-text"))
        assert "Linear" in browser.find_element("id", "graph-text").text
        assert "completed" in browser.find_element("id", "trial-facts").text
        browser.save_screenshot(str(shots / "trial.png"))
    for name in ("experiments", "experiment", "experiment-new-trial", "trial"):
        assert (shots / f"{name}.png").stat().st_size > 10_000
    print(f"screenshots in {shots}")
