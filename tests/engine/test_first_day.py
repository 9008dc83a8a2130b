"""A new user's first day: a plain hyperparameter search, runs that say why they stopped, resume
and export that never mix experiments, and mistakes reported before the first trial."""

import io
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import tridens as td
from tridens import nn as tnn
from tridens.engine._preflight import SpaceChanged
from tridens.engine._progress import trials_table
from tridens.errors import InvalidSample, TridensError
from tridens.store import Store
from tridens.trial import TrialStatus
from .spaces import WidthMLP as Net
from .spaces import digits_loop


def train_mlp(lr, hidden, epochs=2):
    """A user's own loop: builds its model, trains on digits, reports validation accuracy."""
    digits_loop(lr, hidden, epochs)


def hp_evaluator():
    return td.evaluators.FunctionalEvaluator(train_mlp, lr=td.loguniform("lr", 1e-3, 3e-2),
                                             hidden=td.choice("hidden", [16, 32]))


class BadHead(tnn.ModelSpace):
    """Width 32 does not fit the head (a user's bug): freeze() names the layer."""

    def __init__(self):
        super().__init__()
        w = td.choice("width", [16, 32])
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, w), nn.ReLU())
        self.head = nn.Linear(16, 10)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.head(self.body(x))


def classification(data, **kw):
    train, val = data
    args = dict(epochs=2, batch_size=128, optimizer="adam", lr=td.choice("lr", [0.01, 0.003]))
    args.update(kw)
    return td.evaluators.Classification(train, val, **args)


# -- plain hyperparameter search -------------------------------------------------------------------

def test_hyperparameter_only_search_needs_no_model_space(tmp_path):
    exp = td.Experiment(None, hp_evaluator(), "tpe", budget=4, store=tmp_path / "hp.db",
                        options=td.RunOptions(verbose=False))
    exp.run()
    trials = exp.trials()
    assert exp.name is None and trials[0].experiment == "train-mlp"  # named after the function
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert all(t.status is TrialStatus.COMPLETED and t.metric > 0.5 for t in trials)
    # no made-up model: no fingerprint, no parameter count, every sample its own trial
    assert all(t.fingerprint is None and "params" not in t.info for t in trials)
    assert len({json.dumps(t.sample, sort_keys=True) for t in trials}) == 4
    assert exp.best().metric == max(t.metric for t in trials)


def test_a_space_of_none_is_refused_with_a_declarative_evaluator(tmp_path, data):
    exp = td.Experiment(None, classification(data), budget=2, store=tmp_path / "x.db", name="x")
    with pytest.raises(td.InvalidSpace, match="may be None only with a FunctionalEvaluator"):
        exp.run()


def test_tables_print_floats_to_significant_digits(tmp_path):
    exp = td.Experiment(None, hp_evaluator(), "random", budget=2, store=tmp_path / "hp.db",
                        options=td.RunOptions(verbose=False))
    exp.run()
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=200).print(trials_table(exp.trials(), exp._objective()))
    lr = exp.trials()[0].sample["lr"]
    assert f"lr={lr:.4g}" in out.getvalue() and repr(lr) not in out.getvalue()


# -- trial numbers per experiment --------------------------------------------------------------------

def test_trials_are_numbered_per_experiment(tmp_path):
    store = tmp_path / "two.db"
    for name in ("first", "second"):
        td.Experiment(None, hp_evaluator(), "random", budget=3, store=store, name=name,
                      options=td.RunOptions(verbose=False)).run()
    second = td.Experiment.load(store, "second")
    assert [t.number for t in second.trials()] == [0, 1, 2]
    assert min(t.id for t in second.trials()) == 4  # ids stay unique in the store
    with Store(store, readonly=True) as db:
        assert db.trial(second.trials()[2].id).number == 2
        assert [t.number for t in db.trials("second", status="completed")] == [0, 1, 2]


def slow_steps(lr):
    """A user loop whose steps outlast a small trial_timeout when ``lr`` is large."""
    for step in range(3):
        time.sleep(0.3 if lr > 0.15 else 0.0)
        td.report(lr * step, step=step)


def test_a_timeout_names_the_trial_by_its_number_in_the_experiment(tmp_path):
    store = tmp_path / "timeouts.db"
    ev = td.evaluators.FunctionalEvaluator(slow_steps, lr=td.choice("lr", [0.1, 0.2]))
    for name in ("first", "second"):
        td.Experiment(None, ev, td.strategy.GridSearch(), store=store, name=name, budget=td.Budget(trial_timeout=0.2),
                      options=td.RunOptions(verbose=False)).run()
    trials = td.Experiment.load(store, "second").trials()
    failed = [t for t in trials if t.status is TrialStatus.FAILED]
    assert len(failed) == 1 and min(t.id for t in trials) == 3   # store ids differ from numbers here
    assert f"trial {failed[0].number} exceeded trial_timeout=0.2 s" in failed[0].error, failed[0].error


# -- why a run stopped ------------------------------------------------------------------------------

def test_every_run_says_why_it_stopped(tmp_path, capsys):
    store = tmp_path / "why.db"
    exp = td.Experiment(None, hp_evaluator(), "random", budget=2, store=store, name="budget")
    exp.run()
    assert exp.stop_reason == "max_trials=2 reached"
    assert "[budget] stopped: max_trials=2 reached" in capsys.readouterr().err
    grid = td.evaluators.FunctionalEvaluator(train_mlp, lr=0.01, hidden=td.choice("hidden", [16, 32]))
    exp = td.Experiment(None, grid, td.strategy.GridSearch(), budget=10, store=store, name="grid")
    exp.run()
    assert "GridSearch has nothing more to propose" in exp.stop_reason and "after 2 trials" in exp.stop_reason
    assert "[grid] stopped: GridSearch has nothing more to propose" in capsys.readouterr().err
    exp = td.Experiment(None, hp_evaluator(), "random", budget=td.Budget(max_trials=10, max_duration=0), store=store,
                        name="time")
    exp.run()
    assert exp.stop_reason == "max_duration=0 reached after 0/10 trials"


# -- resume ----------------------------------------------------------------------------------------

def test_resume_with_a_changed_space_is_refused(tmp_path, data):
    store = tmp_path / "resume.db"
    ev = classification(data, epochs=1)
    td.Experiment(Net(), ev, "random", budget=2, store=store, name="s", options=td.RunOptions(verbose=False)).run()
    bigger = td.Experiment(Net(widths=(16, 32, 64)), ev, "random", budget=4, store=store, name="s",
                           options=td.RunOptions(verbose=False))
    with pytest.raises(SpaceChanged) as err:
        bigger.run()
    message = str(err.value)
    assert "\n" not in message and "changed label 'width'" in message
    assert "new name=" in message and "resume='force'" in message
    assert len(td.Experiment.load(store, "s").trials()) == 2  # nothing was mixed in
    bigger.resume = "force"
    bigger.run()
    assert len(td.Experiment.load(store, "s").trials()) == 4
    # the same space resumes as before
    td.Experiment(Net(), ev, "random", budget=5, store=store, name="s", options=td.RunOptions(verbose=False)).run()


def test_the_live_view_after_resume_shows_the_whole_experiment(tmp_path, capsys):
    store = tmp_path / "live.db"
    td.Experiment(None, hp_evaluator(), "random", budget=3, store=store, name="live", options=td.RunOptions(seed=1)).run()
    capsys.readouterr()
    exp = td.Experiment(None, hp_evaluator(), "random", budget=4, store=store, name="live",
                        options=td.RunOptions(seed=1))
    exp.run()
    err = capsys.readouterr().err
    best = exp.best().metric
    line = next(line for line in err.splitlines() if "4/4 trial 3" in line)
    assert f"best={best:.4f}" in line  # the best of all four, three of them from the first run


LIVE_SEARCH = '''
import os
import time
import tridens as td

def score(x):
    td.report(x, step=0)
    time.sleep(0.6)  # a trial in training for a few refreshes of the live view
    td.report(x, step=1)

if __name__ == "__main__":
    td.Experiment(None, td.evaluators.FunctionalEvaluator(score, x=td.uniform("x", 0.0, 1.0)), "random",
                  max_trials=int(os.environ["TRIALS"]), name="live", seed=1).run()
'''


def test_the_live_table_after_tridens_resume_shows_the_whole_experiment(tmp_path):
    """``tridens resume`` in a terminal (a pseudo-terminal here): the table of best trials and the
    training line hold the trials finished before the interruption."""
    import pty
    import re

    script, db = tmp_path / "live.py", tmp_path / "live.db"
    script.write_text(LIVE_SEARCH)
    env = {**os.environ, "TRIALS": "3", "TRIDENS_DB": str(db), "TERM": "xterm", "COLUMNS": "120"}
    first_run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=120)
    assert first_run.returncode == 0, first_run.stderr
    env["TRIALS"] = "4"
    master, terminal = pty.openpty()
    proc = subprocess.Popen([*TRIDENS, "resume", "live", "--db", str(db), "--script", str(script)], cwd=tmp_path,
                            env=env, stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed: the command ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=120) == 0
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    first, new = td.Experiment.load(db, "live").trials()[:3], td.Experiment.load(db, "live").trials()[3]
    best = max(first, key=lambda t: t.metric)
    assert new.metric < best.metric  # the best trial comes from the interrupted run
    while_training = screen[:screen.index("4/4")]  # frames drawn before the new trial finished
    assert f"best value so far {best.metric:.4f}" in while_training
    for t in first:
        assert re.search(rf"│ {t.number} +│ completed │ {t.metric:.4f} ", while_training), t.number


# -- export ----------------------------------------------------------------------------------------

def test_export_refuses_a_non_empty_directory_and_has_one_layout(tmp_path, data):
    store = tmp_path / "exp.db"
    exp = td.Experiment(Net(), classification(data, epochs=1), "grid", budget=4, store=store, name="e",
                        options=td.RunOptions(verbose=False))
    exp.run()
    one = exp.export(tmp_path / "one", top=1)
    two = exp.export(tmp_path / "two", top=2)
    best = exp.top(2)
    assert [p.name for p in one] == [f"rank1-trial{best[0].number}"]
    assert [p.name for p in two] == [f"rank1-trial{best[0].number}", f"rank2-trial{best[1].number}"]
    with pytest.raises(TridensError, match="not empty .*--force"):
        exp.export(tmp_path / "two", top=1)
    assert len(list((tmp_path / "two").iterdir())) == 2  # untouched
    (tmp_path / "two" / "notes.txt").write_text("mine")
    exp.export(tmp_path / "two", top=1, force=True)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["notes.txt", one[0].name]
    # td.load takes the export directory (the best model) or one model's folder
    x = data[1].tensors[0][:8]
    a, b = td.load(tmp_path / "one").eval(), td.load(one[0]).eval()
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x))


def test_exporting_a_hyperparameter_only_search_says_there_is_no_model(tmp_path):
    store = tmp_path / "hp.db"
    exp = td.Experiment(None, hp_evaluator(), "random", budget=2, store=store, name="hp",
                        options=td.RunOptions(verbose=False))
    exp.run()
    with pytest.raises(TridensError, match="'hp' searched hyperparameters only .*no model to export"):
        exp.export(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_loaded_program_behaves_like_a_model(tmp_path, data):
    store = tmp_path / "p.db"
    exp = td.Experiment(Net(), classification(data, epochs=1), "grid", budget=2, store=store, name="p",
                        options=td.RunOptions(verbose=False))
    exp.run()
    [folder] = exp.export(tmp_path / "out")
    program = td.load(folder, prefer="program")
    assert program.eval() is program and not program.training
    x = data[1].tensors[0][:8]
    with torch.no_grad():
        torch.testing.assert_close(program(x), td.load(folder).eval()(x))
    with pytest.raises(TridensError, match="inference only"):
        program.train()


# -- errors before the run -------------------------------------------------------------------------

@pytest.mark.parametrize("settings, match", [
    ({"optimizer": "adamm"}, "'optimizer' parameter of Classification"),
    ({"schedule": td.choice("schedule", ["cosine", "cosin"])}, "'schedule' parameter"),
    ({"metrics": ["acc", "f1"]}, "'metrics' parameter of Classification"),
])
def test_evaluator_settings_are_checked_before_the_first_trial(tmp_path, data, settings, match):
    store = tmp_path / "bad.db"
    exp = td.Experiment(Net(), classification(data, **settings), "random", budget=3, store=store, name="bad")
    with pytest.raises(Exception, match=match):
        exp.run()
    assert _no_experiment(store)  # a failed start leaves no experiment behind


def test_objective_and_strategy_settings_are_checked_before_the_first_trial(tmp_path, data):
    store = tmp_path / "bad.db"
    exp = td.Experiment(Net(), classification(data), "random", budget=3, store=store, name="o", objective="val_f1")
    with pytest.raises(TridensError, match="'val_f1', which Classification does not report"):
        exp.run()
    exp = td.Experiment(Net(), classification(data), td.strategy.ASHA(reduction_factor=1), budget=3, store=store,
                        name="o")
    with pytest.raises(ValueError, match="'reduction_factor' parameter of ASHA"):
        exp.run()
    assert _no_experiment(store)


def _no_experiment(store):
    if not store.exists():
        return True
    with Store(store, readonly=True) as db:
        return db.experiments() == []


class ProposesNothingValid(td.strategy.Random):
    """A user's strategy with a bug in ask(): it fails after the run started, before any trial."""

    def ask(self, remaining=None):
        raise RuntimeError("bug in my strategy")


def test_a_start_that_fails_after_the_store_opened_leaves_no_experiment(tmp_path, data):
    store = tmp_path / "late.db"
    td.Experiment(Net(), classification(data, epochs=1), "random", budget=1, store=store, name="kept",
                  options=td.RunOptions(verbose=False)).run()
    exp = td.Experiment(Net(), classification(data), ProposesNothingValid(), budget=2, store=store, name="late",
                        options=td.RunOptions(verbose=False))
    with pytest.raises(RuntimeError, match="bug in my strategy"):
        exp.run()
    with Store(store, readonly=True) as db:
        assert [r.name for r in db.experiments()] == ["kept"]


def test_asha_by_name_takes_max_steps_from_the_evaluator(tmp_path, data):
    exp = td.Experiment(Net(), classification(data, epochs=3), "asha", budget=4, store=tmp_path / "a.db", name="a",
                        options=td.RunOptions(verbose=False))
    exp.run()
    assert {t.max_steps for t in exp.trials()} == {3}


def test_asha_with_a_user_loop_asks_for_max_steps_before_the_first_trial(tmp_path):
    store = tmp_path / "a.db"
    exp = td.Experiment(None, hp_evaluator(), "asha", budget=4, store=store, name="a",
                        options=td.RunOptions(verbose=False))
    with pytest.raises(ValueError, match=r"FunctionalEvaluator has no fixed 'epochs' .*td\.strategy\.ASHA\(max_steps=N\)"):
        exp.run()
    assert _no_experiment(store)
    exp.strategy = td.strategy.ASHA(max_steps=2)
    exp.run()
    assert {t.max_steps for t in exp.trials()} == {2} and len(exp.trials()) == 4


def test_a_sample_whose_shapes_do_not_fit_fails_with_the_freeze_message(tmp_path, data):
    space = BadHead()
    with pytest.raises(InvalidSample) as err:
        space.freeze({"width": 32})
    expected = str(err.value)
    with pytest.raises(InvalidSample, match="layer 'head' \\(Linear\\) failed"):
        space.validate({"width": 32})
    exp = td.Experiment(space, classification(data, epochs=1, lr=0.01), "grid", budget=2, store=tmp_path / "s.db",
                        name="s", options=td.RunOptions(verbose=False))
    exp.run()
    failed = [t for t in exp.trials() if t.status is TrialStatus.FAILED]
    assert [t.sample["width"] for t in failed] == [32]
    assert failed[0].error.strip().splitlines()[-1] == f"InvalidSample: {expected}"


# -- one-shot ----------------------------------------------------------------------------------------

def test_one_shot_warns_about_an_evaluator_choice_it_does_not_search(tmp_path, data, caplog):
    exp = td.Experiment(Net(), classification(data, epochs=1), td.oneshot.RandomOneShot(samples=2),
                        store=tmp_path / "o.db", name="o", options=td.RunOptions(verbose=False))
    with caplog.at_level(logging.WARNING, logger="tridens"):
        exp.run()
    warned = [r.getMessage() for r in caplog.records if "does not search the evaluator's hyperparameter" in r.getMessage()]
    assert len(warned) == 1 and "'lr'" in warned[0] and "first candidate 0.01" in warned[0]
    assert all(not math.isnan(t.metric or 0) for t in exp.trials())


# -- threads ---------------------------------------------------------------------------------------

def threads_seen():
    """A user's loop that reports the torch threads it runs with."""
    td.report({"threads": float(torch.get_num_threads())}, step=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_user_loop_runs_with_the_thread_policys_threads(tmp_path, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        policy = td.engine.ThreadPolicy(threads=threads)
        exp = td.Experiment(None, td.evaluators.FunctionalEvaluator(threads_seen), "random", budget=1,
                            store=tmp_path / "t.db", name="t", options=td.RunOptions(verbose=False),
                            executor=td.executors.Inline(threads=policy))
        exp.run()
        assert exp.trials()[0].metric == threads
        assert torch.get_num_threads() == 3  # the caller's setting is back
    finally:
        torch.set_num_threads(before)


def test_a_user_loop_on_a_busy_machine_gets_one_thread():
    """The rule the measuring policy applies to a user's loop (its step size unknown), with the
    machine's load and torch's default thread count given: one thread when no core is idle, every
    idle core otherwise; the user's own torch count whatever the load."""
    policy, default = td.engine.ThreadPolicy(repeatable=False), {"torch_threads": 2, "default_threads": 2}
    assert policy.decide(None, total=2, load=3.8, **default).threads == 1
    assert policy.decide(None, total=2, load=0.0, **default).threads == 2
    assert policy.decide(None, total=2, load=0.0, torch_threads=1, default_threads=2).threads == 1


# -- the command line and the demo (real subprocesses) ------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
TRIDENS = [sys.executable, "-m", "tridens.cli"]


def test_make_demo_says_why_it_stopped(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--store", str(tmp_path / "demo.db"),
                           "--trials", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "stopped: max_trials=1 reached" in proc.stderr and "max_trials=1 reached; best trials" in proc.stdout


def test_tridens_run_keeps_pythons_did_you_mean_hint(tmp_path):
    script = tmp_path / "typo.py"
    script.write_text("import tridens as td\nexp = td.Experimnt(None, None)\n")
    proc = subprocess.run([*TRIDENS, "run", str(script), "--db", str(tmp_path / "x.db")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "Did you mean: 'Experiment'?" in proc.stderr and "line 2" in proc.stderr


SLOW_SEARCH = '''
import time
import tridens as td

def train(lr):
    for epoch in range(3):
        time.sleep(0.2)
        td.report(lr * epoch, step=epoch)

if __name__ == "__main__":
    td.Experiment(None, td.evaluators.FunctionalEvaluator(train, lr=td.uniform("lr", 0.0, 1.0)), "random",
                  max_trials=500, name="slow").run()
'''


def _interrupt_after_a_trial(command, db, cwd, env=None):
    """Start ``command``, press Ctrl-C once a trial finished; returns (exit status, stderr)."""
    # a terminal's SIGINT: a suite run in the background (nohup, CI job) would pass SIGINT on ignored
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    done = before = None
    while (done is None or done <= before) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.3)
        try:
            with Store(db, readonly=True) as store:
                done = len(store.trials("slow", status="completed"))
        except Exception:  # not created yet
            continue
        before = done if before is None else before
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert done is not None and done > before, err
    return proc.returncode, err


@pytest.mark.parametrize("launcher", ["tridens run", "python"])
def test_ctrl_c_prints_one_line_with_the_resume_command(tmp_path, launcher):
    script = tmp_path / "slow.py"
    script.write_text(SLOW_SEARCH)
    db = tmp_path / "slow.db"
    if launcher == "python":  # the README's way: run the script; the store is $TRIDENS_DB
        command, env = [sys.executable, str(script)], {**os.environ, "TRIDENS_DB": str(db)}
    else:
        command, env = [*TRIDENS, "run", str(script), "--db", str(db)], None
    code, err = _interrupt_after_a_trial(command, db, tmp_path, env)
    assert code == (130 if launcher == "tridens run" else 1)
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if "interrupted" in line]
    assert line.startswith("tridens: 'slow' interrupted with ")
    resume = f"tridens resume slow --db {db} --script {script}"
    assert f"finish it with: {resume}" in line
    with Store(db, readonly=True) as store:
        assert store.get_experiment("slow").status == "interrupted"
        kept = len(store.trials("slow", status="completed"))  # finished trials kept
    if launcher == "python":  # the printed command resumes the experiment as it is
        code, err = _interrupt_after_a_trial([*TRIDENS, *resume.split()[1:]], db, tmp_path)
        assert code == 130 and f"resuming 'slow' with {kept} finished trials" in err


def test_the_readmes_links_and_make_bench_sentence_are_true():
    """Every relative link of the README names a file of the repository, and what it says
    `make bench` installs is what the Makefile installs (Optuna is a core dependency)."""
    import re
    import tomllib

    readme = (ROOT / "README.md").read_text()
    links = [t for t in re.findall(r"\]\(([^)#\s]+)", readme) if "://" not in t]
    links += re.findall(r"`([\w./-]+\.md)`", readme)  # files named in the text
    assert links and all((ROOT / t).exists() for t in links), [t for t in links if not (ROOT / t).exists()]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.lower().startswith("optuna") for d in project["dependencies"])
    [sentence] = re.findall(r"\(`make bench`[^)]*\([^)]*\)[^)]*\)", readme.replace("\n", " "))
    assert "optuna" not in sentence.lower()
    [extras] = re.findall(r"^\t.*pip install .*'\.\[(\w+)\]'", (ROOT / "Makefile").read_text().split("\nbench:")[1], re.M)
    bench = project["optional-dependencies"][extras]
    assert any(d.startswith("ray[tune]") for d in bench) and "Ray Tune" in sentence


def test_the_readme_plain_hyperparameter_search_runs(tmp_path):
    """The quick start's "plain hyperparameter search" block, as a user would paste it."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    [block] = [b for b in blocks if "td.Experiment(None" in b]
    (tmp_path / "hpo.py").write_text(block)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's threads, as a user has them
    proc = subprocess.run([sys.executable, "hpo.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "stopped: max_trials=20 reached" in proc.stderr
    best, sample = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    assert float(best) > 0.8 and "'lr'" in sample and "'hidden'" in sample
    # the objective is the first key of the reported dicts, as td.report documents: val_acc, in the
    # run's lines and in every view of the store
    assert "completed val_acc=" in proc.stderr and "value" not in proc.stderr
    db = str(tmp_path / "tridens.db")
    views = {cmd: subprocess.run([*TRIDENS, *cmd.split(), "--db", db], capture_output=True, text=True, timeout=120,
                                 env={**env, "COLUMNS": "200"})
             for cmd in ("ls", "top plain-hpo", "show plain-hpo", "show plain-hpo 0")}
    for cmd, view in views.items():
        assert view.returncode == 0 and "value" not in view.stdout, (cmd, view.stdout, view.stderr)
    assert "val_acc (max)" in views["ls"].stdout
    assert re.search(r"trial\W+status\W+val_acc\W", views["top plain-hpo"].stdout)
    assert '"metric": "val_acc"' in views["show plain-hpo"].stdout
    assert re.search(r"^val_acc +0\.\d+", views["show plain-hpo 0"].stdout, re.M)
