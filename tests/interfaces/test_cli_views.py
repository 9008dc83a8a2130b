"""The terminal views on a real small experiment: one trial in full, --json and --csv, full samples
when the output is not a terminal, a help line on every option, and `tridens plot`."""

import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

from tridens.cli import _parser, main
from tridens.store import Store
from tridens.trial import Trial, TrialStatus

from . import tiny_search


def _trials(db):
    with Store(db, readonly=True) as store:
        return sorted(store.trials("tiny"), key=lambda t: t.id)


def test_show_one_trial_in_full(tiny_store, capsys):
    trial = _trials(tiny_store)[1]
    assert main(["show", "tiny", "1", "--db", str(tiny_store)]) == 0
    out = capsys.readouterr().out
    assert "trial #1 of tiny" in out and trial.fingerprint in out and str(trial.seed) in out
    assert f"{trial.sample['hidden']}" in out and "metrics per step" in out
    assert trial.checkpoint in "".join(out.split())  # folded over lines when long, never cut
    assert any(c in out for c in "▁▂▃▄▅▆▇█")  # the sparkline of each metric
    assert f"{trial.metrics['val_acc'][2]:.4f}" in out
    # what it trained with: the planner's unit, the other trials by number
    assert re.search(r"execution unit +[a-z ]+ unit (with #\d|\(alone\))", out), out


def test_show_and_top_as_json_and_csv(tiny_store, capsys):
    trials = _trials(tiny_store)
    assert main(["show", "tiny", "2", "--json", "--db", str(tiny_store)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["number"] == 2 and record["id"] == trials[2].id and record["metrics"] == trials[2].metrics
    assert record["sample"] == trials[2].sample and record["checkpoint"] == trials[2].checkpoint

    assert main(["show", "tiny", "2", "--csv", "--db", str(tiny_store)]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0][0] == "step" and sorted(rows[0][1:]) == sorted(trials[2].metrics)
    assert len(rows) == 4 and float(rows[3][rows[0].index("val_acc")]) == trials[2].metrics["val_acc"][2]

    assert main(["top", "tiny", "-k", "2", "--json", "--db", str(tiny_store)]) == 0
    top = json.loads(capsys.readouterr().out)
    ranked = sorted(trials, key=lambda t: (-t.metric, t.id))
    assert [t["id"] for t in top] == [t.id for t in ranked[:2]]

    assert main(["show", "tiny", "--csv", "--db", str(tiny_store)]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [int(r["number"]) for r in table] == [0, 1, 2, 3]
    assert [json.loads(r["hidden"]) for r in table] == [t.sample["hidden"] for t in trials]

    assert main(["show", "tiny", "9", "--db", str(tiny_store)]) == 1
    assert "has no trial 9 (its trials are numbered 0 to 3)" in capsys.readouterr().err


def test_failed_trial_shows_its_traceback_and_long_samples_are_not_cut(tiny_copy):
    long_sample = {f"block{i}.op": "conv3x3_with_a_long_name" for i in range(8)}
    error = "Traceback (most recent call last):\n  File \"train.py\", line 3, in step\nRuntimeError: shapes do not match"
    with Store(tiny_copy) as store:
        store.add_trial("tiny", Trial(id=-1, sample=long_sample, seed=1, status=TrialStatus.FAILED, error=error))
        store.add_trial("tiny", Trial(id=-1, sample=long_sample, seed=2, status=TrialStatus.COMPLETED, metric=0.99,
                                      metrics={"val_acc": [0.99]}))  # the best: first in top
    command = [sys.executable, "-m", "tridens.cli"]
    shown = subprocess.run([*command, "show", "tiny", "4", "--db", str(tiny_copy)], capture_output=True, text=True)
    assert shown.returncode == 0 and 'File "train.py", line 3' in shown.stdout and "RuntimeError" in shown.stdout
    for view in (["show", "tiny"], ["top", "tiny", "-k", "3"]):  # stdout a pipe, not a terminal
        table = subprocess.run([*command, *view, "--db", str(tiny_copy)], capture_output=True, text=True).stdout
        flat = re.sub(r"[\s│┃]", "", table)  # a table wraps long cells over lines; nothing may be cut
        assert "…" not in table and "block7.op=" in flat, view
        assert all(f"block{i}.op='conv3x3_with_a_long_name'" in flat for i in range(8)), view


def test_every_option_has_a_help_line():
    """Every subcommand, every option and argument of each (walked through argparse, nested
    subcommands too) has a help line, and `tridens CMD --help` prints each of them."""
    import argparse

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {choice.dest: choice.help for choice in action._choices_actions}
                for name, sub in action.choices.items():
                    assert helped.get(name), f"{path} {name}: the subcommand has no help line"
                    yield from walk(sub, f"{path} {name}")
            elif action.dest != "help":
                yield path, action

    actions = list(walk(_parser(), "tridens"))
    commands = {path for path, _ in actions}
    assert {"tridens run", "tridens ls", "tridens show", "tridens top", "tridens export", "tridens resume",
            "tridens dashboard", "tridens plot", "tridens export-optuna"} <= commands
    for path, action in actions:
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{path}: {name} has no help line"
    for command in sorted(commands - {"tridens"}):
        text = _help_text(command.split()[1:])
        for path, action in actions:
            if path == command and action.option_strings:
                assert action.option_strings[-1] in text, f"{command} --help does not list {action.option_strings}"


def _help_text(argv):
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*argv, "--help"])
        except SystemExit as stop:
            assert stop.code == 0
    return out.getvalue()


def test_plot_writes_an_image(tiny_store, tmp_path, capsys):
    import matplotlib.image

    target = tmp_path / "curves.png"
    assert main(["plot", "tiny", "--to", str(target), "--db", str(tiny_store)]) == 0
    image = matplotlib.image.imread(target)
    assert image.shape[0] > 200 and image.shape[1] > 600  # curves and one panel per label side by side
    assert image.std() > 0.01  # not blank


def test_live_view_at_80_columns(monkeypatch):
    import io

    from rich.console import Console

    from tridens.engine._progress import Progress
    from tridens.trial import Objective

    monkeypatch.setenv("FORCE_COLOR", "1")  # rich: a terminal
    monkeypatch.setenv("COLUMNS", "80")
    progress = Progress(16, Objective("val_acc", "max"))
    progress.start("regularized-evolution-search", 0, False)
    try:
        sample = {"width": 32, "op": "conv3x3", "depth": 2, "lr": 0.0123, "block1.kernel": 5, "block2.kernel": 3}
        for i in range(3):
            trial = Trial(i, dict(sample), 0, TrialStatus.RUNNING, fingerprint="abcdef123456", info={"params": 12345})
            progress.step(trial, 2, 0.5 + i / 10)
            trial.status, trial.metric, trial.metrics = TrialStatus.COMPLETED, 0.5 + i / 10, {"val_acc": [0.5 + i / 10]}
            progress.trial_done(trial)
        out = io.StringIO()
        Console(file=out, width=80, force_terminal=True, color_system=None).print(progress._render())
    finally:
        progress.close()
    lines = out.getvalue().splitlines()
    assert "━" in lines[0] and "3/16" in lines[0]  # the bar keeps its width beside the name
    text = "\n".join(lines)
    assert "…" not in text and all(len(line) <= 80 for line in lines)
    for label in ("block1.kernel=5", "block2.kernel=3", "op='conv3x3'"):
        assert label in text  # samples wrap between labels, not inside one


def test_dashboard_command_serves_the_store_until_ctrl_c(tiny_store):
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tridens.cli", "dashboard", "--db", str(tiny_store), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/experiments", timeout=5) as response:
                    body = json.load(response)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.2)
        assert [e["name"] for e in body["experiments"]] == ["tiny"]
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert f"on http://127.0.0.1:{port}" in out and "Traceback" not in err


def test_top_into_a_closed_pipe_ends_quietly(tiny_store):
    """`tridens top --json | head`: the reader closed its end before tridens wrote; tridens stops
    without a traceback or an error line (as Unix tools do) and exits with SIGPIPE's status."""
    proc = subprocess.Popen([sys.executable, "-m", "tridens.cli", "top", "tiny", "-k", "4", "--json", "--db",
                             str(tiny_store)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command has imported anything, let alone written
    _, err = proc.communicate(timeout=120)
    assert err.decode() == ""
    assert proc.returncode == 141


def test_trials_are_named_by_number_everywhere_a_user_reads_them(tmp_path, capsys):
    """In a store whose second experiment's trials have store ids 4.. and numbers 0..: the plan a
    trial records (``info.unit`` in ``show --json``: its trials, groups and the why text), the
    ``tridens show`` text and the checkpoint files all name trials by number."""
    db = tmp_path / "tridens.db"
    tiny_search.experiment(db, 3, epochs=1, name="first").run()
    tiny_search.experiment(db, 4, epochs=1, name="second").run()
    assert main(["show", "second", "--json", "--db", str(db)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [t["number"] for t in shown] == [0, 1, 2, 3] and [t["id"] for t in shown] == [4, 5, 6, 7]
    for trial in shown:
        unit = trial["info"]["unit"]
        assert trial["number"] in unit["trials"] and set(unit["trials"]) <= {0, 1, 2, 3}
        assert unit["ids"] == [t + 4 for t in unit["trials"]]
        assert all(set(g) <= {0, 1, 2, 3} for g in unit["groups"])
        named = [int(n) for group in re.findall(r"trials? \[([0-9, ]+)\]", unit["reason"] + unit["text"])
                 for n in group.split(",")]
        assert named and set(named) <= {0, 1, 2, 3}, unit["reason"]
        assert Path(trial["checkpoint"]).name == f"trial-{trial['number']}.pt"
    assert main(["show", "second", "1", "--db", str(db)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "store id 5" in text and not re.search(r"trials? \[[0-9, ]*[4-7]", text)


def test_plot_draws_log_labels_on_a_log_axis_and_a_readable_legend_of_40_curves(views_store, tmp_path):
    """`tridens plot` of 40 trials over a log-uniform lr: lr's panel is on a log axis; the curves are
    coloured by their final value (a colour bar) and the legend names the five best and the rest's count."""
    import matplotlib.pyplot as plt

    from tridens._views import experiment_figure
    from tridens.dashboard import log_scale_labels

    with Store(views_store, readonly=True) as store:
        record, trials = store.get_experiment("logscale"), store.trials("logscale")
    fig = experiment_figure(trials, record.objective(), log_labels=log_scale_labels(record.config["search_space"]))
    curves, *panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    by_label = {ax.get_xlabel().split(" ")[0]: ax for ax in panels}
    assert by_label["lr"].get_xscale() == "log" and by_label["hidden"].get_xscale() == "linear"
    assert len([line for line in curves.get_lines() if len(line.get_xdata()) == 2]) == 40
    legend = [text.get_text() for text in curves.get_legend().get_texts()]
    assert len(legend) == 6 and legend[-1] == "35 more trials", legend
    best = sorted(trials, key=lambda t: -t.metric)[:5]
    assert legend[0].startswith(f"#{best[0].number} (")
    assert any(ax.get_label() == "<colorbar>" for ax in fig.axes)
    plt.close(fig)
    assert main(["plot", "logscale", "--to", str(tmp_path / "p.png"), "--db", str(views_store)]) == 0
