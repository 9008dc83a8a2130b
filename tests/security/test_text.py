"""Text from data is text: labels, values, metric names, statuses, experiment names and errors are
never read as rich markup (``logs[/tmp]``, ``[/x]``, ``[link=...]``), never obeyed as terminal
escapes (OSC, CSI, bidirectional overrides), never parsed as matplotlib mathtext, on every path
that prints them: the tables of ls/show/top, one trial in full, the live view in a terminal, the
log lines when output is not a terminal, error lines and plot labels."""

import os
import pty
import select
import sqlite3
import subprocess
import sys

from tridens.store import Store
from tridens.trial import Trial, TrialStatus

from .test_stores import tridens_here  # noqa: F401  (fixture)

MARKUP = ["logs[/tmp]", "[/x]", "[link=http://evil.example]click[/link]", "[bold red]loud"]
ESCAPES = ["\x1b]0;title\x07", "\x1b]8;;http://evil.example\x1b\\hidden\x1b]8;;\x1b\\", "\x1b[2J", "\u202eevil", "\x9b31m"]
RAW = ["\x1b]", "\x07", "\x1b[2J", "\u202e", "\x9b"]  # none of these may reach the output


def _store_full_of_markup(db):
    with Store(db) as store:
        store.create_experiment("e", {"objective": {"metric": "[/x]acc", "mode": "max"},
                                          "strategy": {"type": "S", "repr": "S([link=http://evil.example]x)"}})
        for i, value in enumerate(MARKUP + ESCAPES):
            trial = store.add_trial("e", Trial(id=-1, sample={"path": value, f"[/x]{i}": i, "w\x1b[2J": 1},
                                                   seed=i, fingerprint="[/x]fp\x1b]0;t\x07"))
            store.add_metrics(trial.id, 0, {"[/x]acc": 0.1 * i, "[link=http://evil.example]m\x1b[2J": 1.0})
            trial.status, trial.metric = TrialStatus.COMPLETED, 0.1 * i
            if i == 1:
                trial.status, trial.error = TrialStatus.FAILED, "Traceback\nValueError: " + "".join(MARKUP + ESCAPES)
            store.finish_trial(trial)
    conn = sqlite3.connect(db)
    # a store someone else wrote: names tridens itself would refuse
    conn.execute("UPDATE experiments SET status = ?, name = ?", ("[/x]done\x1b]0;t\x07", "[/x]e\x1b]0;t\x07"))
    conn.commit()
    conn.close()


def test_tables_and_one_trial_print_stored_markup_and_escapes_as_text(tmp_path, tridens_here):  # noqa: F811
    db = tmp_path / "runs.db"
    _store_full_of_markup(db)
    name = "[/x]e\x1b]0;t\x07"
    for command in (["ls"], ["show", name], ["top", name, "-k", "20"], ["show", name, "1"], ["show", name, "0"]):
        res = tridens_here(*command, "--db", db)
        assert res.returncode == 0, (command, res.stderr)
        assert "[/x]" in res.stdout, (command, res.stdout)  # shown as written
        for raw in RAW:
            assert raw not in res.stdout, (command, raw, res.stdout)
    details = tridens_here("show", name, "1", "--db", db).stdout
    assert "[link=http://evil.example]click[/link]" in "".join(details.split()) and "\\x1b]0;title" in details


def test_plot_labels_are_not_mathtext(tmp_path, tridens_here):  # noqa: F811
    db = tmp_path / "runs.db"
    with Store(db) as store:
        store.create_experiment("e", {"objective": {"metric": "$\\frac{$", "mode": "max"}})
        for i in range(3):
            trial = store.add_trial("e", Trial(id=-1, sample={"$\\sqrt{$": f"$x{i}", "n": i}, seed=i))
            store.add_metrics(trial.id, 0, {"$\\frac{$": 0.5 + i})
            trial.status, trial.metric = TrialStatus.COMPLETED, 0.5 + i
            store.finish_trial(trial)
    res = tridens_here("plot", "e", "--to", tmp_path / "curves.png", "--db", db)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "curves.png").stat().st_size > 1000


SCRIPT = """
import tridens as td

def train(path):
    if path == "fail":
        raise ValueError({escapes!r} + "[/x]")
    td.report({{"[/x]acc": float(len(path))}}, step=0)

if __name__ == "__main__":
    values = {markup!r} + ["fail"]
    evaluator = td.evaluators.FunctionalEvaluator(train, path=td.choice("path[/x]", values))
    td.Experiment(None, evaluator, "grid", max_trials=len(values), name="run", objective="[/x]acc",
                  store={store!r}).run()
"""


def _script(tmp_path):
    script = tmp_path / "search.py"
    script.write_text(SCRIPT.format(escapes="".join(ESCAPES), markup=MARKUP, store=str(tmp_path / "runs.db")))
    return script


def test_the_live_view_in_a_terminal_prints_markup_as_text(tmp_path):
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "200", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, str(_script(tmp_path))], stdin=slave, stdout=slave, stderr=slave,
                            env=env, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 300)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    code = proc.wait(timeout=60)
    os.close(master)
    out = b"".join(chunks).decode("utf-8", "replace")
    assert code == 0 and "MarkupError" not in out, out[-3000:]
    assert "stopped" in out and "[/x]" in out, out[-3000:]
    for raw in ("\x1b]0;", "\x1b]8;", "\u202e", "\x9b"):
        assert raw not in out, (raw, out[-3000:])
    with Store(tmp_path / "runs.db") as store:
        assert sorted(t.status.value for t in store.trials("run")) == ["completed"] * 4 + ["failed"]


def test_the_log_lines_off_a_terminal_print_errors_as_text(tmp_path):
    res = subprocess.run([sys.executable, str(_script(tmp_path))], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "failed: ValueError" in res.stderr and "[/x]" in res.stderr, res.stderr
    for raw in RAW:
        assert raw not in res.stderr, (raw, res.stderr)
