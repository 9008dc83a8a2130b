"""The thread and parallelism policy: torch threads per execution unit, and units run at once.

The user's choice comes first: ``ThreadPolicy(threads=n)``, else a thread count the user gave
torch (``torch.set_num_threads(n)`` with ``n`` other than torch's own default, or
``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` in the environment) is the count every unit trains
with, one unit at a time unless ``concurrent`` says otherwise. A count equal to torch's default
(one thread per physical core) cannot be told from the default: ``ThreadPolicy(threads=n)`` fixes
it then.

Otherwise a machine with no idle core (1-minute load average) gives each unit one thread: a second
OpenMP thread whose partner is descheduled spins, and a loaded machine can take many times longer
with several threads than with one (BENCHMARKS.md, "Figures behind choices in the code"). What
other processes use is read from the machine's busy CPU time (``/proc/stat``) less this process's,
since the last decision (a tenth of a second at the first): the load average lags a minute
behind, and counts the cores this process itself kept busy. With
idle cores, a group's units either train **one at a time on every idle core** or **side by side,
one thread each**, in forked processes (:mod:`._forked`; one per idle core). Which is faster
depends on the models (kernels long enough for threads to pay, or a group that splits well) and
is measured, not assumed, and both options on the same group: the first group of a workload
key (the step's size class, small or large, and the idle cores) times a few training steps of
its largest model on a copy, once on every idle core and once side by side in forked processes
(one thread each, all stepping at once): :func:`probe_thread_options`. Both rates (training FLOPs
per wall second, :func:`step_flops`) are recorded as a pair in the run's
:class:`~tridens.units.Decisions`, and that group and later groups of the key take the option with
the better median. (Timing one group per option instead compared different groups: a grid's groups
hold models of different widths, and small models run far below the peak per FLOP.) A group that
cannot train side by side (one trial, a strategy that forks members, stage trees, no ``fork``)
trains on every idle core.

**Repeatable by default.** Kernels split their sums by thread, so a trial trained on one thread
and on two differs in the last bits, and those differences grow over training. A thread count
that followed the load or a timing would make the same seeded search return different models run
to run. The default policy (``repeatable=True``) therefore trains every unit on one thread and
uses idle cores only by training units side by side (one thread each: the same results); a group
that cannot split trains on one thread. ``ThreadPolicy(repeatable=False)`` lets a unit take every
idle core and chooses between the two options by measurement, as described above.

A policy is an object passed in (``td.executors.Inline(threads=ThreadPolicy(threads=2))``); each
decision is logged (logger ``tridens``) with its reason.

>>> measure = lambda free: {ALONE: 3e9, SIDE: 4e9}     # the group's work per wall second, each option
>>> plan = ThreadPolicy(repeatable=False).decide(step_flops=5e9, units=3, total=2, load=0.0, torch_threads=2,
...                                              default_threads=2, rates={}, measure=measure)
>>> plan.threads, plan.concurrent, plan.option
(1, 2, 'side by side')
"""

from __future__ import annotations

import contextlib
import copy
import functools
import glob
import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, MutableMapping, Sequence

import torch
import torch.nn as nn

from ..graph import forward_flops

__all__ = ["ThreadPolicy", "ThreadPlan", "step_flops", "cores", "shares", "torch_default_threads",
           "user_torch_threads", "workload_key", "unit_sizes", "probe_thread_options", "ALONE", "SIDE"]

log = logging.getLogger("tridens")

ALONE = "every idle core"
"""The option that trains a group's units one at a time, each on every idle core."""
SIDE = "side by side"
"""The option that trains a group's units side by side, one thread each, one per idle core."""


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@functools.cache
def _physical_cores() -> int:
    """Physical cores of the machine (distinct package and core ids in sysfs; ``os.cpu_count()``
    where sysfs does not say), as torch counts them for its default. Read once per process: the
    topology does not change while it runs, and the thread policy asks before every unit."""
    seen = set()
    for topology in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology"):
        try:
            with open(os.path.join(topology, "physical_package_id")) as package, \
                    open(os.path.join(topology, "core_id")) as core:
                seen.add((package.read().strip(), core.read().strip()))
        except OSError:
            continue
    return len(seen) or max(1, os.cpu_count() or 1)


def _env_threads(environ: Mapping[str, str]) -> int | None:
    for name in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):  # torch reads both; MKL's wins
        try:
            value = int(environ.get(name, "").split(",")[0])
        except ValueError:
            continue
        if value > 0:
            return value
    return None


def torch_default_threads(environ: Mapping[str, str] | None = None) -> int:
    """The intra-op thread count torch starts with: ``MKL_NUM_THREADS`` / ``OMP_NUM_THREADS`` where
    set, else one per physical core.

    >>> torch_default_threads({"OMP_NUM_THREADS": "3"})
    3
    """
    env = _env_threads(os.environ if environ is None else environ)
    return env if env is not None else _physical_cores()


def user_torch_threads(current: int | None = None, default: int | None = None,
                       environ: Mapping[str, str] | None = None) -> int | None:
    """The torch thread count the user chose (``current``, default ``torch.get_num_threads()``),
    or None when it is torch's default (``default``: :func:`torch_default_threads`) and no
    ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` is set.

    >>> user_torch_threads(current=1, default=2, environ={}), user_torch_threads(current=2, default=2, environ={})
    (1, None)
    """
    environ = os.environ if environ is None else environ
    current = torch.get_num_threads() if current is None else current
    default = torch_default_threads(environ) if default is None else default
    if _env_threads(environ) is not None or current != default:
        return current
    return None


def idle_cores(total: int | None = None, load: float | None = None) -> int:
    """Cores no other process is using: ``total`` minus the 1-minute load average beyond this
    process's own running thread (at least 1).

    >>> idle_cores(2, load=2.1), idle_cores(2, load=1.3)
    (1, 2)
    """
    total = cores() if total is None else total
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # pragma: no cover - not POSIX
            load = 0.0
    return max(1, min(total, int(total - max(0.0, load - 1.0) + 0.5)))


@dataclass(frozen=True)
class ThreadPlan:
    """What the policy decided: ``threads`` torch threads per unit, ``concurrent`` units at once;
    ``option`` (:data:`ALONE`, :data:`SIDE`, or "" when the user or the load fixed it) and ``key``
    (the workload the option's measurement is recorded under) when it was the policy's choice."""

    threads: int
    concurrent: int
    reason: str
    option: str = ""
    key: tuple[Any, ...] = ()

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the block with ``torch.set_num_threads(self.threads)``, then restore the count."""
        before = torch.get_num_threads()
        if before != self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)


def workload_key(step_flops: float | None, free: int, large_step_flops: float = 2e9) -> tuple[Any, ...]:
    """The key a thread option's measurement is kept under: whether the step is small (under
    ``large_step_flops``), large or of unknown size, and the idle cores. Coarse on purpose: each
    new key costs a group per option to measure, and a search's models mostly fall in one class.

    >>> workload_key(5e7, 2), workload_key(5e9, 2)
    (('threads', 'small', 2), ('threads', 'large', 2))
    """
    size = "unknown" if not step_flops or step_flops <= 0 else "small" if step_flops < large_step_flops else "large"
    return ("threads", size, free)


class ThreadPolicy:
    """Threads per unit and units at once: the user's counts where given (``threads``; else a
    count given to torch: :func:`user_torch_threads`), else from the machine's idle cores and
    measurements of the two ways to use them (see the module docstring).

    ``threads``: torch threads per unit (None: decided); ``concurrent``: units at once (None:
    decided; 1 when the thread count is the user's); ``large_step_flops``: the training step,
    in FLOPs, from which every idle core is tried before side by side (default 2 GFLOP: tens of
    milliseconds at one CPU thread's peak, where kernels are long enough for threads to pay);
    ``repeatable``: one thread per unit whatever the load, idle cores used only side by side, so
    that a seeded search gives the same results run to run (False: a unit may take every idle
    core, chosen by measurement); ``probe``: how both options are timed on one group,
    ``probe(units, idle_cores) -> {ALONE: rate, SIDE: rate}`` in training FLOPs per wall second
    (default :func:`probe_thread_options`; an empty answer leaves the decision to the options'
    order, measured per group as it trains).

    >>> ThreadPolicy().decide(step_flops=1e10, units=4, total=8, load=0.0, torch_threads=8, default_threads=8)
    ThreadPlan(threads=1, concurrent=4, reason='8 idle cores: units side by side, one thread each (repeatable)', option='side by side', key=('threads', 'large', 8))
    >>> ThreadPolicy(repeatable=False).decide(step_flops=1e10, units=4, total=8, load=0.0, torch_threads=8,
    ...                                       default_threads=8)
    ThreadPlan(threads=8, concurrent=1, reason='8 idle cores, every idle core measured first', option='every idle core', key=('threads', 'large', 8))
    >>> ThreadPolicy(threads=1, concurrent=2).decide(step_flops=1e7, units=4).concurrent
    2
    """

    def __init__(self, threads: int | None = None, concurrent: int | None = None, large_step_flops: float = 2e9,
                 repeatable: bool = True,
                 probe: Callable[[Sequence[Any], int], Mapping[str, float]] | None = None):
        self.threads = threads
        self.concurrent = concurrent
        self.large_step_flops = large_step_flops
        self.repeatable = bool(repeatable)
        self.probe = probe_thread_options if probe is None else probe
        self._clock: tuple[float, float, float] | None = None  # (wall, busy CPU s of the machine, of this process)

    def _busy_elsewhere(self) -> float | None:
        """The cores other processes kept busy since the last decision (over a tenth of a second
        at the first): the machine's busy CPU time (``/proc/stat``) less this process's and its
        finished children's, per wall second. None where ``/proc/stat`` cannot be read."""
        now = _cpu_clock()
        if now is None:
            return None
        last, self._clock = self._clock, now
        if last is None or now[0] - last[0] < 0.05:
            time.sleep(0.1)
            last, now = now, _cpu_clock()
            self._clock = now
            if now is None:
                return None
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0]))

    def _check(self) -> None:
        for name in ("threads", "concurrent"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"The '{name}' parameter of ThreadPolicy must be None or an int in the range "
                                 f"[1, inf). Got {value!r} instead.")

    def decide(self, step_flops: float | None, units: int = 1, *, total: int | None = None,
               load: float | None = None, torch_threads: int | None = None, default_threads: int | None = None,
               rates: MutableMapping[tuple[Any, ...], Any] | None = None,
               splittable: bool = True, measure: Callable[[int], Mapping[str, float]] | None = None) -> ThreadPlan:
        """The plan for ``units`` units (or parts a group can be split into) whose largest
        training step is ``step_flops`` FLOPs (None: unknown). ``total`` cores, ``load``,
        ``torch_threads`` (torch's current count) and ``default_threads`` (torch's default)
        default to this machine's and this process's; ``rates``: the measured work per wall
        second of each option (:data:`ALONE`, :data:`SIDE`) by workload (:func:`workload_key`:
        the run's ``Decisions.thread_rates``); ``splittable``:
        whether these units may train side by side at all; ``measure(idle_cores)``: both options'
        rates on this group, called where the workload has none yet and recorded in ``rates``
        as a pair."""
        self._check()
        free = idle_cores(total, load)
        units = max(1, units)
        fixed, why = self.threads, f"threads={self.threads} set by the user"
        if fixed is None:
            fixed = user_torch_threads(torch_threads, default_threads)
            why = f"torch.set_num_threads({fixed}) set by the user"
        if fixed is not None:
            concurrent = 1 if self.concurrent is None else self.concurrent
            return ThreadPlan(fixed, concurrent, f"{why}, {concurrent} at once ({free} idle cores)")
        if self.concurrent is not None:
            threads = max(1, free // self.concurrent)
            return ThreadPlan(threads, self.concurrent,
                              f"concurrent={self.concurrent} set by the user: {threads} thread(s) each "
                              f"on {free} idle cores")
        if free < 2:
            return ThreadPlan(1, 1, f"no idle core beside this one ({max(0.0, _load(load) - 1):.1f} of "
                                    f"{total or cores()} cores busy elsewhere): one thread per unit, 1 at once")
        key = workload_key(step_flops, free, self.large_step_flops)
        if self.repeatable:
            if splittable and units >= 2:
                return ThreadPlan(1, min(units, free), f"{free} idle cores: units side by side, one thread each "
                                                       "(repeatable)", SIDE, key)
            return ThreadPlan(1, 1, f"{free} idle cores, one unit: one thread, so that its results do not "
                                    "depend on the load (ThreadPolicy(repeatable=False) gives it every idle core)")
        alone = ThreadPlan(free, 1, "", ALONE, key)
        if not splittable or units < 2:
            return _with_reason(alone, f"{free} idle cores, one unit: every idle core")
        side = ThreadPlan(1, min(units, free), "", SIDE, key)
        measured = (rates or {}).get(key, {})
        if measure is not None and rates is not None and not (measured.get(ALONE) and measured.get(SIDE)):
            paired = measure(free)
            if paired.get(ALONE) and paired.get(SIDE):  # both options on this same group
                for option in (ALONE, SIDE):
                    values = rates.setdefault(key, {}).setdefault(option, [])
                    values[:] = (list(values) + [float(paired[option])])[-_KEPT_RATES:]
                measured = rates[key]
        # the option tried first: side by side for small steps (kernels too short for threads
        # to pay), every idle core for large ones
        small = step_flops is not None and step_flops < self.large_step_flops
        for plan in (side, alone) if small else (alone, side):
            if not measured.get(plan.option):
                return _with_reason(plan, f"{free} idle cores, {plan.option} measured first")
        rate = {option: statistics.median(measured[option]) for option in (ALONE, SIDE)}
        best = side if rate[SIDE] > rate[ALONE] else alone
        return _with_reason(best, f"{free} idle cores, {best.option} measured faster ("
                                  f"{ALONE} {rate[ALONE] / 1e9:.3g}, {SIDE} {rate[SIDE] / 1e9:.3g} GFLOP per second)")

    def decide_units(self, units: Sequence[Any], *, parts: int = 0, rates: Any = None,
                     splittable: bool = True) -> ThreadPlan:
        """The plan for execution units (each step sized by :func:`unit_step_flops`); logged.
        ``parts``: how many units they could be split into (an executor that splits units to run
        them side by side), when more than there are units; ``rates``: the run's
        :class:`~tridens.units.Decisions` (its measured thread options), or None."""
        flops = max((unit_step_flops(u) for u in units), default=None, key=lambda v: -1 if v is None else v)
        busy = self._busy_elsewhere()  # (no lag, where the load average lags a minute behind)
        plan = self.decide(flops, max(len(units), parts), rates=None if rates is None else rates.thread_rates,
                           splittable=splittable, load=None if busy is None else busy + 1.0,
                           measure=lambda free: self.probe(units, free))
        log.info("threads: %d per unit, %d unit(s) at once: %s", plan.threads, plan.concurrent, plan.reason)
        return plan

    def __repr__(self) -> str:
        return (f"ThreadPolicy(threads={self.threads!r}, concurrent={self.concurrent!r}, "
                f"large_step_flops={self.large_step_flops!r}, repeatable={self.repeatable!r})")


_KEPT_RATES = 8
"""Paired measurements kept per workload key (the latest)."""


def probe_thread_options(units: Sequence[Any], free: int, steps: int = 4) -> dict[str, float]:
    """Both thread options timed on the same group: ``steps`` training steps (after one warm-up)
    of a copy of the group's largest model on one real batch, once with ``free`` torch threads
    and once as ``free`` forked copies side by side, one thread each, started together. Returns
    ``{ALONE: rate, SIDE: rate}`` in training FLOPs per wall second ({} where the model cannot be
    stepped so: a user's loop, no ``fork``). The copies leave the trials untouched (their own
    random streams, weights and optimizer state are copies too)."""
    import multiprocessing as mp

    flops = max((_model_step_flops(u)[0] or 0.0 for u in units), default=0.0)
    step = _probe_step(units)
    if step is None or not flops or "fork" not in mp.get_all_start_methods():
        return {}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(free)
        alone = step(steps)
    finally:
        torch.set_num_threads(before)
    context = mp.get_context("fork")
    go = context.Event()
    results = context.Queue()
    ready = context.Semaphore(0)

    def child() -> None:
        torch.set_num_threads(1)
        results.put(step(steps, ready=ready, go=go))

    procs = [context.Process(target=child, daemon=True) for _ in range(free)]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:  # every copy warmed up before any is timed
            if not ready.acquire(timeout=60):
                return {}
        go.set()
        times = [results.get(timeout=120) for _ in procs]
    except Exception:  # a child that died or hung: no measurement
        return {}
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    return {ALONE: steps * flops / alone, SIDE: sum(steps * flops / t for t in times)}


def _probe_step(units: Sequence[Any]) -> Callable[..., float] | None:
    """``timed(steps, ready=None, go=None)``: the wall seconds of ``steps`` training steps of a
    fresh copy of the units' largest model on one batch (after a warm-up step; ``ready`` released
    and ``go`` awaited between the two); None where the evaluator has no step-wise trainer."""
    candidates = [(u, job) for u in units for job in getattr(u, "jobs", {}).values()
                  if isinstance(job.model, nn.Module)]
    if not candidates:
        return None
    unit, job = max(candidates, key=lambda c: sum(p.numel() for p in c[1].model.parameters()))
    evaluator = getattr(unit, "evaluator", None)
    if evaluator is None or not hasattr(evaluator, "trainer"):
        return None

    def timed(steps: int, ready: Any = None, go: Any = None) -> float:
        trainer = evaluator.trainer(copy.deepcopy(job.model), job.trial.sample, job.trial.seed)
        trainer.begin_epoch()
        _, x, y = next(iter(trainer.epoch_batches()))
        trainer.train_batch(x, y, 0)
        if ready is not None:
            ready.release()
            go.wait()
        t0 = time.perf_counter()
        for i in range(steps):
            trainer.train_batch(x, y, i + 1)
        return time.perf_counter() - t0

    try:
        evaluator.config(job.trial.sample)
    except Exception:
        return None
    return timed


def _with_reason(plan: ThreadPlan, reason: str) -> ThreadPlan:
    return ThreadPlan(plan.threads, plan.concurrent, reason, plan.option, plan.key)


def unit_sizes(units: Sequence[Any]) -> list[tuple[float, list[int]]]:
    """Each unit's work per trial-epoch and its trials, taken before it trains (a unit lets its
    trials go as they finish): one step of its largest model in FLOPs (:func:`step_flops`; 1 where
    it cannot be counted)."""
    sizes = []
    for unit in units:
        flops, _ = _model_step_flops(unit)
        sizes.append((1.0 if flops is None else flops, list(unit.jobs)))
    return sizes


def _cpu_clock() -> tuple[float, float, float] | None:
    """(wall s, busy CPU s of the whole machine, CPU s of this process and its finished children)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system, irq softirq steal
    times = os.times()
    return (time.monotonic(), busy / os.sysconf("SC_CLK_TCK"),
            times.user + times.system + times.children_user + times.children_system)


def _load(load: float | None) -> float:
    if load is not None:
        return load
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return 0.0


def step_flops(model: nn.Module, example: torch.Tensor, batch_size: int) -> float:
    """Training FLOPs of one step of ``model`` on ``batch_size`` examples like ``example`` (one
    example, no batch dimension): 3x one example's forward FLOPs times the batch size.

    >>> step_flops(nn.Linear(10, 4), torch.zeros(10), 32)
    7680.0
    """
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            flops = forward_flops(model, example.unsqueeze(0))
    finally:
        model.train(was_training)
    return 3.0 * flops * batch_size


def _model_step_flops(unit: Any) -> tuple[float | None, int]:
    """(the training FLOPs of one step of ``unit``'s largest model, or None when they cannot be
    counted; the number of its models)."""
    evaluator = getattr(unit, "evaluator", None)
    jobs = [job for job in getattr(unit, "jobs", {}).values() if isinstance(job.model, nn.Module)]
    if evaluator is None or not jobs or not hasattr(evaluator, "config"):
        return None, len(jobs)
    job = max(jobs, key=lambda j: sum(p.numel() for p in j.model.parameters()))
    try:
        cfg = job.config(evaluator)
        example = cfg.train[0][0]
        if not isinstance(example, torch.Tensor):
            return None, len(jobs)
        return step_flops(job.model, example, cfg.batch_size), len(jobs)
    except Exception:  # whatever keeps a model from running on one example: size unknown
        return None, len(jobs)


def unit_step_flops(unit: Any) -> float | None:
    """The training FLOPs of one step of ``unit``: its largest model's step (counted on one
    example), times the number of models where they step as one fused model; None when it cannot
    be counted (a user's loop, a model that does not run on one example)."""
    flops, models = _model_step_flops(unit)
    if flops is None:
        return None
    from ..xopt import BatchedUnit

    return flops * models if isinstance(unit, BatchedUnit) else flops


def shares(units: Sequence[Any], count: int) -> list[list[Any]]:
    """``units`` dealt into at most ``count`` shares of about equal work, for ``count`` processes
    side by side: largest first, each to the lightest share so far (a unit's work: its largest
    model's training step times its number of models; its number of models where the step cannot
    be counted). Shares keep the units' order.

    >>> [len(s) for s in shares([object(), object(), object()], 2)]
    [2, 1]
    """
    work = []
    for unit in units:
        flops, models = _model_step_flops(unit)
        work.append(max(1, models) * (1.0 if flops is None else flops))
    count = max(1, min(count, len(units)))
    loads, dealt = [0.0] * count, [[] for _ in range(count)]   # type: list[float], list[list[int]]
    for index in sorted(range(len(units)), key=lambda i: -work[i]):
        lightest = min(range(count), key=lambda s: loads[s])
        loads[lightest] += work[index]
        dealt[lightest].append(index)
    return [[units[i] for i in sorted(share)] for share in dealt if share]
