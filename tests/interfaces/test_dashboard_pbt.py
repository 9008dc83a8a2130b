"""A PBT member's lineage on the dashboard's trial page, in headless chromium: whose state it
copied at which epoch, linked to that trial's page."""

import tridens as td

from ..strategy.pbt_script import MLP, evaluator
from .test_dashboard_browser import _wait, browser  # noqa: F401  (the chromium fixture)


def test_trial_page_shows_exploits(browser, tmp_path):  # noqa: F811
    from tridens.dashboard import Server

    db = tmp_path / "pbt.db"
    exp = td.Experiment(MLP(), evaluator(), td.strategy.PBT(population=4, interval=2), budget=4, store=db, name="pbt",
                        options=td.RunOptions(verbose=False))
    exp.run()
    member = next(t for t in exp.trials() if t.info.get("exploits"))
    first = member.info["exploits"][0]
    with Server(db, port=0) as server:
        browser.get(f"{server.url}/experiments/pbt/trials/{member.number}")
        _wait(browser, lambda d: "copied" in d.find_element("id", "trial-facts").text)
        text = browser.find_element("id", "trial-facts").text
        assert f"epoch {first['epoch']}: copied #{first['from_number']}" in text
        link = browser.find_element("link text", f"#{first['from_number']}")
        assert link.get_attribute("href").endswith(f"/experiments/pbt/trials/{first['from_number']}")
