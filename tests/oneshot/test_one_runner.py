"""A one-shot experiment runs in one process at a time, as a multi-trial one does: a second
process running the same name on the same store is refused with one line naming the first."""

import sys
from pathlib import Path

from tests.runner_lock import assert_second_runner_refused

SCRIPT = Path(__file__).with_name("resume_script.py")


def test_a_second_runner_of_a_one_shot_experiment_is_refused(tmp_path):
    db = tmp_path / "oneshot.db"
    assert_second_runner_refused([sys.executable, str(SCRIPT), str(db), "50"],
                                 [sys.executable, "-m", "tridens.cli", "run", str(SCRIPT), str(db), "50"], db, "resume")
