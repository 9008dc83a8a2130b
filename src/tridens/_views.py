"""What the ``tridens`` command shows of trials besides the live table: one trial in full, rows for
``--json`` and ``--csv``, sparklines, and the matplotlib figure of ``tridens plot``."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Sequence

from .text import markup_text, plot_text, printable
from .trial import Objective, Trial, TrialStatus, warm_start_parent

__all__ = ["trial_record", "csv_text", "trials_csv", "metrics_csv", "sparkline", "trial_details", "plot_experiment",
           "number_trials", "stage_tree_view"]

_BLOCKS = "▁▂▃▄▅▆▇█"


def _clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become None, containers recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _numbers_text(numbers: Sequence[int], most: int = 8) -> str:
    shown = " ".join(f"#{n}" for n in numbers[:most])
    return shown + (f" +{len(numbers) - most}" if len(numbers) > most else "")


def stage_tree_view(stages: Sequence[Any], numbers: dict[int, int], experiment: str, *, most: int = 200) -> Any:
    """The stage tree of an experiment (``tridens.store.stage_tree`` records) as a rich ``Tree``:
    one line per stage with its epochs, learning rates, batch sizes, trials and checkpoint.

    >>> stage_tree_view([], {}, "search").label
    'stage tree: no stages'
    """
    from rich.tree import Tree

    if not stages:
        return Tree("stage tree: no stages")
    ids = {s.id for s in stages}
    children: dict[Any, list[Any]] = {}
    for s in stages:
        children.setdefault(s.parent if s.parent in ids else None, []).append(s)
    trained_here = sum(s.epochs[1] - s.epochs[0] for s in stages if s.experiment == experiment)
    reused = sum(s.epochs[1] - s.epochs[0] for s in stages if s.experiment != experiment)
    tree = Tree(f"[bold]stage tree[/]: {len(stages)} stages, {trained_here} epoch(s) trained here"
                + (f", {reused} reused from other experiments" if reused else ""))
    count = 0

    def line(s: Any) -> str:
        hp = s.hyperparameters
        lr = hp.get("lr") or []
        lr_text = "" if not lr else (f"lr {lr[0]:.3g}" if lr[0] == lr[-1] else f"lr {lr[0]:.3g}→{lr[-1]:.3g}")
        bs = hp.get("batch_size") or []
        parts = [f"#{s.id} epochs {s.epochs[0]}–{s.epochs[1]}", lr_text,
                 ("bs " + "/".join(str(b) for b in bs)) if bs else "",
                 _numbers_text(sorted(numbers[t] for t in s.trials if t in numbers))]
        if s.status == "failed":
            parts.append(f"[red]failed[/]: {markup_text(s.error or '')}")
        elif s.checkpoint is None:
            parts.append("[dim]checkpoint removed[/]")
        if s.experiment != experiment:
            parts.append(f"[cyan]from {markup_text(repr(s.experiment))}[/]")
        return " · ".join(markup_text(p) if i < 4 else p for i, p in enumerate(parts) if p)

    def add(branch: Any, parent: Any) -> None:
        nonlocal count
        for s in children.get(parent, []):
            count += 1
            if count > most:
                return
            add(branch.add(line(s)), s.id)

    add(tree, None)
    if count > most:
        tree.add(f"... {len(stages) - most} more stages (tridens show NAME N lists a trial's)")
    return tree


def number_trials(trials: Sequence[Trial]) -> dict[int, int]:
    """Store id -> the trial's number in its experiment (0, 1, ... in id order), as tables show it."""
    return {t.id: t.number if t.number is not None else i for i, t in enumerate(sorted(trials, key=lambda t: t.id))}


def trial_record(trial: Trial, number: int | None = None) -> dict[str, Any]:
    """Every stored field of a trial as plain JSON data (what ``--json`` prints).

    >>> trial_record(Trial(3, {"lr": 0.1}, seed=7, metric=float("nan")), number=0)["metric"] is None
    True
    """
    return _clean({
        "number": number, "id": trial.id, "experiment": trial.experiment, "status": trial.status.value,
        "role": trial.role,
        "metric": trial.metric, "sample": trial.sample, "seed": trial.seed, "fingerprint": trial.fingerprint,
        "epochs": trial.steps, "metrics": trial.metrics, "params": trial.info.get("params"),
        "flops": trial.info.get("flops"), "group": trial.group, "parent": trial.parent,
        "started_at": trial.started_at, "finished_at": trial.finished_at, "duration": trial.duration,
        "checkpoint": trial.checkpoint, "error": trial.error, "info": trial.info,
    })


# What a spreadsheet reads as the start of a formula (OWASP's list: = + - @, tab, carriage return).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_text(text: str) -> str:
    """A text cell of ``--csv`` output (a label, an error line, a JSON value) made safe to open:
    control characters written as escapes (:func:`~tridens.text.printable`), and a cell a
    spreadsheet would run as a formula prefixed with ``'`` (numbers such as ``-0.5`` stay as they are).

    >>> csv_text("=1+2"), csv_text("-0.5"), csv_text("lr")
    ("'=1+2", '-0.5', 'lr')
    """
    text = printable(text)
    if text.startswith(_FORMULA_START):
        try:
            float(text)
        except ValueError:
            return "'" + text
    return text


def trials_csv(trials: Sequence[Trial], numbers: dict[int, int]) -> str:
    """One CSV row per trial: number, id, status, metric, epochs, params, flops, seed, fingerprint,
    duration, the last line of its error, its one-shot role, then one column per label (values as JSON)."""
    labels: list[str] = []
    for t in trials:
        labels += [k for k in t.sample if k not in labels]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["number", "id", "status", "metric", "epochs", "params", "flops", "seed", "fingerprint",
                     "duration", "error", "role", *[csv_text(label) for label in labels]])
    for t in trials:
        metric = None if t.metric is None or math.isnan(t.metric) else t.metric
        error = t.error.strip().splitlines()[-1] if t.error and t.error.strip() else ""
        writer.writerow([numbers.get(t.id), t.id, t.status.value, "" if metric is None else repr(metric), t.steps,
                         csv_text(str(t.info.get("params", ""))), csv_text(str(t.info.get("flops", ""))), t.seed,
                         csv_text(t.fingerprint or ""), "" if t.duration is None else f"{t.duration:.3f}",
                         csv_text(error), t.role or "", *["" if k not in t.sample else csv_text(json.dumps(t.sample[k]))
                                            for k in labels]])
    return out.getvalue()


def metrics_csv(trial: Trial) -> str:
    """A trial's per-step metrics as CSV: ``step`` then one column per metric."""
    names = sorted(trial.metrics)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *[csv_text(n) for n in names]])
    for step in range(trial.steps):
        values = [trial.metrics[n][step] if step < len(trial.metrics[n]) else "" for n in names]
        writer.writerow([step, *["" if isinstance(v, float) and math.isnan(v) else v for v in values]])
    return out.getvalue()


def sparkline(values: Sequence[float]) -> str:
    """Values as a line of block characters, lowest ``▁`` to highest ``█`` (NaN as a space).

    >>> sparkline([0.1, 0.5, 0.9])
    '▁▅█'
    """
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return " " * len(values)
    low, high = min(finite), max(finite)
    span = high - low
    chars = []
    for v in values:
        if v is None or not math.isfinite(v):
            chars.append(" ")
        else:
            chars.append(_BLOCKS[0 if span == 0 else round((v - low) / span * (len(_BLOCKS) - 1))])
    return "".join(chars)


def trial_details(trial: Trial, trials: Sequence[Trial], objective: Objective) -> list[Any]:
    """Rich renderables that show one trial in full: facts, sample, per-step metrics with
    sparklines, what it trained with or started from, checkpoint and error traceback."""
    from rich.table import Table
    from rich.text import Text

    numbers = number_trials(trials)
    by_id = {t.id: t for t in trials}
    number = numbers.get(trial.id)

    def ref(tid: Any) -> str:
        return f"#{numbers[tid]}" if isinstance(tid, int) and tid in numbers else f"id {tid}"

    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold", no_wrap=True)
    facts.add_column(overflow="fold")
    metric = "-" if trial.metric is None or math.isnan(trial.metric) else f"{trial.metric:.6g}"
    rows: list[tuple[str, str]] = [
        ("status", trial.status.value), (objective.metric, metric), ("seed", str(trial.seed)),
        ("fingerprint", trial.fingerprint or "-"), ("store id", str(trial.id)),
        ("params", "-" if trial.info.get("params") is None else f"{trial.info['params']:,}"),
        ("FLOPs", "-" if trial.info.get("flops") is None else f"{trial.info['flops']:,}"),
        ("epochs", str(trial.steps)),
        ("duration", "-" if trial.duration is None else f"{trial.duration:.2f} s"),
    ]
    if trial.info.get("precision") is not None:
        rows.append(("precision", str(trial.info["precision"])))
    if trial.info.get("train_seconds") is not None:
        rows.append(("training seconds", f"{trial.info['train_seconds']:.2f}"))
    if trial.group is not None:
        mates = [ref(t.id) for t in trials if t.group == trial.group and t.id != trial.id]
        rows.append(("group", f"{trial.group}" + (f", trained with {', '.join(mates[:30])}"
                                                  + (" ..." if len(mates) > 30 else "") if mates else " (alone)")))
    unit = trial.info.get("unit")
    if isinstance(unit, dict):  # the planner's record: kind, the trials trained with it, why, decisions
        members = unit.get("ids") or unit.get("trials") or []  # store ids ("trials" by number where "ids" is kept)
        with_ = [ref(t) for t in members if t != trial.id]
        text = f"{unit.get('kind', '?')} unit" + (f" with {', '.join(with_[:30])}" + (" ..." if len(with_) > 30 else "")
                                                   if with_ else " (alone)")
        text += "".join(f"; {part}" for part in [unit.get("reason"), *(unit.get("shared") or [])] if part)
        text += "".join(f"; measured {e['speedup']:.2f}x, {'fused' if e.get('fused') else 'trained separately'}"
                        for e in unit.get("speedups") or []
                        if (trial.label if "ids" in unit else trial.id) in (e.get("trials") or []))
        rows.append(("execution unit", text))
    elif unit:
        rows.append(("execution unit", json.dumps(unit)))
    warm = trial.info.get("warm_start")
    if warm:
        parent = warm.get("parent")
        rows.append(("warm start", "cold (no zoo model matched)" if parent is None else
                     f"from {ref(parent) if parent in by_id else warm_start_parent(warm, trial.experiment)} "
                     f"(match score {warm.get('score', 0):.2f})"))
    if trial.parent is not None:
        rows.append(("parent", ref(trial.parent)))
    children = [ref(t.id) for t in trials if t.parent == trial.id]
    if children:
        rows.append(("children", ", ".join(children)))
    stages = trial.info.get("stages")
    if stages:
        mates = {node: [ref(t.id) for t in trials if t.id != trial.id
                        and any(s[0] == node for s in t.info.get("stages") or ())] for node, _, _ in stages}
        rows.append(("stages", "; ".join(
            f"from epoch {epoch}: node {node}" + (f" shared with {', '.join(mates[node][:12])}"
                                                  + (" ..." if len(mates[node]) > 12 else "") if mates[node] else "")
            for node, _, epoch in stages)))
    exploits = trial.info.get("exploits")
    if exploits:  # PBT: whose state it continued from, and the hyperparameters it took
        rows.append(("exploits", "; ".join(
            f"at epoch {e['epoch']} copied {ref(e['from'])}, then "
            + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={json.dumps(v)}" for k, v in e["sample"].items())
            for e in exploits)))
    if trial.info.get("duplicate_of") is not None:
        rows.append(("duplicate of", ref(trial.info["duplicate_of"])))
    rows.append(("checkpoint", trial.checkpoint or "-"))
    for key, value in rows:
        facts.add_row(markup_text(key), markup_text(value))
    sample = Table(title="sample", show_header=False, box=None, title_justify="left")
    sample.add_column(style="bold", no_wrap=True)
    sample.add_column(overflow="fold")
    for key, value in trial.sample.items():
        sample.add_row(markup_text(key), markup_text(json.dumps(value)))
    out: list[Any] = [Text(printable(f"trial #{number} of {trial.experiment}"), style="bold"), facts, sample]
    if trial.metrics:
        names = sorted(trial.metrics, key=lambda n: (n != objective.metric, n))
        curves = Table(title="metrics per step", title_justify="left")
        curves.add_column("step", justify="right")
        for name in names:
            curves.add_column(markup_text(name), justify="right")
        for step in range(trial.steps):
            cells = []
            for name in names:
                values = trial.metrics[name]
                cells.append("" if step >= len(values) else ("nan" if math.isnan(values[step]) else f"{values[step]:.4f}"))
            curves.add_row(str(step), *cells)
        out.append(curves)
        spark = Table(show_header=False, box=None)
        spark.add_column(style="bold", no_wrap=True)
        spark.add_column(overflow="fold")
        for name in names:
            spark.add_row(markup_text(name), sparkline(trial.metrics[name]))
        out.append(spark)
    if trial.error:
        out += [Text("error", style="bold red"), Text(printable(trial.error.rstrip()))]
    return out


def plot_experiment(trials: Sequence[Trial], objective: Objective, path: str | Path, *, metric: str | None = None,
                    title: str = "", log_labels: Sequence[str] = ()) -> Path:
    """Write a figure of an experiment to ``path`` (format from its suffix: png, pdf, svg):
    :func:`experiment_figure`."""
    import matplotlib.pyplot as plt

    fig = experiment_figure(trials, objective, metric=metric, title=title, log_labels=log_labels)
    target = Path(path)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


# Up to this many curves each gets its own legend entry; more are coloured by their final value.
LEGEND_CURVES = 12


def experiment_figure(trials: Sequence[Trial], objective: Objective, *, metric: str | None = None,
                      title: str = "", log_labels: Sequence[str] = ()) -> Any:
    """A matplotlib figure of an experiment: the learning curves of ``metric`` (default: the
    objective's) of every trial, stopped trials dashed and failed ones dotted, and the objective
    against each label, on a log axis for ``log_labels`` (``td.loguniform`` labels). With more than
    :data:`LEGEND_CURVES` curves, each is coloured by its final value (a colour bar says which) and
    the legend names the five best and how many more there are.

    >>> fig = experiment_figure(exp.trials(), Objective("val_acc", "max"), log_labels=["lr"])  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    metric = metric or objective.metric
    finished = [t for t in trials if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED)
                and t.metric is not None and not math.isnan(t.metric)]
    labels: list[str] = []
    for t in finished:
        labels += [k for k in t.sample if k not in labels]
    panels = 1 + len(labels)
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    ax = axes[0][0]
    numbers = number_trials(trials)
    styles = {TrialStatus.COMPLETED: "-", TrialStatus.STOPPED: "--", TrialStatus.FAILED: ":"}
    drawn = [t for t in trials if t.metrics.get(metric)]
    many = len(drawn) > LEGEND_CURVES
    finals = [t.metrics[metric][-1] for t in drawn]
    shown = [v for v in finals if v is not None and math.isfinite(v)]
    norm = matplotlib.colors.Normalize(min(shown, default=0.0), max(shown, default=1.0))
    cmap = matplotlib.colormaps["viridis"]
    best = {t.id for t in sorted(drawn, key=lambda t: -objective.score(t.metrics[metric][-1]))[:5]} if many else set()
    named: list[tuple[float, Any]] = []
    for t in sorted(drawn, key=lambda t: t.id in best):  # the named best drawn last, on top
        values = t.metrics[metric]
        final = values[-1]
        color = (cmap(norm(final)) if final is not None and math.isfinite(final) else "grey") if many else None
        name = f"#{numbers[t.id]} ({final:.4g})" if many else f"#{numbers[t.id]}"
        line, = ax.plot(range(len(values)), values, styles.get(t.status, "-"), color=color,
                        marker="." if len(values) < 30 else None, linewidth=1.6 if t.id in best else 1,
                        alpha=0.9 if t.id in best or not many else 0.5,
                        label=name if not many or t.id in best else None)
        if t.id in best:
            named.append((objective.score(final), line))
        if t.status is TrialStatus.STOPPED:
            ax.plot([len(values) - 1], [values[-1]], "x", color="black", markersize=5)
    ax.set_xlabel("step (epoch)")
    ax.set_ylabel(plot_text(metric))
    ax.set_title("learning curves (dashed, x: stopped early)", fontsize=9)
    if many:
        fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=f"final {plot_text(metric)}")
        lines = [line for _, line in sorted(named, key=lambda e: -e[0])]
        extra = matplotlib.lines.Line2D([], [], color="grey", alpha=0.5, label=f"{len(drawn) - len(best)} more trials")
        ax.legend(lines + [extra], [line.get_label() for line in lines] + [extra.get_label()],
                  fontsize=7, title=f"best {len(best)} of {len(drawn)}", title_fontsize=7)
    elif drawn:
        ax.legend(fontsize=7, ncol=2 if len(drawn) > 6 else 1)
    for i, label in enumerate(labels, start=1):
        ax = axes[i // cols][i % cols]
        xs = [t.sample.get(label) for t in finished]
        ys = [t.metric for t in finished]
        kept = [(x, y) for x, y in zip(xs, ys) if x is not None]
        if kept and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x, _ in kept):
            ax.scatter([x for x, _ in kept], [y for _, y in kept], s=12, alpha=0.7)
            if label in log_labels and all(x > 0 for x, _ in kept):
                ax.set_xscale("log")
        else:
            cats = sorted({json.dumps(x) for x, _ in kept})
            ax.scatter([cats.index(json.dumps(x)) for x, _ in kept], [y for _, y in kept], s=12, alpha=0.7)
            ax.set_xticks(range(len(cats)), [plot_text(c) for c in cats], rotation=30, fontsize=7)
        ax.set_xlabel(plot_text(label) + (" (log scale)" if ax.get_xscale() == "log" else ""))
        ax.set_ylabel(plot_text(objective.metric))
    for j in range(panels, rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    if title:
        fig.suptitle(plot_text(title))
    fig.tight_layout()
    return fig
