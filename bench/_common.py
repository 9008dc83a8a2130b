"""Helpers shared by the engine benchmarks (bookkeeping, random_search, nb201_quality).

Every compared system runs in its own fresh Python process (``python bench/X.py --one NAME ...``,
printing one JSON line), so imports, Ray's runtime and allocator state never leak from one
measurement into the next; the driver runs the systems interleaved (A B C A B C ...) and reports
medians. The machine these were written on has 2 cores and is shared, hence the repeats.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import platform
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata
from typing import Any, Callable, Iterable, Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Benchmarks measure the batching planner's decisions in every run (no user cache file read),
# unless a benchmark names a cache file itself (bench/headline.py's tridens-cached); child
# processes inherit this.
os.environ.setdefault("TRIDENS_DECISION_CACHE", "off")


def version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def source() -> str:
    """Where ``tridens`` is imported from, and the commit of the checkout it is in."""
    import importlib.util

    spec = importlib.util.find_spec("tridens")
    path = os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else "?"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=path, check=False).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], capture_output=True, text=True,
                               cwd=path, check=False).stdout.strip()
    except OSError:
        commit, dirty = "", ""
    label = os.environ.get("BENCH_SOURCE_LABEL")  # e.g. the commit of an exported snapshot
    return f"{path} @ {commit or label or 'no git'}{' + uncommitted changes' if dirty else ''}"


def machine() -> dict[str, Any]:
    """What BENCHMARKS.md records next to every figure."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "optuna": version("optuna"),
        "ray": version("ray"),
        "tridens": version("tridens"),
        "loadavg": [round(x, 2) for x in load],
        "source": source(),
    }


def print_machine() -> None:
    m = machine()
    print(f"machine: nproc={m['nproc']}, cpu={m['cpu']!r}, python {m['python']}, torch {m['torch']}, "
          f"optuna {m['optuna']}, ray {m['ray']}, tridens {m['tridens']}, load average {m['loadavg']}")
    print(f"tridens source: {m['source']}")


def rss_mb() -> float:
    """Resident set size of this process, MB (from /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def emit(result: Mapping[str, Any]) -> None:
    """The one JSON line a ``--one`` worker prints last."""
    sys.stdout.flush()
    print("RESULT " + json.dumps(dict(result)), flush=True)


def run_worker(script: str, args: Sequence[str], *, env: Mapping[str, str] | None = None,
               timeout: float | None = None) -> dict[str, Any]:
    """Run ``python script args`` in a fresh process; return the JSON of its ``RESULT`` line."""
    cmd = [sys.executable, script, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def interleave(names: Sequence[str], repeats: int, one: Callable[[str, int], dict[str, Any]],
               *, log: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Run ``one(name, repeat)`` for every name, ``repeats`` rounds, A B C A B C ...;
    the order inside a round rotates each round so no system always runs first."""
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(repeats):
        order = list(names[r % len(names):]) + list(names[:r % len(names)])
        for name in order:
            res = one(name, r)
            results[name].append(res)
            if log:
                shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()
                         if not isinstance(v, (list, dict))}
                print(f"  round {r + 1}/{repeats} {name:24s} {shown}", flush=True)
    return results


def median(values: Iterable[float]) -> float:
    values = [v for v in values]
    return statistics.median(values) if values else float("nan")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (also readable on a terminal)."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else _fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells[1:]]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


class ProcessTreeClock:
    """CPU-seconds of this process and of every descendant seen, sampled every ``interval`` s by a
    daemon thread. A direct child that has exited and been waited for counts exactly, with what the
    kernel adds to this process's children times (its own waited-for descendants included); any
    other descendant counts with the CPU it had when last seen, so a worker that exits before the
    end (a Ray worker whose trial is done) keeps what it spent -- at most ``interval`` s of CPU per
    such process is missed. The samples (wall, CPU) place events known only by their wall time on
    the CPU axis (:meth:`cpu_at`).
    """

    def __init__(self, interval: float = 0.1):
        import threading

        import psutil

        self._psutil = psutil
        self.proc = psutil.Process()
        self.interval = interval
        self.last: dict[int, float] = {}
        self.parent: dict[int, int] = {}   # descendant pid -> its parent's pid
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def cpu(self) -> float:
        """CPU-seconds so far: this process, its waited-for children, and every other descendant
        as last seen."""
        live = set()
        for child in self.proc.children(recursive=True):
            try:
                t = child.cpu_times()
                self.parent.setdefault(child.pid, child.ppid())
                self.last[child.pid] = t.user + t.system
                live.add(child.pid)
            except self._psutil.Error:
                pass
        own = self.proc.cpu_times()   # read after them: a child that exits in between counts twice, in this sample only
        for pid in [p for p in self.last if p not in live and self.parent.get(p) == self.proc.pid]:
            self._forget(pid)          # a direct child gone: counted in the children times now
        return own.user + own.system + own.children_user + own.children_system + sum(self.last.values())

    def _forget(self, pid: int) -> None:
        """Drop ``pid`` and its descendants as last seen (their CPU is in its children times)."""
        self.last.pop(pid, None)
        for child in [p for p, parent in self.parent.items() if parent == pid]:
            self._forget(child)
        self.parent.pop(pid, None)

    def mark(self) -> tuple[float, float]:
        sample = (time.time(), self.cpu())
        self.samples.append(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.mark()

    def start(self) -> "ProcessTreeClock":
        self.mark()
        self._thread.start()
        return self

    def stop(self) -> tuple[float, float]:
        """Stop sampling; the last sample (wall, CPU)."""
        self._stop.set()
        self._thread.join()
        return self.mark()

    def elapsed_cpu(self) -> float:
        """CPU-seconds between the first and the last sample."""
        return self.samples[-1][1] - self.samples[0][1]

    def cpu_at(self, wall: float) -> float:
        """CPU-seconds at wall time ``wall`` (linear between the samples around it)."""
        s = self.samples
        if wall <= s[0][0]:
            return s[0][1]
        for (w0, c0), (w1, c1) in zip(s, s[1:]):
            if w0 <= wall <= w1:
                return c0 + (c1 - c0) * (wall - w0) / max(w1 - w0, 1e-9)
        return s[-1][1]


# -- CPU of a whole process tree (Ray daemons and workers included) -----------------------------------
def become_subreaper() -> None:
    """Orphans of our descendants (Ray's workers once its daemons stop) are re-parented to us and
    stay in the tree we sample."""
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every live descendant of this process, from /proc."""
    parent, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry)] = int(fields[1])
            cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / _TICK
    me, out = os.getpid(), {}
    for pid in cpu:
        p, seen = pid, 0
        while p in parent and p != me and seen < 64:
            p, seen = parent[p], seen + 1
        if p == me and pid != me:
            out[pid] = cpu[pid]
    return out


def reap_all(grace: float = 30.0) -> int:
    """Wait for every remaining descendant (SIGKILL after ``grace`` seconds); the count killed."""
    deadline, killed = time.monotonic() + grace, 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return killed
        if pid == 0:
            if time.monotonic() > deadline:
                for child in tree_cpu():
                    os.kill(child, signal.SIGKILL)
                    killed += 1
                deadline = time.monotonic() + grace
            time.sleep(0.05)


def measure_tree(script: str, args: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
    """One run in a fresh process; CPU seconds of its whole process tree, sampled every 0.1 s from
    /proc (Ray's raylet reaps its workers without accounting, so getrusage(RUSAGE_CHILDREN) misses
    them; a process's last < 0.1 s before it exits can be missed here)."""
    last: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            last.update(tree_cpu())
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        result = run_worker(script, args, env=env, timeout=1800)
    finally:
        result_s = time.perf_counter() - t0
        done.set()
        sampler.join()
    result["process_s"] = result_s
    result["killed_leftovers"] = reap_all()
    result["cpu_s"] = sum(last.values())
    result["processes"] = len(last)
    return result
