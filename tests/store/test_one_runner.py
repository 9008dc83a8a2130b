"""One experiment name runs in one process at a time: a second runner on the same store is
refused with one line naming the first (pid, host), and a killed runner blocks nobody."""

import sys
from pathlib import Path

from tests.runner_lock import assert_second_runner_refused

SCRIPT = Path(__file__).parents[1] / "cli" / "search_script.py"
TRIDENS = [sys.executable, "-m", "tridens.cli"]


def test_a_second_runner_of_the_same_experiment_is_refused(tmp_path):
    db = tmp_path / "runs.db"
    assert_second_runner_refused([*TRIDENS, "run", str(SCRIPT), "--db", str(db), "1.0"],
                                 [*TRIDENS, "run", str(SCRIPT), "--db", str(db), "0"], db, "cli-search")
