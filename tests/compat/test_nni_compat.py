import ast
import subprocess
import sys
from pathlib import Path

from tridens.store import Store
from tridens.trial import TrialStatus

SCRIPT = Path(__file__).parent / "hello_nas_nni3.py"


def test_hello_nas_runs_with_only_imports_and_data_changed(tmp_path):
    db = tmp_path / "nni.db"
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=tmp_path, timeout=600,
                         env={"TRIDENS_DB": str(db), "PATH": "/usr/bin:/bin", "TRIDENS_DECISION_CACHE": "off"})
    assert res.returncode == 0, res.stderr[-3000:]
    last = res.stdout.strip().splitlines()[-1]
    top = ast.literal_eval(last)
    assert set(top) == {"conv2", "dropout", "feature"} and top["conv2"] in (0, 1)
    assert "Test set: Accuracy" in res.stdout
    with Store(db, readonly=True) as store:
        [record] = store.experiments()
        trials = store.trials(record.name)
    assert len([t for t in trials if t.status is TrialStatus.COMPLETED]) == 3
    for t in trials:
        values = next(iter(t.metrics.values()))
        assert len(values) == 3  # the three intermediate results
        assert t.metric == values[-1] and t.metric > 25  # percent accuracy, as NNI's tutorial reports it


def test_only_import_and_data_lines_differ_from_the_tutorial():
    changed = [line for line in SCRIPT.read_text().splitlines() if "tridens" in line]
    assert all("# changed" in line for line in changed if not line.startswith('"""') and "run on tridens" not in line)
