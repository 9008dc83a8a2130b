"""A search killed and resumed explores the same samples, in the same order, as the same search
run without interruption: proposal k of a strategy draws from its k-th random stream, and a
resumed strategy continues at the number of trials the experiment holds."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tridens.store import Store
from tridens.trial import TrialStatus

SCRIPT = Path(__file__).parent / "resume_sequence_script.py"


def _samples(db):
    with Store(db, readonly=True) as store:
        return [t.sample for t in store.trials("sequence")]


def test_a_killed_random_search_resumes_to_the_uninterrupted_sequence(tmp_path):
    whole = tmp_path / "whole.db"
    subprocess.run([sys.executable, str(SCRIPT), str(whole), "0"], check=True, timeout=300)

    killed = tmp_path / "killed.db"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(killed), "0.3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, done = time.time() + 240, 0
    while time.time() < deadline and done < 6:  # inside the second group of 4
        time.sleep(0.1)
        try:
            with Store(killed, readonly=True) as store:
                done = sum(t.status is TrialStatus.COMPLETED for t in store.trials("sequence"))
        except Exception:  # the store is being created
            continue
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 6 <= done < 16, done
    subprocess.run([sys.executable, str(SCRIPT), str(killed), "0"], check=True, timeout=300)

    expected = _samples(whole)
    assert len(expected) == 16
    assert _samples(killed) == expected
