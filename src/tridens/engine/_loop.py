"""One run of an experiment: the engine loop (Retiarii's JIT loop) and the hooks every executor's
trial protocol calls.

:class:`_Run` asks the strategy for TrialGroups, instantiates each sample (a structure cache skips
rebuilding known samples), fingerprints and deduplicates trials, applies constraints, weight
inheritance and warm start, and hands the group's jobs to the executor; the trial protocol calls
back :meth:`_Run.record`, :meth:`_Run.decide` and :meth:`_Run.finish`, which write the store first,
then tell the strategy, the live view and the callbacks. :class:`~._experiment.Experiment` holds
the parameters, checks them and starts a run; this module is what a run does.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import sys
import time
import warnings
from collections import OrderedDict
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeVar

import torch

from ..errors import InvalidSample, InvalidSpace, StorageFault, TridensError
from ..evaluators import Evaluator, StepwiseEvaluator
from ..space import BaseSpace
from ..store import Store
from ..strategy import Strategy
from ..trial import Decision, Fork, Objective, Trial, TrialGroup, TrialStatus
from ..text import printable
from ..units import Job, PlanContext
from ..executors import Executor
from ._leftovers import FINISHED_COUNTED, fail_repeated_deaths, failure_settled
from ..executors import RunHalted, error_text

if TYPE_CHECKING:
    from ._experiment import Experiment

log = logging.getLogger("tridens")

_MAX_IDLE_GROUPS = 50  # groups in a row that bring nothing new: the space is exhausted


def _parse_duration(value: float | str | None) -> float | None:
    if value is None:
        return None
    m = None if isinstance(value, (int, float)) else re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|h|d)?\s*", str(value))
    seconds = (float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else
               float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"] if m else math.nan)
    if not seconds >= 0:  # negative, NaN, or not a duration (0: stop before the first trial)
        raise ValueError(f"The 'max_duration' parameter of Experiment must be a non-negative number of seconds or a string "
                         f"like '90s', '10m', '2h'. Got {value!r} instead.")
    return seconds


def _trial_seed(experiment_seed: int, position: int | str) -> int:
    return random.Random(f"{experiment_seed}:{position}").getrandbits(31)



# The structure cache of a run (see _Run._instantiate): restricted samples kept (least recently
# used dropped first; ~0.3 KB each) and hits re-derived to check that the space's structure is a
# function of its sample.
_STRUCTURE_CACHE_SIZE = 4096
_VERIFIED_HITS = 2


def _cpu_only() -> bool:
    """Whether ``torch.manual_seed`` seeds only the CPU generator in this process (no CUDA, MPS,
    XPU, MTIA or custom device available). On such a build it also queues lazy seeding for each
    absent accelerator, formatting a Python stack trace every time, a cost per trial worth skipping."""
    try:
        return not (torch.cuda.is_available() or torch.backends.mps.is_available()
                    or (hasattr(torch, "xpu") and torch.xpu.is_available())
                    or (hasattr(torch, "mtia") and torch.mtia.is_available())
                    or hasattr(torch, torch._C._get_privateuse1_backend_name()))
    except Exception:  # an unusual build: seed everything
        return False


def _structure_cached(space: BaseSpace) -> bool:
    """Whether a trial's structure is a function of its restricted sample, so a known sample needs
    no build: inline-choice spaces (``__init__`` re-run with the sample fixed) and bases without
    mutators. Graph mutators run arbitrary code on the traced graph, so theirs is always built."""
    from ..space import ModelSpace
    from ..space import MutatorSpace

    if isinstance(space, ModelSpace):
        return True
    return isinstance(space, MutatorSpace) and not space.mutators


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def _built(model: Any) -> bool:
    """Whether ``model`` was built for real (not on the meta device, not absent)."""
    return model is not None and not any(p.is_meta for p in model.parameters())


def _halts_on_storage_fault(hook: _Hook) -> _Hook:
    """A hook of the trial protocol whose store write meets a storage fault (full disk, the store
    file gone) raises :class:`~._protocol.RunHalted`: the run stops; the trial is not failed."""

    @wraps(hook)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except StorageFault as err:
            raise RunHalted(err) from err

    return guarded  # type: ignore[return-value]


class _Run:
    """The state of one ``run()``: the engine loop and the hooks executors call."""

    def __init__(self, exp: Experiment, db: Store, name: str, strategy: Strategy, objective: Objective,
                 space: BaseSpace, plan: PlanContext | None = None):
        from ._progress import Progress

        self.exp, self.db, self.name, self.strategy, self.objective = exp, db, name, strategy, objective
        self.trial_timeout = exp.trial_timeout
        self.evaluator: Evaluator = exp.evaluator  # type: ignore[assignment]
        if exp.objective is not None:  # the objective the user named: a user's loop reports it first
            self.evaluator = self.evaluator.for_objective(objective.metric)
        self.space = space
        self.plan = plan if plan is not None else PlanContext()  # the run's planning state (tridens.units)
        self.no_model = exp.space is None  # a hyperparameter-only search: the function builds its model
        # A user's loop reporting dicts names the objective by their first key: learned at the first report.
        self.naming_objective = exp.objective is None and self.evaluator.objective_from_reports
        self.names_checked = False  # the first report checks the objectives' names (check_reported_names)
        self.stop_reason = "the run ended"
        self.deadline = None
        self.stopped_at_deadline = 0  # running trials that max_duration stopped after a step
        duration = _parse_duration(exp.max_duration)
        if duration is not None:
            self.deadline = time.monotonic() + duration
        self.seen: dict[str, Trial] = {}  # dedup key -> finished trial
        # The wave being started: the dedup keys of its trials that train, and its trials equal to
        # one of those, decided once that one has finished (a duplicate then, or trained if it failed).
        self.training: set[str] = set()
        self.waiting: list[tuple[Trial, bool]] = []  # (trial, whether its model was built for real)
        self.progress = Progress(exp.max_trials, objective, enabled=exp.verbose)
        self.finished_here: list[Trial] = []
        self.flops: dict[str, int | None] = {}  # fingerprint -> FLOPs
        self.wants_flops = any(getattr(c, "key", None) == "flops" for c in exp.constraints) or (
            exp.second_objective is not None and exp.second_objective[0] == "flops")
        self.zoo: Any = None  # warm start (tridens.warmup): the zoo, and each trial's IR description
        self.zoo_desc: dict[int, Any] = {}
        self.warmed: set[int] = set()
        if exp.warm_start is not None and exp.warm_start is not False:
            self.zoo = exp._zoo(db.path)
        self.cpu_only = _cpu_only()
        # _instantiate: restricted sample (JSON) -> (fingerprint, params), and its counters.
        self.structures: OrderedDict[str, tuple[str, int]] | None = (
            OrderedDict() if _structure_cached(space) else None)
        self.unverified_hits = _VERIFIED_HITS
        self.builds = self.built_duplicates = 0
        # Constraints on parameters or FLOPs reject models before they train: build those on meta.
        self.meta_first = any(getattr(c, "key", None) != "latency_ms" for c in exp.constraints)

    # -- hooks for the trial protocol ----------------------------------------------------------
    @_halts_on_storage_fault
    def started(self, trial: Trial) -> None:
        if trial.status is not TrialStatus.RUNNING:  # (trials trained together are marked as a group)
            trial.status, trial.started_at = TrialStatus.RUNNING, time.time()
            self.db.update_trial(trial)

    @_halts_on_storage_fault
    def record(self, trial: Trial, step: int, metrics: Mapping[str, float]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        if self.naming_objective and values:
            self._name_objective(next(iter(values)))
        if not self.names_checked:
            from ._preflight import check_reported_names

            check_reported_names(self.name, trial, values, self.objective, self.exp.second_objective)
            self.names_checked = True
        self.db.add_metrics(trial.id, step, values)
        for key, value in values.items():
            trial.metrics.setdefault(key, []).append(value)
        value = values.get(self.objective.metric, math.nan)  # (a later report without it: no value, never another metric)
        self.strategy.report(trial, step, value)
        self.progress.step(trial, step, value)
        self._notify("on_trial_step", trial, step, values)

    def _name_objective(self, metric: str) -> None:
        """The first report named the objective ``metric``: the run, its views, the strategy and
        the stored experiment (``tridens ls/top/show``) use that name from now on."""
        self.naming_objective = False
        if metric == self.objective.metric:
            return
        self.objective = Objective(metric, self.objective.mode)
        self.progress.objective = self.objective
        self.strategy.objective_named(self.objective)
        config = self.db.get_experiment(self.name).config
        self.db.update_experiment(self.name, config={**config, "objective": {"metric": metric, "mode": self.objective.mode}})

    def fork(self, trial: Trial, step: int) -> Fork | None:
        return self.strategy.fork(trial, step)

    @_halts_on_storage_fault
    def forked(self, trial: Trial) -> None:
        self.db.update_trial(trial)  # its lineage (info["schedule"], info["exploits"])

    def decide(self, trial: Trial, step: int) -> Decision:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            # max_duration bounds the run, not only the groups it starts: a running trial ends after
            # this step, stopped as a pruner would stop it, and says why.
            trial.status = TrialStatus.STOPPED
            trial.info["stopped_by"] = "max_duration"
            self.stopped_at_deadline += 1
            return Decision.STOP
        decision = self.strategy.decide(trial, step)
        if decision is Decision.STOP:
            trial.status = TrialStatus.STOPPED
        return decision

    def _final_value(self, trial: Trial, value: float | None) -> float | None:
        """The trial's value of the objective when it ends: ``value``, else its last reported one."""
        values = trial.metrics.get(self.objective.metric)
        return value if value is not None else (values[-1] if values else None)

    @_halts_on_storage_fault
    def finish(self, trial: Trial, status: TrialStatus, *, error: str | None = None,
               weights: Mapping[str, Any] | None = None, value: float | None = None) -> None:
        trial.status = status
        trial.error = error
        trial.metric = self._final_value(trial, value)
        trial.finished_at = time.time()
        state = None
        if weights is not None and status in (TrialStatus.COMPLETED, TrialStatus.STOPPED):
            state = dict(weights)
            if self.zoo is not None and trial.id in self.zoo_desc and trial.metric is not None:
                self._add_to_zoo(trial, weights)
        # The checkpoint file, then its row and the trial's in one transaction: written before it
        # counts as done (trial.checkpoint is set).
        if status is TrialStatus.FAILED:
            trial.error = error = self._explain_failure(trial, error)
        self.db.finish_trial(trial, state)
        if status is TrialStatus.FAILED:
            log.warning("trial %d failed: %s", trial.label,
                        printable((error or "").strip().splitlines()[-1]) if error and error.strip() else "")
        else:
            self.seen.setdefault(self._dedup_key(trial), trial)
        self.strategy.tell(trial)
        self.finished_here.append(trial)
        self.progress.trial_done(trial)
        self._notify("on_trial_end", trial)

    def _explain_failure(self, trial: Trial, error: str | None) -> str | None:
        """A failed trial's error, with the layer that failed as ``freeze()`` names it."""
        if self.no_model:
            return error
        from ._preflight import explain_failure

        return explain_failure(self.space, trial.sample, error)

    def _notify(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on every callback after the store has the data; one that raises is logged
        and the run goes on (nothing is lost: the store holds it)."""
        for callback in self.exp.callbacks:
            try:
                getattr(callback, hook)(*args)
            except Exception as err:
                log.warning("callback %s.%s failed: %s: %s", type(callback).__name__, hook, type(err).__name__, err)

    def _end_callbacks(self, completed: bool) -> None:
        """Tell the callbacks the run ended (with the experiment's best trial), then close them."""
        if not self.exp.callbacks:
            return
        if completed:
            done = [t for t in self.db.trials(self.name) if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED)
                    and t.metric is not None and not math.isnan(t.metric)]
            best = max(done, key=lambda t: (self.objective.score(t.metric), -t.id), default=None)
            self._notify("on_experiment_end", self.name, best, list(self.finished_here))
        self._notify("close")

    # -- the loop ------------------------------------------------------------------------------
    def _dedup_key(self, trial: Trial) -> str:
        hparams = {k: trial.sample[k] for k in self.evaluator.search_space() if k in trial.sample}
        return f"{trial.fingerprint}|{json.dumps(hparams, sort_keys=True)}"

    def loop(self, resumed: bool) -> None:
        for callback in self.exp.callbacks:  # a logger that cannot start (not installed) stops the run here
            callback.on_experiment_start(self.name, self.db.get_experiment(self.name).config)
        trials = self.db.trials(self.name)
        fail_repeated_deaths(self.db, trials)  # a trial that kills its process is not run a third time
        # An earlier run's failures (a bug since fixed, a crash) do not use up this run's budget:
        # with retry_failed they train again first, else new trials take their place.
        retried = [t for t in trials if self.exp.retry_failed and t.status is TrialStatus.FAILED and not failure_settled(t)]
        finished = [t for t in trials if t.status.finished and t not in retried]
        interrupted = [t for t in trials if not t.status.finished or t in retried]
        for t in retried:
            t.status, t.error, t.metric, t.checkpoint, t.finished_at = TrialStatus.PENDING, None, None, None, None
        for t in finished:
            if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED):
                self.seen.setdefault(self._dedup_key(t), t)
        search_space = self.space.search_space().merged(self.evaluator.search_space())
        self.search_space = search_space
        self.strategy.start(search_space, self.objective, random.Random(self.exp.seed), finished)
        executor = self.executor = self.exp._executor(self.db.path, self.name, self.plan)
        self.group_index = max((t.group or 0 for t in trials), default=-1) + 1
        self.position = len(trials)
        before = sum(t.status in FINISHED_COUNTED and (t.status is not TrialStatus.FAILED or failure_settled(t))
                     for t in finished)
        self.progress.start(self.name, before, resumed, finished)
        if interrupted:
            log.info("resuming %s: %d finished trials kept, %d interrupted and %d failed trials run again",
                     self.name, len(finished), len(interrupted) - len(retried), len(retried))
            for t in interrupted:
                t.metrics = {}
                t.forget_forks()  # trained again from its start
                self.db.delete_metrics(t.id)  # the re-run writes its own steps
            self._run_jobs([j for j in (self._job(t) for t in interrupted) if j is not None], executor)
        if self.exp.max_trials is None and self.deadline is None and not getattr(self.strategy, "finite", False):
            warnings.warn(f"experiment {self.name!r} has no budget (no max_trials, no max_duration): it runs until "
                          f"{type(self.strategy).__name__} has nothing more to propose or you stop it (Ctrl-C); pass "
                          "budget=td.Budget(max_trials=..., max_duration=...) to bound it", UserWarning, stacklevel=2)
        idle = 0
        try:
            while True:
                # Trials that failed before training (constraints, bad shapes) count like any other.
                counted = before + sum(t.status in FINISHED_COUNTED for t in self.finished_here)
                remaining = None if self.exp.max_trials is None else self.exp.max_trials - counted
                if remaining is not None and remaining <= 0:
                    self.stop_reason = f"max_trials={self.exp.max_trials} reached"
                    break
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    self.stop_reason = (f"max_duration={self.exp.max_duration!r} reached after {counted}"
                                        f"{'' if self.exp.max_trials is None else f'/{self.exp.max_trials}'} trials"
                                        + (f" ({self.stopped_at_deadline} stopped early at the deadline)"
                                           if self.stopped_at_deadline else ""))
                    break
                group = self.strategy.ask(remaining)
                if group is None:
                    self.stop_reason = (f"{type(self.strategy).__name__} has nothing more to propose (its search is "
                                        f"complete or the space is exhausted) after {counted} trials")
                    break
                samples = group.samples if remaining is None else group.samples[:remaining]
                progress_mark = len(self.finished_here)
                ran = 0
                for wave in self._waves(samples):  # one wave unless warm start is on
                    self.training, self.waiting = set(), []
                    jobs = [job for job in (self._new_job(sample, group) for sample in wave) if job is not None]
                    while True:
                        ran += len(jobs)
                        self._run_jobs(jobs, executor)
                        if not self.waiting:
                            break
                        waiting, self.training, self.waiting = self.waiting, set(), []
                        jobs = [job for job in (self._readmit(trial, built, group) for trial, built in waiting)
                                if job is not None]
                self.group_index += 1  # one group index per TrialGroup, duplicates and early failures included
                if not ran and len(self.finished_here) == progress_mark:
                    idle += 1
                    if idle >= _MAX_IDLE_GROUPS:
                        self.stop_reason = (f"the space is exhausted: {type(self.strategy).__name__} proposed only known "
                                            f"models {idle} times in a row")
                        break
                    continue
                idle = 0
        finally:
            executor.close()
            self._end_callbacks(completed=sys.exc_info()[0] is None)

    def _waves(self, samples: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """Scheduling hook for warm start: the group's samples in the order and waves they are
        instantiated and run. Without warm start, one wave (the whole group, fusable, in lockstep).
        With it, :meth:`tridens.warmup.Zoo.waves` (1, 1, 2, 4, ... trials; the executor's workers
        first when it runs trials in parallel): a wave is instantiated, and so warm-started, only
        after the previous one finished and entered the zoo, so later members of a group start
        from earlier ones, as in ModelKeeper where each job starts from the zoo when it arrives."""
        if self.zoo is None or len(samples) <= 1:
            return [list(samples)]
        first = max(1, int(self.executor.parallelism))
        waves, start = [], 0
        for size in self.zoo.waves(len(samples), first):
            waves.append(list(samples[start:start + size]))
            start += size
        return waves

    def _run_jobs(self, jobs: list[Job], executor: Executor) -> None:
        if not jobs:
            return
        if isinstance(self.evaluator, StepwiseEvaluator):  # trained together: running from now on, as a group
            now = time.time()
            with self.db.transaction():  # one commit for the group
                for job in jobs:
                    job.trial.status = TrialStatus.RUNNING
                    job.trial.started_at = now
                    job.trial.info.update(self.evaluator.trial_info(job.trial.sample))
                    self.db.update_trial(job.trial)
        executor.run_group(jobs, self.evaluator, self)  # (one at a time: each running when it starts)

    def _seed(self, seed: int) -> None:
        """``torch.manual_seed(seed)``: the same state, minus its cost where only the CPU has a generator."""
        if self.cpu_only:
            torch.default_generator.manual_seed(int(seed))
        else:
            torch.manual_seed(seed)

    def _instantiate(self, trial: Trial) -> Any:
        """Fingerprint the trial's model structure and count its parameters. Returns the model if
        one was built (``None`` when the sample's structure was known: :meth:`_materialize` builds it).

        A restricted sample seen before in this run costs no build where the structure is a function
        of the sample (:func:`_structure_cached`; the first hits are checked by building anyway).
        Otherwise the model is built once, for real, under the trial's seed, and traced: that is
        the model that trains, and for small models a real build is cheaper than one on the meta
        device (whose device mode intercepts every torch call). The structure is built on the meta
        device first only where initialising would often be wasted: with constraints on parameters
        or FLOPs, or when more than 1 in 10 built samples turned out to be duplicates."""
        from ..graph import trace

        if self.no_model:  # the function builds its own model: no fingerprint, no parameter count
            return None
        restricted = self.space.restrict(trial.sample)
        if not getattr(self.evaluator, "needs_model", True):
            trial.fingerprint = "sample:" + json.dumps(restricted, sort_keys=True)
            return None
        key: str | None = None
        known: tuple[str, int] | None = None
        if self.structures is not None:
            try:
                key = json.dumps(restricted, sort_keys=True)
            except (TypeError, ValueError):  # a value JSON cannot write: no caching for it
                key = None
            known = self.structures.get(key) if key is not None else None
            if key is not None and known is not None and self.unverified_hits <= 0:
                self.structures.move_to_end(key)
                trial.fingerprint, trial.info["params"] = known
                self._add_flops(trial, None)
                return None
        meta = self.meta_first or (self.builds >= 10 and self.built_duplicates * 10 > self.builds)
        self._seed(trial.seed)  # a real build (also a mutator space's) makes the trial's weights
        structure = self.space.freeze(restricted, check=False, device="meta" if meta else None)
        inputs = self.space.example_inputs
        on_meta = any(p.is_meta for p in structure.parameters())
        if inputs is not None and on_meta:
            inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
        graph = trace(structure, inputs)
        trial.fingerprint = graph.fingerprint()
        trial.info["params"] = params = sum(p.numel() for p in structure.parameters())
        self._add_flops(trial, graph)
        if not on_meta:
            self.builds += 1
        if key is not None and self.structures is not None:
            if known is None:
                self.structures[key] = (trial.fingerprint, params)
                if len(self.structures) > _STRUCTURE_CACHE_SIZE:
                    self.structures.popitem(last=False)
            elif known == (trial.fingerprint, params):
                self.unverified_hits -= 1
            else:
                log.info("the space %s gave sample %s two structures: its structure depends on more than the "
                         "sample (random or global state), so every trial builds its model", type(self.space).__name__, key)
                self.structures = None
        return structure

    def _add_flops(self, trial: Trial, graph: Any) -> None:
        """FLOPs, a forward pass for shapes: only when a constraint or objective reads them, and once
        per structure (identical structures have identical FLOPs)."""
        fingerprint = trial.fingerprint
        if not self.wants_flops or fingerprint is None:
            return
        if fingerprint not in self.flops and graph is not None:
            try:
                self.flops[fingerprint] = graph.flops()
            except Exception:  # an op the pass does not know must not fail the trial
                self.flops[fingerprint] = None
        if self.flops.get(fingerprint) is not None:
            trial.info["flops"] = self.flops[fingerprint]

    def _materialize(self, trial: Trial, structure: Any) -> Any:
        """The trainable model: the structure itself if it has real weights, else a seeded freeze."""
        if self.no_model or not getattr(self.evaluator, "needs_model", True):
            return None
        model = structure
        if model is None or any(p.is_meta for p in model.parameters()):  # a known sample, or built on meta
            self._seed(trial.seed)
            model = self.space.freeze(self.space.restrict(trial.sample), check=False)
        self._inherit(trial, model)
        if self.zoo is not None and trial.id not in self.warmed:
            self.warmed.add(trial.id)
            self._warm_start(trial, model)
        return model

    def _inherit(self, trial: Trial, model: Any) -> None:
        """Weight inheritance (``TrialGroup.parents``): the parent's trained weights for the layers
        the child shares with it (:mod:`tridens.xopt._supergraph`); such a child gets no zoo warm start."""
        if trial.parent is None or "warm_start" in trial.info or trial.id in self.warmed:
            return
        from ..xopt import inherit_from_trial

        self.warmed.add(trial.id)
        trial.info["inherit"] = inherit_from_trial(self.db, self.space, trial, model, self.plan.decisions)

    def _warm_start(self, trial: Trial, model: Any) -> None:
        """Load the best zoo parent's transformed weights into ``model``; never fails the trial."""
        from ..warmup import describe

        rng = torch.get_rng_state()
        try:
            desc = describe(model, self.space.example_inputs)
            self.zoo_desc[trial.id] = desc
            result = self.zoo.warm_start(model, desc=desc, exclude=())
            info = result.as_info()
        except Exception as err:  # warm start is an optimization: a cold start is always correct
            info = {"parent": None, "reason": f"{type(err).__name__}: {err}"}
        finally:
            torch.set_rng_state(rng)
        if info.get("parent") is None:
            log.info("trial %d: no warm start (%s)", trial.label, info.get("reason"))
        elif isinstance(info["parent"], int) and Path(self.zoo.path).resolve() == Path(self.db.path).resolve():
            trial.parent = info["parent"]
        trial.info["warm_start"] = info

    def _add_to_zoo(self, trial: Trial, weights: Mapping[str, Any]) -> None:
        desc = self.zoo_desc.pop(trial.id)
        if desc.get("opaque"):
            log.info("trial %d not added to the zoo: torch.fx cannot trace the model whole (opaque node %s)",
                     trial.label, desc["opaque"])
            return
        if trial.metric is None or math.isnan(trial.metric):
            return
        try:
            self.zoo.add_description(desc, dict(weights), accuracy=self.objective.score(trial.metric),
                                     trial=trial.id, number=trial.label, experiment=self.name, store=str(self.db.path))
        except Exception as err:
            log.warning("trial %d not added to the zoo: %s: %s", trial.label, type(err).__name__, err)

    def _violated(self, trial: Trial, model: Any) -> str | None:
        for constraint in self.exp.constraints:
            if constraint.key == "latency_ms" and "latency_ms" not in trial.info:
                trial.info["latency_ms"] = _latency_ms(model, self.space.example_inputs)
            message = constraint.violation(trial.info)
            if message:
                return message
        return None

    def _job(self, trial: Trial) -> Job | None:
        """Instantiate an existing trial record; failures are recorded, not raised."""
        try:
            model = self._materialize(trial, self._instantiate(trial))
        except Exception as err:
            self.finish(trial, TrialStatus.FAILED, error=error_text(err) if not isinstance(err, InvalidSample) else str(err))
            return None
        job = Job(trial, model, trial.max_steps)
        job.resolve_config(self.evaluator)  # once: planners and units read job.config(evaluator)
        return job

    def _seed_of(self, sample: Mapping[str, Any]) -> int:
        """The new trial's seed: from its position in the experiment (ids are global to the
        store), or with ``seeds="per-architecture"`` from the model-space part of its sample."""
        if self.exp.seeds == "per-architecture":
            labels = self.space.search_space() if self.space is not None else {}
            architecture = {k: v for k, v in sample.items() if k in labels}
            return _trial_seed(self.exp.seed, json.dumps(architecture, sort_keys=True, default=str))
        return _trial_seed(self.exp.seed, self.position)

    def _new_job(self, sample: dict[str, Any], group: TrialGroup) -> Job | None:
        try:
            clean = self.search_space.validate(sample)
        except InvalidSample as err:
            raise TridensError(f"strategy {type(self.strategy).__name__} proposed an invalid sample: {err}") from err
        trial = Trial(id=-1, sample=clean, seed=self._seed_of(clean), group=self.group_index,
                      max_steps=group.max_steps, experiment=self.name, parent=group.parent_of(sample),
                      number=self.position)
        self.position += 1
        return self._admit(trial, group)

    def _readmit(self, trial: Trial, built: bool, group: TrialGroup) -> Job | None:
        """A trial that waited for an equal one of its wave: a duplicate of it where it finished,
        else (it failed) a new job, built again under the trial's own seed."""
        original = self.seen.get(self._dedup_key(trial))
        if original is not None:
            self.built_duplicates += built
            self._duplicate(trial, original)
            return None
        return self._admit(trial, group)

    def _store(self, trial: Trial) -> None:
        """Write ``trial``: its row where it has none yet (a waiting trial has one), else its fields."""
        if trial.id < 0:
            self.db.add_trial(self.name, trial)
        else:
            self.db.update_trial(trial)

    def _duplicate(self, trial: Trial, original: Trial) -> None:
        trial.status = TrialStatus.DUPLICATE
        trial.metric = original.metric
        trial.info["duplicate_of"] = original.id
        trial.finished_at = time.time()
        self._store(trial)
        self.strategy.tell(trial)

    def _admit(self, trial: Trial, group: TrialGroup) -> Job | None:
        """The job of new ``trial``, or None where it is a duplicate of a finished trial, waits for
        an equal trial of its wave that is still to train (then it is decided by that one's outcome:
        one training per model, as for trials of earlier groups), or fails before training."""
        try:
            model = self._instantiate(trial)
        except Exception as err:
            self._store(trial)
            self.finish(trial, TrialStatus.FAILED, error=str(err) if isinstance(err, (InvalidSample, InvalidSpace)) else error_text(err))
            return None
        key = self._dedup_key(trial)
        original = self.seen.get(key)
        if original is not None:
            self.built_duplicates += _built(model)  # initialised for nothing (see _instantiate)
            self._duplicate(trial, original)
            return None
        # One row, written with its fingerprint, in the group's order (a waiting trial's too);
        # _materialize needs the id (warm start, inheritance).
        self._store(trial)
        if key in self.training:
            self.waiting.append((trial, _built(model)))
            return None
        self.training.add(key)
        try:
            if any(c.key == "latency_ms" for c in self.exp.constraints):
                model = self._materialize(trial, model)  # latency is measured on the real model
            violation = self._violated(trial, model)
            if not violation:
                model = self._materialize(trial, model)
        except Exception as err:
            self.finish(trial, TrialStatus.FAILED, error=error_text(err))
            return None
        if violation:
            self.finish(trial, TrialStatus.FAILED, error=f"constraint violated: {violation}")
            self.seen.setdefault(key, trial)  # the same model would violate it again
            return None
        # What _materialize added (warm start, inheritance) is written by _run_jobs, next.
        job = Job(trial, model, group.max_steps)
        job.resolve_config(self.evaluator)  # once: planners and units read job.config(evaluator)
        return job


def _latency_ms(model: Any, inputs: Sequence[Any] | None) -> float:
    """Median forward time (eval mode, no grad) over a few runs on the example inputs."""
    if model is None or inputs is None:
        raise InvalidSpace("a latency constraint needs a model and example inputs (set space.example_inputs)")
    model.eval()
    times = []
    with torch.no_grad():
        model(*inputs)
        for _ in range(5):
            t0 = time.perf_counter()
            model(*inputs)
            times.append((time.perf_counter() - t0) * 1000)
    model.train()
    return sorted(times)[len(times) // 2]
