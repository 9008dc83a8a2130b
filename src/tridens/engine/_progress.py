"""A progress bar and a live table of the best trials (rich), or one log line per trial when the
output is not a terminal."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Sequence

from ..text import markup_text, printable
from ..trial import Objective, Trial, TrialStatus, warm_start_parent

__all__ = ["Progress", "format_value", "print_stopped", "trials_table", "warm_start_text"]


def trials_table(trials: list[Trial], objective: Objective, title: str = "", *, full_samples: bool = False,
                 compact: bool = False) -> Any:
    """A rich Table of trials: id, status, (a one-shot run's role,) objective, fingerprint, sample.

    A long sample is shortened with "..." unless ``full_samples`` (output that is not a terminal,
    read by scripts, shows it whole); ``compact`` leaves out the epochs and fingerprint columns so
    that samples keep room at 80 columns (they wrap between labels)."""
    from rich.table import Table

    table = Table(title=markup_text(title) if title else None, show_lines=False)
    warm = any("warm_start" in t.info for t in trials)  # the column only for warm-started experiments
    roles = any(t.role for t in trials)  # one-shot: supernet-scored or retrained
    dropped = ("epochs", "fingerprint") if compact else ()
    # the precision column only where some trial trains in a mixed precision
    mixed = any(t.info.get("precision", "32-true") != "32-true" for t in trials)
    columns = (("trial", "status") + (("role",) if roles else ()) + (objective.metric, "epochs", "params", "fingerprint")
               + (("warm start",) if warm else ()) + (("precision",) if mixed else ()) + ("sample",))
    for col in columns:
        if col not in dropped:
            table.add_column(markup_text(col), overflow="fold")
    for t in trials:
        metric = "-" if t.metric is None or (isinstance(t.metric, float) and math.isnan(t.metric)) else f"{t.metric:.4f}"
        params = t.info.get("params")
        row = [str(t.label), t.status.value, metric, str(t.steps), "-" if params is None else f"{params:,}",
               (t.fingerprint or "")[:10]]
        if warm:
            row.append(warm_start_text(t))
        if mixed:
            row.append(str(t.info.get("precision", "-")))
        if compact:
            del row[5], row[3]  # fingerprint, epochs
        if roles:
            row.insert(2, t.role or "-")
        table.add_row(*map(markup_text, [*row, _short_sample(t.sample, None if full_samples else 90)]))
    return table


def warm_start_text(trial: Trial) -> str:
    """``from #3 (0.83)`` for a trial warm-started from trial number 3 of its own experiment
    (match score 0.83), ``from search-a #3 (0.83)`` from another experiment's, ``cold`` when no
    zoo model matched. A zoo model that is no trial (``Zoo.add``) is named by its zoo entry.

    >>> t = Trial(id=9, sample={}, seed=0, experiment="b", info={"warm_start": {
    ...     "parent": 4, "parent_experiment": "a", "parent_number": 3, "score": 0.834}})
    >>> warm_start_text(t)
    'from a #3 (0.83)'
    """
    ws = trial.info.get("warm_start")
    if not ws:
        return "-"
    if ws.get("parent") is None:
        return "cold"
    return f"from {warm_start_parent(ws, trial.experiment)} ({ws.get('score', 0):.2f})"


def format_value(value: Any) -> str:
    """A sample value as a table shows it: floats to 4 significant digits (``0.00835``), the rest as repr.

    >>> format_value(0.008349655452891392), format_value(3), format_value("conv")
    ('0.00835', '3', "'conv'")
    """
    if isinstance(value, float):
        return f"{value:.4g}"
    return repr(value)


def _short_sample(sample: dict[str, Any], limit: int | None = 90) -> str:
    text = ", ".join(f"{k}={format_value(v)}" for k, v in sample.items())
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


class _TrainingLine:
    """The live view's training status, read from the bar's task at each refresh."""

    def __init__(self, bar: Any, task: Any) -> None:
        self.bar, self.task = bar, task

    def __rich__(self) -> Any:
        from rich.text import Text

        return Text(printable(str(self.bar.tasks[0].fields.get("training", ""))) if self.bar.tasks else "",
                    overflow="fold")


class Progress:
    # Trials of a fused unit or a long group finish together, so epochs are shown as they arrive:
    # in the live bar, or (not a terminal) one summary line at most every STEP_LINE_S seconds.
    STEP_LINE_S = 30.0

    def __init__(self, total: int | None, objective: Objective, enabled: bool = True):
        self.total, self.objective, self.enabled = total, objective, enabled
        self.best: list[Trial] = []
        self.done = 0
        self._live: Any = None
        self._training: dict[int, tuple[int, float]] = {}  # trial id -> (last step, its objective value)
        self._last_line = time.monotonic()

    def start(self, name: str, done: int, resumed: bool, finished: Sequence[Trial] = ()) -> None:
        """Show the experiment ``name`` with ``done`` trials counted; ``finished`` (the trials of an
        earlier run, on resume) fill the table of best trials, so the view is the experiment's."""
        self.name, self.done = name, done
        self.best = _best(list(finished), self.objective)
        if not self.enabled:
            return
        from rich.console import Console

        self.console = Console(stderr=True)
        if resumed:
            self.console.print(f"[bold]tridens[/]: resuming {markup_text(repr(name))} with {done} finished trials")
        if self.console.is_terminal:
            from rich.live import Live
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            from rich.table import Column

            # The training status on a line of its own: at 80 columns the bar keeps its width.
            self.bar = Bar(TextColumn(f"[bold]{markup_text(name)}", table_column=Column(overflow="fold", max_width=24)),
                           BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn())
            self.task = self.bar.add_task(name, total=self.total, completed=done, training="")
            self._live = Live(self._render(), console=self.console, refresh_per_second=4)
            self._live.start()

    def _render(self) -> Any:
        from rich.console import Group

        return Group(self.bar, _TrainingLine(self.bar, self.task),
                     trials_table(self.best, self.objective, title="best trials", compact=self.console.width < 100))

    def step(self, trial: Trial, step: int, value: float) -> None:
        """A trial reported ``value`` (the objective's metric) at ``step`` (an epoch, usually)."""
        self._training[trial.id] = (step, value)
        if not self.enabled:
            return
        if self._live is not None:
            self.bar.update(self.task, training=self._training_text())
        elif time.monotonic() - self._last_line >= self.STEP_LINE_S:
            self._last_line = time.monotonic()
            total = "?" if self.total is None else self.total
            print(printable(f"[{self.name}] {self.done}/{total} trials done; {self._training_text()}"),
                  file=sys.stderr, flush=True)

    def _training_text(self) -> str:
        if not self._training:
            return ""
        steps = [s for s, _ in self._training.values()]
        values = [v for _, v in self._training.values() if not math.isnan(v)]
        values += [self.best[0].metric] if self.best and self.best[0].metric is not None else []
        best = f", best {self.objective.metric} so far {max(values, key=self.objective.score):.4f}" if values else ""
        return f"{len(self._training)} training, at step {min(steps)}-{max(steps)}{best}"

    def trial_done(self, trial: Trial) -> None:
        self._training.pop(trial.id, None)
        if trial.status in _COUNTED:
            self.done += 1
        if trial.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED) and trial.metric is not None:
            self.best = _best(self.best + [trial], self.objective)
        if not self.enabled:
            return
        if self._live is not None:
            self.bar.update(self.task, completed=self.done, training=self._training_text())
            self._live.update(self._render())
        else:
            metric = "-" if trial.metric is None else f"{trial.metric:.4f}"
            total = "?" if self.total is None else self.total
            best = self.best[0].metric if self.best else None
            warm = f" warm-start {warm_start_text(trial)}" if "warm_start" in trial.info else ""
            print(printable(f"[{self.name}] {self.done}/{total} trial {trial.label} {trial.status.value} "
                            f"{self.objective.metric}={metric} best={'-' if best is None else f'{best:.4f}'}{warm}"),
                  file=sys.stderr, flush=True)

    def close(self, reason: str | None = None) -> None:
        """End the live view; ``reason`` (why the run stopped) is printed as the last line."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        if reason and self.enabled:
            print_stopped(self.name, reason)


def print_stopped(name: str, reason: str) -> None:
    """The last line of a run, multi-trial or one-shot: why experiment ``name`` stopped."""
    print(printable(f"[{name}] stopped: {reason}"), file=sys.stderr, flush=True)


def _best(trials: list[Trial], objective: Objective, k: int = 5) -> list[Trial]:
    scored = [t for t in trials if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED)
              and t.metric is not None and not math.isnan(t.metric)]
    return sorted(scored, key=lambda t: (-objective.score(t.metric), t.id))[:k]


_COUNTED = (TrialStatus.COMPLETED, TrialStatus.STOPPED, TrialStatus.FAILED)
