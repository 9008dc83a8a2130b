"""Opening, listing and exporting a store someone else wrote runs none of their code, reads no
file outside the store's folder, prints their text inertly, and answers a damaged row with one
line; ``tridens resume`` runs a recorded script only once the user confirms it."""

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tridens.cli import main
from tridens.errors import StoreError, TridensError
from tridens.store import Store
from tridens.trial import Trial, TrialStatus
from tridens.warmup import Zoo

from .payloads import touch_command

TRIDENS = [sys.executable, "-m", "tridens.cli"]


def tridens(*args, cwd=None):
    return subprocess.run([*TRIDENS, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture
def tridens_here(capsys):
    """``tridens_here(*args)``: a ``tridens`` command run in this process, for tests about what it
    prints; its exit code, stdout and stderr as a CompletedProcess."""
    def run(*args):
        argv = [*map(str, args)]
        code = main(argv)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out.out, out.err)
    return run


def make_store(db: Path, config: dict, sample=None) -> Store:
    """A store with one completed trial and its checkpoint, as a run leaves it."""
    store = Store(db)
    store.create_experiment("e", {"objective": {"metric": "val_acc", "mode": "max"}, **config})
    trial = store.add_trial("e", Trial(id=-1, sample=sample or {"w": 1}, seed=0))
    trial.status, trial.metric = TrialStatus.COMPLETED, 0.5
    store.finish_trial(trial, nn.Linear(4, 3).state_dict())
    return store


def test_export_and_zoo_of_a_store_whose_space_names_os_system(tmp_path):
    marker = tmp_path / "pwned"
    recipe = {"kind": "module", "path": "os:system", "file": None, "args": [touch_command(marker)], "kwargs": {}}
    db = tmp_path / "runs.db"
    make_store(db, {"space": recipe}).close()
    res = tridens("export", "e", "--to", tmp_path / "out", "--db", db)
    assert res.returncode == 0, res.stderr  # weights and manifest exported, no program built
    assert (tmp_path / "out").exists()
    with pytest.raises(TridensError, match="not a subclass"):
        Zoo(tmp_path / "zoo.db").add_experiment("e", db)
    assert not marker.exists()


def test_a_script_space_is_imported_on_export_only_with_trust_code(tmp_path):
    marker = tmp_path / "pwned"
    script = tmp_path / "theirs.py"
    script.write_text(f"import os\nos.system({touch_command(marker)!r})\n")
    db = tmp_path / "runs.db"
    make_store(db, {"space": {"kind": "model_space", "path": "__main__:Net", "file": str(script),
                              "args": [], "kwargs": {}}}).close()
    res = tridens("export", "e", "--to", tmp_path / "out", "--db", db)
    assert res.returncode == 0 and "trust" in res.stderr, res.stderr
    assert not marker.exists()
    tridens("export", "e", "--to", tmp_path / "out2", "--db", db, "--trust-code")
    assert marker.exists()  # the user opted in


@pytest.mark.parametrize("where", ["absolute", "dotdot", "link"])
def test_a_checkpoint_path_outside_the_store_folder_is_refused(tmp_path, where, tridens_here):
    db = tmp_path / "store" / "runs.db"
    db.parent.mkdir()
    make_store(db, {}).close()
    outside = tmp_path / "elsewhere.pt"
    torch.save({"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}, outside)
    rel = {"absolute": str(outside), "dotdot": "../../elsewhere.pt", "link": "e/link.pt"}[where]
    if where == "link":
        (Path(str(db) + ".files") / "e" / "link.pt").symlink_to(outside)
    conn = sqlite3.connect(db)
    conn.execute("UPDATE checkpoints SET path = ?", (rel,))
    conn.commit()
    conn.close()
    with Store(db, readonly=True) as store:
        trial = store.trials("e")[0]
        with pytest.raises(StoreError, match="outside the store's folder"):
            store.load_checkpoint(trial.checkpoint)
    res = tridens_here("export", "e", "--to", tmp_path / "out", "--db", db)
    assert res.returncode == 1 and "outside the store's folder" in res.stderr
    assert res.stderr.count("\n") == 1


def test_resume_shows_a_foreign_command_and_refuses_it(tmp_path):
    import timeit

    marker = tmp_path / "pwned"
    db = tmp_path / "runs.db"
    argv = ["-s", f"import os; os.system({touch_command(marker)!r})", "pass"]
    make_store(db, {"script": timeit.__file__, "argv": argv}).close()
    res = tridens("resume", "e", "--db", db)
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert "timeit.py" in res.stderr and "os.system" in res.stderr and "--script" in res.stderr
    res = tridens("resume", "e", "--db", db, "--script", tmp_path / "mine.py")  # not the recorded script
    assert res.returncode == 1
    assert not marker.exists()


def test_control_characters_in_stored_text_are_printed_as_escapes(tmp_path, tridens_here):
    db = tmp_path / "runs.db"
    make_store(db, {"evaluator": {"type": "E", "repr": "E(\x1b]0;title\x07)"}},
               sample={"w\x1b[2J": "\x1b[31mred\x9b", "\u202eevil": 1}).close()
    conn = sqlite3.connect(db)
    conn.execute("UPDATE experiments SET status = ?", ("done\x1bc",))
    conn.commit()
    conn.close()
    for command in (["ls"], ["show", "e"], ["top", "e"]):
        res = tridens_here(*command, "--db", db)
        assert res.returncode == 0, res.stderr
        for raw in ("\x1b", "\x07", "\x9b", "\u202e"):
            assert raw not in res.stdout, (command, res.stdout)
    show = tridens_here("show", "e", "--db", db).stdout
    assert "\\x1b" in "".join(show.split())


def test_csv_of_foreign_text_is_quoted_escaped_and_never_a_formula(tmp_path, tridens_here):
    import csv
    import io
    import json

    db = tmp_path / "runs.db"
    formula = '=HYPERLINK("http://x","y")'
    store = make_store(db, {}, sample={formula: 1, "@SUM(A1)": "a,b\n\"c\"", "+cmd": -0.5, "w\x1b[2J": 2})
    store.add_metrics(1, 0, {"-val\x1b": 0.25, "loss": -1.5})
    failed = store.add_trial("e", Trial(id=-1, sample={formula: 2}, seed=1))
    failed.status, failed.error = TrialStatus.FAILED, "Traceback\n-2+3\x1b]0;t\x07"
    store.finish_trial(failed)
    store.close()
    for command in (["show", "e", "--csv"], ["top", "e", "--csv"], ["show", "e", "0", "--csv"]):
        res = tridens_here(*command, "--db", db)
        assert res.returncode == 0, res.stderr
        assert "\x1b" not in res.stdout and "\x07" not in res.stdout, res.stdout
        rows = list(csv.reader(io.StringIO(res.stdout)))
        assert all(not cell.startswith(("=", "+", "@")) for row in rows for cell in row), rows
        if command[-2] == "0":  # one trial's metrics: guarded names, numbers as numbers
            assert rows[0] == ["step", "'-val\\x1b", "loss"] and rows[1] == ["0", "0.25", "-1.5"], rows
            continue
        header, body = rows[0], rows[1:]
        assert len(body) == (2 if command[0] == "show" else 1), rows
        assert "'" + formula in header and "'@SUM(A1)" in header and "'+cmd" in header and "w\\x1b[2J" in header
        first = dict(zip(header, body[0]))
        assert json.loads(first["'@SUM(A1)"]) == "a,b\n\"c\""  # quoted by csv, read back whole
        assert json.loads(first["'+cmd"]) == -0.5  # a number is not guarded
        if command[0] == "show":
            assert dict(zip(header, body[1]))["error"] == "'-2+3\\x1b]0;t\\x07"


@pytest.mark.parametrize("damage,expected", [
    ("UPDATE experiments SET config = '{\"objective\": {\"metric\": \"a\", \"mode\": \"sideways\"}}'",
     "records the objective .* which is not one"),
    ("UPDATE experiments SET config = 'nope'", "the config of experiment 'e' .* is not valid JSON"),
])
def test_a_damaged_experiment_row_is_one_line_from_every_command(tmp_path, damage, expected, tridens_here):
    import re

    db = tmp_path / "runs.db"
    make_store(db, {}).close()
    conn = sqlite3.connect(db)
    conn.execute(damage)
    conn.commit()
    conn.close()
    for command in (["show", "e"], ["top", "e"], ["export", "e", "--to", tmp_path / "out"]):
        res = tridens_here(*command, "--db", db)
        assert res.returncode == 1, (command, res.stdout, res.stderr)
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, (command, res.stderr)
        assert re.search(expected, res.stderr), (command, res.stderr)
    res = tridens_here("ls", "--db", db)   # the list names it and goes on
    assert res.returncode == 0 and res.stderr.count("\n") == 1 and re.search(expected, res.stderr), res.stderr


def test_a_store_being_created_is_not_called_an_old_schema(tmp_path):
    db = tmp_path / "new.db"
    sqlite3.connect(db).close()  # the file exists, its tables do not yet
    res = tridens("ls", "--db", db)
    assert res.returncode == 1 and "holds no experiments yet" in res.stderr
    assert "schema version" not in res.stderr


@pytest.mark.parametrize("plant", ["folder", "file"])
def test_export_force_never_writes_through_a_planted_link(tmp_path, plant, tridens_here):
    db = tmp_path / "runs.db"
    make_store(db, {}).close()
    out, other = tmp_path / "out", tmp_path / "someone_elses"
    other.mkdir()
    (other / "weights.pt").write_bytes(b"theirs")
    (other / "tridens.json").write_text("{}")
    out.mkdir()
    if plant == "folder":  # the export's own folder name, linked to another folder
        (out / "rank1-trial0").symlink_to(other, target_is_directory=True)
    else:  # a folder without a manifest (kept by --force) holding a link where weights.pt goes
        (out / "rank1-trial0").mkdir()
        (out / "rank1-trial0" / "weights.pt").symlink_to(other / "weights.pt")
    res = tridens_here("export", "e", "--to", out, "--db", db, "--force")
    assert res.returncode == 0, res.stderr
    assert (other / "weights.pt").read_bytes() == b"theirs" and (other / "tridens.json").read_text() == "{}"
    weights = out / "rank1-trial0" / "weights.pt"
    assert not weights.is_symlink() and set(torch.load(weights, weights_only=True)) == {"weight", "bias"}
