"""The ``tridens`` command: run, ls, show, top, export, resume, dashboard, plot, export-optuna,
clean-stages.

    tridens run search.py            # run a script that builds and runs a td.Experiment
    tridens ls                       # experiments in the store
    tridens show NAME                # configuration and every trial
    tridens top NAME -k 10           # the best trials
    tridens export NAME --top 1 --to best/
    tridens resume NAME              # finish an interrupted experiment (re-runs its script)
    tridens show NAME 3              # trial 3 in full (metrics per step, error, checkpoint)
    tridens top NAME --json          # also --csv, for scripts (show too)
    tridens dashboard                # a web dashboard on http://127.0.0.1:8765
    tridens plot NAME --to curves.png
    tridens export-optuna NAME --to sqlite:///optuna.db
    tridens clean-stages --dry-run   # stage checkpoints no live trial needs: listed (then removed without --dry-run)

Every command takes ``--db PATH`` (default ``$TRIDENS_DB`` or ``tridens.db``).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import TridensError

__all__ = ["main"]


def _store(db: str, readonly: bool = True):  # type: ignore[no-untyped-def]
    from .store import Store, StoreError

    if not Path(db).exists():
        raise StoreError(f"no store at {db} (run an experiment first, or pass --db PATH)")
    store = Store(db, readonly=readonly)
    _settle_abandoned(store)
    return store


def _settle_abandoned(store):  # type: ignore[no-untyped-def]
    """Runs left ``running`` by a driver that is gone (killed, a full disk) are marked interrupted
    before they are shown; a store that cannot be written is shown as it is."""
    from .engine import find_abandoned, mark_abandoned
    from .store import Store, StoreError

    try:
        if find_abandoned(store):
            with Store(store.path) as writable:
                mark_abandoned(writable)
    except (StoreError, OSError):
        pass


def _skipped(damaged: Sequence[str]) -> None:
    """One line on stderr per damaged row a command left out (the rest is shown)."""
    from .text import printable

    for line in damaged:
        print(f"tridens: skipped a damaged row: {printable(' '.join(line.split()))}", file=sys.stderr)


def _console():  # type: ignore[no-untyped-def]
    """A rich console that prints stored text as it is: no emoji codes (``digits:train:`` in a
    dataset's repr is not a train emoji)."""
    from rich.console import Console

    from .text import printable

    class SafeConsole(Console):
        """Shows control characters in stored text as escapes (:func:`tridens.text.printable`)."""

        def render_str(self, text: str, **kwargs):  # type: ignore[no-untyped-def]
            return super().render_str(printable(text), **kwargs)

    return SafeConsole(emoji=False)


def _run_script(script: str, db: str, argv: Sequence[str]) -> int:
    from .engine import runs_started

    path = Path(script)
    if not path.exists():
        raise TridensError(f"no script {script}")
    os.environ["TRIDENS_DB"] = os.path.abspath(db)
    os.environ["TRIDENS_SCRIPT"] = str(path.resolve())
    before = runs_started()
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except (TridensError, OSError, KeyboardInterrupt):
        raise
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    except Exception as err:  # the user's script failed: one line, the traceback on request
        if os.environ.get("TRIDENS_DEBUG"):
            raise
        where = _user_frame(err)
        raise TridensError(f"{script} failed{where}: {_exception_line(err)} (set TRIDENS_DEBUG=1 for the traceback)") from err
    if runs_started() == before:
        raise TridensError(f"{script} ran but started no experiment (call td.Experiment(...).run() in it)")
    return 0


def _exception_line(err: BaseException) -> str:
    """``Type: message`` as Python prints it, with its hints ("Did you mean: 'Experiment'?")."""
    import builtins
    import difflib
    import traceback

    text = " ".join("".join(traceback.format_exception_only(err)).split())
    name = getattr(err, "name", None)
    if "Did you mean" in text or not isinstance(name, str):
        return text
    # Python 3.11's traceback module leaves out the hint its interpreter prints: the same rule here.
    if isinstance(err, AttributeError):
        known = dir(getattr(err, "obj", None))
    elif isinstance(err, NameError) and err.__traceback__ is not None:
        tb = err.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        known = [*tb.tb_frame.f_locals, *tb.tb_frame.f_globals, *dir(builtins)]
    else:
        return text
    close = difflib.get_close_matches(name, [k for k in known if not k.startswith("_")], n=1)
    return f"{text}. Did you mean: {close[0]!r}?" if close else text


def _user_frame(err: BaseException) -> str:
    """`` at line N`` of the innermost frame in the user's script, if any."""
    import traceback

    frames = [f for f in traceback.extract_tb(err.__traceback__) if os.environ.get("TRIDENS_SCRIPT") == os.path.abspath(f.filename)]
    return f" at line {frames[-1].lineno}" if frames else ""


def _cmd_run(args: argparse.Namespace) -> int:
    # `tridens run s.py --db x.db a b`: our --db may follow the script; after `--` all goes to the script.
    rest, db = list(args.args), args.db
    if "--" in rest:
        cut = rest.index("--")
        head, tail = rest[:cut], rest[cut + 1:]
    else:
        head, tail = rest, []
    script_args = []
    i = 0
    while i < len(head):
        if head[i] == "--db" and i + 1 < len(head):
            db, i = head[i + 1], i + 2
        elif head[i].startswith("--db="):
            db, i = head[i].split("=", 1)[1], i + 1
        else:
            script_args.append(head[i])
            i += 1
    return _run_script(args.script, db, script_args + tail)


def _cmd_resume(args: argparse.Namespace) -> int:
    with _store(args.db) as db:
        record = db.get_experiment(args.name)
    import shlex

    from .text import printable

    script, argv = record.config.get("script"), record.config.get("argv") or []
    if not script:
        raise TridensError(f"experiment {args.name!r} records no script to resume from")
    if not isinstance(script, str) or not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise TridensError(f"experiment {args.name!r} records a script or arguments that are not text")
    command = "python " + " ".join(shlex.quote(printable(part)) for part in [script, *argv])
    # A store may come from someone else: its script and arguments run only once the user names
    # that script on the command line, having seen the whole command.
    if args.script is None or Path(args.script).resolve() != Path(script).resolve():
        raise TridensError(f"resuming {args.name!r} runs `{command}`, as the store {args.db} records it; if that "
                           f"script is yours, confirm it: tridens resume {shlex.quote(args.name)} --script "
                           f"{shlex.quote(printable(script))}")
    if not Path(script).exists():
        raise TridensError(f"the script {script} of experiment {args.name!r} no longer exists")
    print(f"tridens: resuming {args.name!r}: {command}", file=sys.stderr, flush=True)
    return _run_script(script, args.db, argv)


def _cmd_ls(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .store import StoreError
    from .text import markup_text
    from .trial import TrialStatus

    with _store(args.db) as db:
        table = Table(title=f"experiments in {markup_text(args.db)}")
        for col in ("name", "status", "trials", "best", "objective"):
            table.add_column(col)
        damaged: list[str] = []
        for record in db.experiments(damaged=damaged):
            trials = db.trials(record.name, damaged=damaged)
            try:
                objective = record.objective()
            except StoreError as err:
                damaged.append(str(err))
                table.add_row(*map(markup_text, [record.name, record.status, len(trials), "-", "damaged"]))
                continue
            scores = [t.metric for t in trials if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED) and t.metric is not None]
            best = max(scores, key=objective.score) if scores else None
            table.add_row(*map(markup_text, [record.name, record.status, len(trials), "-" if best is None else f"{best:.4f}",
                                             f"{objective.metric} ({objective.mode})"]))
    _console().print(table)
    _skipped(damaged)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    if args.trial is not None or args.json or args.csv:
        return _show_data(args)
    import json

    from .engine import trials_table
    from .text import markup_text

    damaged: list[str] = []
    with _store(args.db) as db:
        record = db.get_experiment(args.name)
        trials = db.trials(args.name, damaged=damaged)
    _skipped(damaged)
    console = _console()
    config = record.config
    console.print(f"[bold]{markup_text(record.name)}[/] ({markup_text(record.status)}), {len(trials)} trials")
    for key in ("script", "strategy", "evaluator", "max_trials", "seed", "objective"):
        if config.get(key) is not None:
            value = config[key]
            text = value.get("repr", value) if isinstance(value, dict) and "repr" in value else json.dumps(value)
            console.print(f"  {key}: {markup_text(text)}")  # stored text, not rich markup
    objective = record.objective()
    console.print(trials_table(trials, objective, full_samples=not sys.stdout.isatty()))
    if any(t.info.get("stages") for t in trials):   # trained through stage trees: the tree, compactly
        from . import _views
        from .store import stage_tree

        with _store(args.db) as db:
            stages = stage_tree(db, args.name)
        console.print(_views.stage_tree_view(stages, _views.number_trials(trials), args.name))
    return 0


def _cmd_top(args: argparse.Namespace) -> int:
    # from the store alone: importing the engine would import torch (seconds) to sort a table
    from .engine import trials_table
    from .strategy import best_first
    from .trial import Objective

    damaged: list[str] = []
    with _store(args.db) as db:
        record = db.get_experiment(args.name)
        trials = db.trials(args.name, damaged=damaged)
    _skipped(damaged)
    objective, second = record.objective(), record.config.get("second_objective")
    top = best_first(trials, objective, Objective(*second) if second else None)[:args.k]
    if args.json or args.csv:
        return _print_trials(top, trials, args)
    _console().print(trials_table(top, objective, title=f"top {args.k} of {args.name}",
                                  full_samples=not sys.stdout.isatty()))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .engine import Experiment

    exp = Experiment.load(args.db, args.name)
    import json

    for path in exp.export(args.to, top=args.top, trust_code=args.trust_code, force=args.force,
                           allow_modules=args.allow_module):
        note = json.loads((path / "tridens.json").read_text()).get("note")
        print(f"{path}  ({note})" if note else path)
    return 0


def _show_data(args: argparse.Namespace) -> int:
    """``show NAME TRIAL`` (one trial in full) and ``show NAME --json/--csv``."""
    import json

    from . import _views

    damaged: list[str] = []
    with _store(args.db) as db:
        record = db.get_experiment(args.name)
        trials = db.trials(args.name, damaged=damaged)
    _skipped(damaged)
    if args.trial is None:
        return _print_trials(trials, trials, args)
    numbered = {t.number: t for t in trials}
    if args.trial not in numbered:
        count = max((t.number for t in trials if t.number is not None), default=-1) + 1
        if any(f"(number {args.trial} of " in line for line in damaged):
            raise TridensError(f"trial {args.trial} of experiment {args.name!r} cannot be shown: its row in the store "
                               "is damaged (see above)")
        raise TridensError(f"experiment {args.name!r} has no trial {args.trial} (its trials are numbered 0 to "
                           f"{count - 1})" if trials else f"experiment {args.name!r} has no trials yet")
    trial = numbered[args.trial]
    if args.json:
        print(json.dumps(_views.trial_record(trial, args.trial), indent=2))
    elif args.csv:
        sys.stdout.write(_views.metrics_csv(trial))
    else:
        objective = record.objective()
        console = _console()
        for part in _views.trial_details(trial, trials, objective):
            console.print(part)
    return 0


def _print_trials(shown: Sequence[Any], trials: Sequence[Any], args: argparse.Namespace) -> int:
    """Trials as JSON (a list of objects) or CSV (one row each), numbered as tables number them."""
    import json

    from . import _views

    numbers = _views.number_trials(trials)
    if args.json:
        print(json.dumps([_views.trial_record(t, numbers.get(t.id)) for t in shown], indent=2))
    else:
        sys.stdout.write(_views.trials_csv(shown, numbers))
    return 0


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from .dashboard import serve

    if not Path(args.db).exists():
        print(f"tridens: no store at {Path(args.db).absolute()} yet; the dashboard shows its experiments once a run "
              "creates it (or pass --db PATH)", file=sys.stderr, flush=True)
    serve(args.db, host=args.host, port=args.port, allowed_hosts=args.allow_host)
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from . import _views

    with _store(args.db) as db:
        record = db.get_experiment(args.name)
        trials = db.trials(args.name)
    objective = record.objective()
    from .dashboard import log_scale_labels

    print(_views.plot_experiment(trials, objective, args.to, metric=args.metric, title=args.name,
                                 log_labels=log_scale_labels(record.config.get("search_space"))))
    return 0


def _cmd_export_optuna(args: argparse.Namespace) -> int:
    from .loggers import export_optuna

    if not Path(args.db).exists():
        raise TridensError(f"no store at {args.db} (run an experiment first, or pass --db PATH)")
    study = export_optuna(args.db, args.name, args.to, study_name=args.study)
    print(f"study {study.study_name!r} in {args.to}: {len(study.trials)} trials")
    return 0


def _bytes(text: str) -> int:
    """``--keep``'s value: ``0`` or a size such as ``512MiB`` or ``2GB``."""
    from .units import parse_memory

    if text.strip() == "0":
        return 0
    try:
        return int(parse_memory(text, "--keep", "tridens clean-stages") or 0)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _cmd_clean_stages(args: argparse.Namespace) -> int:
    from .store import clean_stages
    from .text import printable

    with _store(args.db, readonly=args.dry_run) as db:
        result = clean_stages(db, args.keep, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for sid, label, experiment, path, size, why in result.removed:
        by = f"trained by {printable(repr(experiment))}" if experiment else "its experiment deleted"
        print(f"{verb} stage {sid} ({printable(label)}, {by}): {printable(path)}, {size / 2**20:.2f} MiB: {why}")
    for sid, path in result.skipped:
        print(f"skipped stage {sid}: its checkpoint {printable(repr(path))} is not a stage checkpoint under "
              f"{printable(str(db.files_dir / '.stages'))} (a damaged or crafted row); nothing it names is listed or removed")
    rows = f" and {result.orphans} stage row(s) no trial uses any more" if result.orphans else ""
    also = f", then the most recently used up to {args.keep / 2**20:.0f} MiB" if args.keep else ""
    print(f"{verb} {len(result.removed)} stage checkpoint(s) ({result.freed / 2**20:.1f} MiB){rows}; "
          f"{result.kept / 2**20:.1f} MiB kept (the stages live trials went through{also}) in {printable(args.db)}")
    return 0


def _output_options(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    group.add_argument("--csv", action="store_true", help="print CSV for scripts instead of a table")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tridens", description="Exploratory training for PyTorch.")
    default_db = os.environ.get("TRIDENS_DB", "tridens.db")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", default=default_db, help="the experiment store (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", parents=[common], help="run a script that runs a td.Experiment")
    p.add_argument("script", help="the Python script that builds and runs a td.Experiment")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(fn=_cmd_run)
    p = sub.add_parser("ls", parents=[common], help="list experiments")
    p.set_defaults(fn=_cmd_ls)
    p = sub.add_parser("show", parents=[common], help="an experiment's configuration and trials, or one trial in full")
    p.add_argument("name", help="the experiment's name (see tridens ls)")
    p.add_argument("trial", nargs="?", type=int, default=None,
                   help="a trial's number as tables show it: print that trial in full")
    _output_options(p)
    p.set_defaults(fn=_cmd_show)
    p = sub.add_parser("top", parents=[common], help="the best trials of an experiment")
    p.add_argument("name", help="the experiment's name (see tridens ls)")
    p.add_argument("-k", type=int, default=10, help="how many trials to show, best first (default: %(default)s)")
    _output_options(p)
    p.set_defaults(fn=_cmd_top)
    p = sub.add_parser("export", parents=[common], help="export the best models")
    p.add_argument("name", help="the experiment's name (see tridens ls)")
    p.add_argument("--top", type=int, default=1, help="how many of the best models to export (default: %(default)s)")
    p.add_argument("--to", required=True, help="the directory to write them to (one rank{r}-trial{n} folder each)")
    p.add_argument("--force", action="store_true", help="replace the tridens exports in a non-empty --to directory")
    p.add_argument("--trust-code", action="store_true",
                   help="import the script the store names as the experiment's space (it runs that file) to "
                        "export a self-contained program; only for a store whose code you trust")
    p.add_argument("--allow-module", action="append", default=[], metavar="MODULE",
                   help="a module (with its submodules) the stored space may be imported from, to export a "
                        "self-contained program (repeatable); no other module the store names is imported")
    p.set_defaults(fn=_cmd_export)
    p = sub.add_parser("resume", parents=[common], help="finish an interrupted experiment")
    p.add_argument("name", help="the experiment's name (see tridens ls)")
    p.add_argument("--script", default=None,
                   help="the script the experiment records, confirming that it is yours and may run (tridens "
                        "resume NAME without it shows the command it would run)")
    p.set_defaults(fn=_cmd_resume)
    p = sub.add_parser("dashboard", parents=[common], help="a web dashboard over the store (live while a run writes it)")
    p.add_argument("--port", type=int, default=8765, help="the port to listen on (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default: %(default)s, this machine only; another address "
                        "lets others read the store and prints a warning)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a name browsers reach the dashboard by, accepted as the Host header besides --host, "
                        "localhost and 127.0.0.1 (repeatable); other Host headers get 403")
    p.set_defaults(fn=_cmd_dashboard)
    p = sub.add_parser("plot", parents=[common], help="learning curves and the objective vs each label, to an image file")
    p.add_argument("name", help="the experiment's name (see tridens ls)")
    p.add_argument("--to", required=True, help="the image file to write (.png, .pdf or .svg)")
    p.add_argument("--metric", default=None, help="the metric of the learning curves (default: the objective's)")
    p.set_defaults(fn=_cmd_plot)
    p = sub.add_parser("export-optuna", parents=[common], help="write an experiment as an Optuna study")
    p.add_argument("name", help="the experiment's name (see tridens ls)")
    p.add_argument("--to", required=True, help="the Optuna storage URL, e.g. sqlite:///optuna.db")
    p.add_argument("--study", default=None, help="the study's name (default: the experiment's)")
    p.set_defaults(fn=_cmd_export_optuna)

    p = sub.add_parser("clean-stages", parents=[common],
                       help="remove stage-tree checkpoints that no pending, running or interrupted trial needs")
    p.add_argument("--keep", type=_bytes, default=0, metavar="SIZE",
                   help="keep the most recently used of the others up to SIZE, e.g. 1GiB (default: 0, none)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.set_defaults(fn=_cmd_clean_stages)
    return parser


def _reader_left() -> int:
    """The reader of stdout closed it (``tridens top --json | head``): end quietly with SIGPIPE's
    status, as Unix tools do; stdout points at the null device so that the interpreter's last flush
    does not fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)
    return 128 + 13


def main(argv: Sequence[str] | None = None) -> int:
    from .text import printable

    args = _parser().parse_args(argv)
    try:
        code = int(args.fn(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return _reader_left()
    except (TridensError, OSError) as err:
        message = printable(" ".join(str(err).split()))
        print(f"tridens: error: {message}", file=sys.stderr)
        return 1
    except Exception as err:  # a fault not foreseen above: one line too, the traceback on request
        if os.environ.get("TRIDENS_DEBUG"):
            raise
        message = printable(" ".join(str(err).split()))
        print(f"tridens: error: {type(err).__name__}: {message} (set TRIDENS_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # Ctrl-C: one line (the engine's names the command that resumes)
        print(f"tridens: {err or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
