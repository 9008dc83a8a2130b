"""``td.Experiment``: the JIT engine loop (Retiarii) — ask the strategy, instantiate, dedup,
run each TrialGroup on an executor, stream metrics to the store and the strategy."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ..errors import InvalidSample, InvalidSpace, TridensError
from ..evaluators import Evaluator, StepwiseEvaluator
from ..space import BaseSpace, RecipeError, space_recipe
from ..store import Store, StoreError
from ..strategy import Strategy
from ..trial import Decision, Fork, Objective, Trial, TrialGroup, TrialStatus
from ..units import Job, parse_memory, unit_memory_limit
from ._execution import Executor, InlineExecutor, RunContext, check_forks, make_executor
from ._leftovers import claim, fail_repeated_deaths, mark_interrupted
from ._protocol import error_text

if TYPE_CHECKING:
    from ..xopt import Settings

__all__ = ["Experiment", "ExperimentFailed", "ExperimentInterrupted", "default_store_path"]

log = logging.getLogger("tridens")

_FINISHED_COUNTED = (TrialStatus.COMPLETED, TrialStatus.STOPPED, TrialStatus.FAILED)
_MAX_IDLE_GROUPS = 50  # groups in a row that bring nothing new: the space is exhausted
RUN_COUNT = 0  # experiments started in this process (the `tridens run` command checks a script started one)


# The hooks of a tridens.loggers.Callback, in the order a run calls them.
_CALLBACK_HOOKS = ("on_experiment_start", "on_trial_step", "on_trial_end", "on_experiment_end", "close")


_EXECUTOR_OPTIONS = {"workers": "Process(workers=...) or Ray(workers=...)", "ray_address": "Ray(address=...)",
                     "storage": "Ray(storage=...)", "max_retries": "Ray(max_retries=...)"}


def _executor_options(executor: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """The executor settings given the old way (``executor="process", workers=2``), each with a
    DeprecationWarning naming the executor object that takes it."""
    import warnings

    for key in options:
        if key not in _EXECUTOR_OPTIONS:
            raise TypeError(f"Experiment() got an unexpected keyword argument {key!r}")
        if isinstance(executor, Executor):
            raise ValueError(f"The '{key}' parameter of Experiment belongs to the executor: pass "
                             f"td.executors.{_EXECUTOR_OPTIONS[key]} instead of both.")
        warnings.warn(f"Experiment({key}=...) is deprecated: pass executor=td.executors.{_EXECUTOR_OPTIONS[key]}",
                      DeprecationWarning, stacklevel=3)
    if isinstance(executor, str):
        warnings.warn(f"Experiment(executor={executor!r}) is deprecated: pass an executor object, e.g. "
                      "td.executors.Inline(), Process(workers=2) or Ray(storage=...)", DeprecationWarning, stacklevel=3)
    return dict(options)


class ExperimentFailed(TridensError):
    """Every trial of a run failed: nothing was learned (the trials and their errors are stored)."""


class ExperimentInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run; the message is one line naming the command that resumes it
    (finished trials are kept)."""


_STRATEGY_NAMES = {
    "random": "Random", "grid": "GridSearch", "grid-search": "GridSearch",
    "regularized-evolution": "RegularizedEvolution", "evolution": "RegularizedEvolution",
    "tpe": "TPE", "hyperband": "Hyperband", "asha": "ASHA", "bohb": "BOHB",
    "ss": "SS", "async-ss": "AsyncSS", "boss": "BOSS",
}


def _strategy_by_name(name: str | None) -> Strategy:
    from .. import strategy as strategies

    if name is None:
        return strategies.Random()
    key = name.lower().replace("_", "-")
    if key not in _STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(sorted(_STRATEGY_NAMES))} "
                         "(or pass a td.strategy instance)")
    return getattr(strategies, _STRATEGY_NAMES[key])()


def default_store_path() -> str:
    """``$TRIDENS_DB`` if set (the ``--db`` of the ``tridens`` command), else ``tridens.db``."""
    return os.environ.get("TRIDENS_DB", "tridens.db")


def _parse_duration(value: float | str | None) -> float | None:
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    m = re.fullmatch(r"\s*([\d.]+)\s*(s|m|h|d)?\s*", str(value))
    if not m:
        raise ValueError(f"The 'max_duration' parameter of Experiment must be seconds or a string like '90s', '10m', '2h'. Got {value!r} instead.")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2) or "s"]


def _trial_seed(experiment_seed: int, position: int | str) -> int:
    return random.Random(f"{experiment_seed}:{position}").getrandbits(31)


SEED_POLICIES = ("per-trial", "per-architecture")
"""How a trial's seed (its initial weights, dropout) is chosen: from its position in the
experiment, or from its architecture (the model-space part of its sample) and the experiment's
seed -- trials that differ only in training hyperparameters then start from the same weights,
compare with common random numbers, and share training prefixes (stage trees)."""


class Experiment:
    """Explore ``space`` with ``strategy``, training each model with ``evaluator``.

    >>> exp = td.Experiment(Net(), evaluator, td.strategy.RegularizedEvolution(), max_trials=32,
    ...                     store="tridens.db", name="cnn-search")       # doctest: +SKIP
    >>> exp.run()                                                         # doctest: +SKIP
    >>> exp.top(5)                                                        # doctest: +SKIP

    Running the same script against the same store and name resumes the experiment: finished
    trials are kept, interrupted ones are trained again, and the budget is completed.
    Parameters are only stored here; they are checked when :meth:`run` starts. ``optimize``: True
    fuses trials where it pays (cross-model optimizations, :mod:`tridens.xopt`, with the knobs of
    the environment), a :class:`tridens.xopt.Settings` gives the knobs, False trains every trial
    separately.
    """

    def __init__(self, space: BaseSpace | None, evaluator: Evaluator | None, strategy: Strategy | None = None, *,
                 max_trials: int | None = None, max_duration: float | str | None = None,
                 store: str | os.PathLike[str] | None = None, name: str | None = None,
                 objective: str | Objective | None = None, seed: int = 0, seeds: str = "per-trial", executor: Executor | str | None = None,
                 trial_timeout: float | None = None, constraints: Sequence[Any] = (),
                 second_objective: tuple[str, str] | None = None, optimize: bool | Settings = True,
                 verbose: bool = True, warm_start: Any = False, max_unit_memory: int | str | None = None,
                 callbacks: Sequence[Any] = (), stage_policy: Any = None,
                 allocation: Any = None, resume: str = "auto", **executor_options: Any) -> None:
        self.space = space
        self.evaluator = evaluator
        self.strategy = strategy
        self.max_trials = max_trials
        self.max_duration = max_duration
        self.store = store
        self.name = name
        self.objective = objective
        self.seed = seed
        self.seeds = seeds  # "per-trial" or "per-architecture" (SEED_POLICIES)
        self.executor = executor  # td.executors.Inline() (None), Process(...) or Ray(...)
        self.trial_timeout = trial_timeout
        self.constraints = constraints
        self.second_objective = second_objective
        self.optimize = optimize
        self.verbose = verbose
        self.warm_start = warm_start  # False, True (a zoo beside the store), a store path or a td.warmup.Zoo
        self.max_unit_memory = max_unit_memory  # bound on a fused unit's estimated bytes (tridens.xopt)
        self.allocation = allocation  # None, "static", "dynamic" or a Fluid policy: shares of the workers per trial
        # The executor's own settings given to the experiment (workers=, ray_address=, storage=,
        # max_retries=): still accepted, with a DeprecationWarning; they belong to the executor object.
        options = _executor_options(executor, executor_options)
        self.workers = options.get("workers", 2)
        self.ray_address = options.get("ray_address")  # executor="ray": None starts a local Ray
        self.storage = options.get("storage")  # where Ray workers write checkpoints
        self.max_retries = options.get("max_retries", 0)  # a Ray unit whose worker died restarts
        self.resume = resume  # "auto": resume an experiment of the same search space; "force": any
        self.stop_reason: str | None = None  # why the last run() stopped
        self.callbacks = list(callbacks)  # tridens.loggers.Callback objects, told what the run records
        self.stage_policy = stage_policy  # a td.store.StagePolicy: stage-tree checkpoints shared through the store
        self._loaded: list[Trial] | None = None

    # -- reading back -------------------------------------------------------------------------
    @classmethod
    def load(cls, store: str | os.PathLike[str], name: str) -> "Experiment":
        """An experiment read back from ``store`` (no training; ``trials``, ``top``, ``export`` work).

        >>> exp = td.Experiment.load("tridens.db", "cnn-search")     # doctest: +SKIP
        """
        path = Path(store)
        if not path.exists():
            raise StoreError(f"no store at {path}")
        with Store(path, readonly=True) as db:
            record = db.get_experiment(name)
        config = record.config
        exp = cls(None, None, None, store=path, name=name, max_trials=config.get("max_trials"),
                  seed=config.get("seed", 0), seeds=config.get("seeds", "per-trial"), objective=record.objective() if "objective" in config else None,
                  second_objective=tuple(config["second_objective"]) if config.get("second_objective") else None)
        return exp

    def _store_path(self) -> Path:
        return Path(self.store if self.store is not None else default_store_path())

    def _name(self) -> str:
        if self.name:
            return self.name
        if self.space is not None:
            cls_name = type(getattr(self.space, "base", self.space)).__name__
            return re.sub(r"(?<!^)(?=[A-Z])", "-", cls_name).lower()
        fn = getattr(self.evaluator, "fn", None)
        if getattr(fn, "__name__", "<lambda>") != "<lambda>":  # a hyperparameter search: its function's name
            return fn.__name__.replace("_", "-").lower()  # type: ignore[union-attr]
        raise ValueError("The 'name' parameter of Experiment is required to read an experiment back.")

    def _objective(self) -> Objective:
        if isinstance(self.objective, Objective):
            return self.objective
        base = self.evaluator.objective if self.evaluator is not None else Objective()
        if isinstance(self.objective, str):
            return Objective(self.objective, base.mode if self.objective == base.metric else
                             ("min" if "loss" in self.objective or "error" in self.objective else "max"))
        return base

    def trials(self) -> list[Trial]:
        """Every trial of the experiment, in id order, from the store."""
        with Store(self._store_path(), readonly=True) as db:
            return db.trials(self._name())

    def top(self, k: int = 5) -> list[Trial]:
        """The ``k`` best finished trials, best first. With ``second_objective`` set, the Pareto
        front (objective vs. e.g. ``("params", "min")``) comes first, ordered by the objective."""
        objective = self._objective()
        scored = [t for t in self.trials()
                  if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED) and t.metric is not None
                  and not math.isnan(t.metric)]
        scored.sort(key=lambda t: (-objective.score(t.metric), t.id))
        if self.second_objective:
            from ..strategy import pareto_front

            front = pareto_front(scored, [objective, Objective(*self.second_objective)])
            front_ids = {t.id for t in front}
            scored = front + [t for t in scored if t.id not in front_ids]
        return scored[:k]

    def best(self) -> Trial | None:
        """The best finished trial (``None`` before any)."""
        top = self.top(1)
        return top[0] if top else None

    def export(self, directory: str | os.PathLike[str], top: int = 1, trust_code: bool = False, *, force: bool = False) -> list[Path]:
        """Write the ``top`` best models to ``directory``, one ``rank{r}-trial{n}/`` folder each, with
        what :func:`tridens.load` needs to rebuild them: weights, sample, space recipe, metrics.
        A non-empty ``directory`` is refused unless ``force`` (which replaces the exports in it)."""
        from ._export import export_trials

        with Store(self._store_path(), readonly=True) as db:
            record = db.get_experiment(self._name())
            trials = self.top(top)
            # trust_code: the recorded space may name a script; importing it runs it (tridens.space.build_space)
            return export_trials(db, record.config, trials, Path(directory), trust_code=trust_code, force=force)

    # -- running ------------------------------------------------------------------------------
    def _check(self) -> None:
        from ..evaluators import FunctionalEvaluator
        from ..space import BaseSpace as _Base

        if not isinstance(self.evaluator, Evaluator):
            raise ValueError(f"The 'evaluator' parameter of Experiment must be a tridens evaluator. Got {self.evaluator!r} instead.")
        if self.space is None:  # a hyperparameter-only search: the evaluator's function builds its own model
            if getattr(self.evaluator, "needs_model", True) and not isinstance(self.evaluator, FunctionalEvaluator):
                raise InvalidSpace(f"The 'space' parameter of Experiment may be None only with a FunctionalEvaluator "
                                   f"(its function builds its own model); {type(self.evaluator).__name__} trains "
                                   "the models of a space.")
        elif not isinstance(self.space, _Base):
            raise InvalidSpace(f"The 'space' parameter of Experiment must be a tridens space (a ModelSpace or "
                               f"ModelSpace.from_base(...)), or None for a search over the evaluator's "
                               f"hyperparameters only. Got {type(self.space).__name__} instead.")
        if self.resume not in ("auto", "force"):
            raise ValueError(f"The 'resume' parameter of Experiment must be one of ['auto', 'force']. Got {self.resume!r} instead.")
        if isinstance(self.strategy, str):
            _strategy_by_name(self.strategy)
        elif self.strategy is not None and not isinstance(self.strategy, Strategy) and not getattr(self.strategy, "one_shot", False):
            raise ValueError(f"The 'strategy' parameter of Experiment must be a td.strategy.Strategy (e.g. "
                             f"td.strategy.Random()). Got {self.strategy!r} instead.")
        if self.max_trials is not None and (not isinstance(self.max_trials, int) or self.max_trials < 1):
            raise ValueError(f"The 'max_trials' parameter of Experiment must be an int in the range [1, inf). Got {self.max_trials!r} instead.")
        if self.trial_timeout is not None and not (isinstance(self.trial_timeout, (int, float)) and self.trial_timeout > 0):
            raise ValueError(f"The 'trial_timeout' parameter of Experiment must be a positive number of seconds. Got {self.trial_timeout!r} instead.")
        if self.seeds not in SEED_POLICIES:
            raise ValueError(f"The 'seeds' parameter of Experiment must be one of {list(SEED_POLICIES)!r}. Got {self.seeds!r} instead.")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"The 'workers' parameter of Experiment must be an int in the range [1, inf). Got {self.workers!r} instead.")
        if self.allocation is not None:
            from ._fluid import fluid_policy

            fluid_policy(self.allocation)  # Fluid shares of the workers (tridens.engine._fluid)
            if self.executor in (None, "inline", "in-process") or isinstance(self.executor, InlineExecutor):
                raise ValueError(f"The 'allocation' parameter of Experiment shares the workers of td.executors.Process "
                                 f"or Ray. Got allocation={self.allocation!r} with executor={self.executor!r} instead.")
        _parse_duration(self.max_duration)
        for callback in self.callbacks:
            if not all(callable(getattr(callback, h, None)) for h in _CALLBACK_HOOKS):
                raise ValueError(f"The 'callbacks' parameter of Experiment must be a list of tridens.loggers.Callback "
                                 f"objects (e.g. td.loggers.TensorBoard('tb')). Got {callback!r} instead.")
        parse_memory(self.max_unit_memory, "max_unit_memory", "Experiment")
        if self.stage_policy is not None:
            from ..store import StagePolicy

            if not isinstance(self.stage_policy, StagePolicy):
                raise ValueError(f"The 'stage_policy' parameter of Experiment must be None or a td.store.StagePolicy. "
                                 f"Got {self.stage_policy!r} instead.")
            self.stage_policy.check()
        self._settings()  # optimize: True, False or a td.xopt.Settings (the environment's values checked too)
        if self.warm_start is not None and self.warm_start is not False:
            self._zoo(self._store_path())  # a bad zoo path is an error before anything runs
        self._check_ray()
        check_forks(self.strategy, self.executor, self.evaluator)  # PBT: an executor that forks members

    def _check_ray(self) -> None:
        """The executor and its Ray parameters (ray_address, storage, max_retries)."""
        kinds = (None, "inline", "in-process", "process", "ray")
        if not isinstance(self.executor, Executor) and self.executor not in kinds:
            raise ValueError(f"The 'executor' parameter of Experiment must be td.executors.Inline(), Process(...) or "
                             f"Ray(...). Got {self.executor!r} instead.")
        if not isinstance(self.max_retries, int) or isinstance(self.max_retries, bool) or self.max_retries < 0:
            raise ValueError(f"The 'max_retries' parameter of Experiment must be an int in the range [0, inf). "
                             f"Got {self.max_retries!r} instead.")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address.strip()):
            raise ValueError(f"The 'ray_address' parameter of Experiment must be None (start a local Ray) or an address "
                             f"like 'host:6379', 'auto' or 'ray://host:10001'. Got {self.ray_address!r} instead.")
        if self.ray_address is not None and self.executor != "ray":
            raise ValueError(f"The 'ray_address' parameter of Experiment is only used with executor='ray'. "
                             f"Got executor={(self.executor if self.executor is not None else 'inline')!r} instead.")
        if self.storage is not None:
            if not isinstance(self.storage, (str, os.PathLike)) or not os.fspath(self.storage):
                raise ValueError(f"The 'storage' parameter of Experiment must be None, a directory or an fsspec URI. "
                                 f"Got {self.storage!r} instead.")
            location = os.fspath(self.storage)
            if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", location) and not location.startswith("file://"):
                try:
                    import fsspec  # noqa: F401
                except ImportError:
                    raise ValueError(f"The 'storage' parameter of Experiment is the URI {location!r}, which needs fsspec "
                                     "(pip install fsspec and the package of its file system, e.g. s3fs).") from None
            elif Path(location).exists() and not Path(location).is_dir():
                raise ValueError(f"The 'storage' parameter of Experiment must be a directory. Got the file {location!r} instead.")
        if self.executor == "ray":
            try:
                import ray  # noqa: F401
            except ImportError:
                raise ValueError("The 'executor' parameter of Experiment is 'ray', but Ray is not installed "
                                 "(pip install 'ray==2.58.0').") from None

    def _executor(self, store_path: Path, name: str) -> Executor:
        """The executor object, started for this run (the old string names built here)."""
        executor = self.executor if self.executor is not None else "inline"
        executor = make_executor(executor, self.workers, ray_address=self.ray_address, max_retries=self.max_retries,
                                 storage=self.storage)
        executor.start(RunContext(experiment=name, storage=self._storage(store_path), optimize=self._settings(),
                                  allocation=self.allocation))
        return executor

    def _settings(self) -> Any:
        """The run's cross-model optimization settings, made once: a :class:`tridens.xopt.Settings`
        (``optimize`` itself, or with ``optimize=True`` the environment's), or False (no fusion)."""
        if self.optimize is False:
            return False
        from ..xopt import resolve_settings

        return resolve_settings(self.optimize) or False

    @contextlib.contextmanager
    def _stage_archive(self, db: Store, name: str) -> Iterator[None]:
        """Stage trees store their stages in ``db`` and start from stored ones (``stage_policy``),
        while the block runs; then the checkpoints the policy does not keep are removed."""
        if not self.optimize or not isinstance(self.evaluator, StepwiseEvaluator):
            yield
            return
        from ..store import StageArchive
        from ..xopt import stage_archive

        archive = StageArchive(db, name, self.stage_policy)
        try:
            with stage_archive(self.evaluator, archive):
                yield
        finally:
            with contextlib.suppress(StoreError):
                archive.collect()

    def _storage(self, store_path: Path) -> str:
        """Where workers write checkpoints: ``storage``, or a folder beside the store."""
        if self.storage is not None:
            return os.fspath(self.storage)
        return str(Path(store_path).absolute()) + ".ray"

    def _zoo(self, store_path: Path) -> Any:
        from ..warmup import Zoo

        ws = self.warm_start
        if isinstance(ws, Zoo):
            return ws
        if ws is True:
            return Zoo(store_path)
        if isinstance(ws, (str, os.PathLike)):
            return Zoo(ws)
        raise ValueError(f"The 'warm_start' parameter of Experiment must be True, a store path or a td.warmup.Zoo. Got {ws!r} instead.")

    def _config(self, objective: Objective) -> dict[str, Any]:
        try:
            recipe: dict[str, Any] | None = space_recipe(self.space) if self.space is not None else None
        except RecipeError as err:
            log.warning("the space cannot be rebuilt from the store (%s); export will keep weights and an exported program only", err)
            recipe = None
        main = sys.modules.get("__main__")
        script = os.environ.get("TRIDENS_SCRIPT") or getattr(main, "__file__", None)
        return {
            "space": recipe,
            "script": os.path.abspath(script) if script else None,
            "argv": list(sys.argv[1:]),
            "evaluator": {"type": type(self.evaluator).__name__, "repr": repr(self.evaluator)},
            "strategy": {"type": type(self.strategy).__name__, "repr": repr(self.strategy)},
            "max_trials": self.max_trials,
            "max_duration": self.max_duration,
            "seed": self.seed,
            "seeds": self.seeds,
            "objective": {"metric": objective.metric, "mode": objective.mode},
            "second_objective": list(self.second_objective) if self.second_objective else None,
        }

    def run(self) -> "Experiment":
        """Run (or resume) the exploration until ``max_trials`` trials finished, ``max_duration``
        passed, or the strategy is done. Returns the experiment."""
        global RUN_COUNT
        self._check()
        RUN_COUNT += 1
        strategy = _strategy_by_name(self.strategy) if isinstance(self.strategy, str) or self.strategy is None else self.strategy
        if getattr(strategy, "one_shot", False):  # tridens.oneshot: one supernet instead of separate trials
            from ..oneshot._run import run_oneshot

            return run_oneshot(self, strategy)
        from ._no_model import NoModelSpace
        from ._preflight import check_before_run, check_same_space, describe_space, fill_max_steps

        objective = self._objective()
        path = self._store_path()
        name = self._name()
        space = self.space if self.space is not None else NoModelSpace()
        fill_max_steps(strategy, self.evaluator)  # type: ignore[arg-type]
        # The evaluator's and the strategy's settings, before anything is written or trained.
        described = describe_space(check_before_run(space, self.evaluator, strategy, objective, self.seed))  # type: ignore[arg-type]
        with Store(path) as db:
            db.lock_run(name)  # a second process running this experiment is refused, naming this one
            try:
                record = db.get_experiment(name)
                resumed = True
            except StoreError:
                record, resumed = None, False
            if record is not None and self.resume != "force":
                check_same_space(name, record.config.get("search_space"), described)
            if record is None:
                db.create_experiment(name, {**self._config(objective), "search_space": described})
            claim(db, name)  # settles what a killed earlier driver left running
            run = _Run(self, db, name, strategy, objective, space)
            self.stop_reason = None
            try:
                with unit_memory_limit(self.max_unit_memory), self._stage_archive(db, name):
                    run.loop(resumed)  # fused units bounded in memory; stage trees stored (tridens.xopt)
            except BaseException as err:
                run.progress.close()
                if not resumed and not db.trials(name):
                    db.delete_experiment(name)  # a start that failed leaves nothing behind
                else:
                    mark_interrupted(db, name)
                if isinstance(err, KeyboardInterrupt) and not isinstance(err, ExperimentInterrupted):
                    self.stop_reason = run.interrupted_text(path)
                    raise ExperimentInterrupted(self.stop_reason) from None
                raise
            self.stop_reason = run.stop_reason
            run.progress.close(run.stop_reason)
            log.info("%s stopped: %s", name, run.stop_reason)
            db.update_experiment(name, status="done")
            failed = [t for t in run.finished_here if t.status is TrialStatus.FAILED]
            if run.finished_here and len(failed) == len(run.finished_here):
                reason = (failed[0].error or "").strip().splitlines()[-1] if failed[0].error else "unknown"
                raise ExperimentFailed(f"every trial of {name!r} failed ({len(failed)} in this run; "
                                       f"trial {failed[0].label}: {reason}); their errors are in {path}")
        return self

    def __repr__(self) -> str:
        return f"Experiment(name={self.name!r}, store={str(self._store_path())!r})"


# The structure cache of a run (see _Run._instantiate): restricted samples kept (least recently
# used dropped first; ~0.3 KB each) and hits re-derived to check that the space's structure is a
# function of its sample.
_STRUCTURE_CACHE_SIZE = 4096
_VERIFIED_HITS = 2


def _cpu_only() -> bool:
    """Whether ``torch.manual_seed`` seeds only the CPU generator in this process (no CUDA, MPS,
    XPU, MTIA or custom device available). On such a build it also queues lazy seeding for each
    absent accelerator, formatting a Python stack trace every time: ~0.1-0.2 ms a call here."""
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
    from ..space._mutator import MutatorSpace

    if isinstance(space, ModelSpace):
        return True
    return isinstance(space, MutatorSpace) and not space.mutators


class _Run:
    """The state of one ``run()``: the engine loop and the hooks executors call."""

    def __init__(self, exp: Experiment, db: Store, name: str, strategy: Strategy, objective: Objective,
                 space: BaseSpace):
        from ._progress import Progress

        self.exp, self.db, self.name, self.strategy, self.objective = exp, db, name, strategy, objective
        self.trial_timeout = exp.trial_timeout
        self.evaluator: Evaluator = exp.evaluator  # type: ignore[assignment]
        self.space = space
        self.no_model = exp.space is None  # a hyperparameter-only search: the function builds its model
        self.stop_reason = "the run ended"
        self.deadline = None
        duration = _parse_duration(exp.max_duration)
        if duration is not None:
            self.deadline = time.monotonic() + duration
        self.seen: dict[str, Trial] = {}  # dedup key -> finished trial
        self.progress = Progress(exp.max_trials, objective, enabled=exp.verbose)
        self.finished_here: list[Trial] = []
        self.flops: dict[str, int | None] = {}  # fingerprint -> FLOPs
        self.wants_flops = any(getattr(c, "key", None) == "flops" for c in exp.constraints) or (
            bool(exp.second_objective) and exp.second_objective[0] == "flops")
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
    def started(self, trial: Trial) -> None:
        if trial.status is not TrialStatus.RUNNING:  # (trials trained together are marked as a group)
            trial.status, trial.started_at = TrialStatus.RUNNING, time.time()
            self.db.update_trial(trial)

    def record(self, trial: Trial, step: int, metrics: Mapping[str, float]) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        self.db.add_metrics(trial.id, step, values)
        for key, value in values.items():
            trial.metrics.setdefault(key, []).append(value)
        value = values.get(self.objective.metric, next(iter(values.values()), math.nan))
        self.strategy.report(trial, step, value)
        self.progress.step(trial, step, value)
        self._notify("on_trial_step", trial, step, values)

    def fork(self, trial: Trial, step: int) -> Fork | None:
        return self.strategy.fork(trial, step)

    def forked(self, trial: Trial) -> None:
        self.db.update_trial(trial)  # its lineage (info["schedule"], info["exploits"])

    def decide(self, trial: Trial, step: int) -> Decision:
        decision = self.strategy.decide(trial, step)
        if decision is Decision.STOP:
            trial.status = TrialStatus.STOPPED
        return decision

    def finish(self, trial: Trial, status: TrialStatus, *, error: str | None = None,
               weights: Mapping[str, Any] | None = None, value: float | None = None) -> None:
        trial.status = status
        trial.error = error
        values = trial.metrics.get(self.objective.metric)
        trial.metric = value if value is not None else (values[-1] if values else None)
        trial.finished_at = time.time()
        state = None
        if weights is not None and status in (TrialStatus.COMPLETED, TrialStatus.STOPPED):
            state = dict(weights)
            if self.zoo is not None and trial.id in self.zoo_desc and trial.metric is not None:
                self._add_to_zoo(trial, weights)
        # The checkpoint file, then its row and the trial's in one transaction: written before it
        # counts as done (trial.checkpoint is set).
        if status is TrialStatus.FAILED and not self.no_model:
            from ._preflight import explain_failure

            trial.error = error = explain_failure(self.space, trial.sample, error)  # the failing layer, as freeze() names it
        self.db.finish_trial(trial, state)
        if status is TrialStatus.FAILED:
            log.warning("trial %d failed: %s", trial.label, (error or "").strip().splitlines()[-1] if error else "")
        else:
            self.seen.setdefault(self._dedup_key(trial), trial)
        self.strategy.tell(trial)
        self.finished_here.append(trial)
        self.progress.trial_done(trial)
        self._notify("on_trial_end", trial)

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
        finished = [t for t in trials if t.status.finished]
        interrupted = [t for t in trials if not t.status.finished]
        for t in finished:
            if t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED):
                self.seen.setdefault(self._dedup_key(t), t)
        search_space = self.space.search_space().merged(self.evaluator.search_space())
        self.search_space = search_space
        self.strategy.start(search_space, self.objective, random.Random(self.exp.seed), finished)
        executor = self.executor = self.exp._executor(self.db.path, self.name)
        self.group_index = max((t.group or 0 for t in trials), default=-1) + 1
        self.position = len(trials)
        before = sum(t.status in _FINISHED_COUNTED for t in finished)
        self.progress.start(self.name, before, resumed, finished)
        if interrupted:
            log.info("resuming %s: %d finished trials kept, %d interrupted trials run again",
                     self.name, len(finished), len(interrupted))
            for t in interrupted:
                t.metrics = {}
                t.forget_forks()  # trained again from its start
                self.db.delete_metrics(t.id)  # the re-run writes its own steps
            self._run_jobs([j for j in (self._job(t) for t in interrupted) if j is not None], executor)
        idle = 0
        try:
            while True:
                # Trials that failed before training (constraints, bad shapes) count like any other.
                counted = before + sum(t.status in _FINISHED_COUNTED for t in self.finished_here)
                remaining = None if self.exp.max_trials is None else self.exp.max_trials - counted
                if remaining is not None and remaining <= 0:
                    self.stop_reason = f"max_trials={self.exp.max_trials} reached"
                    break
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    self.stop_reason = (f"max_duration={self.exp.max_duration!r} reached after {counted}"
                                        f"{'' if self.exp.max_trials is None else f'/{self.exp.max_trials}'} trials")
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
                    jobs = []
                    for sample in wave:
                        job = self._new_job(sample, group)
                        if job is not None:
                            jobs.append(job)
                    ran += len(jobs)
                    self._run_jobs(jobs, executor)
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

    def interrupted_text(self, store: Path) -> str:
        """The one line Ctrl-C prints: what was kept and the command that finishes the experiment."""
        done = sum(t.status in _FINISHED_COUNTED for t in self.db.trials(self.name))
        return (f"{self.name!r} interrupted with {done} finished trials kept in {store}; "
                f"finish it with: tridens resume {self.name} --db {store}")

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
        key = known = None
        if self.structures is not None:
            try:
                key = json.dumps(restricted, sort_keys=True)
            except (TypeError, ValueError):  # a value JSON cannot write: no caching for it
                key = None
            known = self.structures.get(key) if key is not None else None
            if known is not None and self.unverified_hits <= 0:
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
        if not self.wants_flops:
            return
        if trial.fingerprint not in self.flops and graph is not None:
            try:
                self.flops[trial.fingerprint] = graph.flops()
            except Exception:  # an op the pass does not know must not fail the trial
                self.flops[trial.fingerprint] = None
        if self.flops.get(trial.fingerprint) is not None:
            trial.info["flops"] = self.flops[trial.fingerprint]

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
        from ..xopt._supergraph import inherit_from_trial

        self.warmed.add(trial.id)
        trial.info["inherit"] = inherit_from_trial(self.db, self.space, trial, model)

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
            log.info("trial %d: no warm start (%s)", trial.id, info.get("reason"))
        elif isinstance(info["parent"], int) and Path(self.zoo.path).resolve() == Path(self.db.path).resolve():
            trial.parent = info["parent"]
        trial.info["warm_start"] = info

    def _add_to_zoo(self, trial: Trial, weights: Mapping[str, Any]) -> None:
        desc = self.zoo_desc.pop(trial.id)
        if desc.get("opaque"):
            log.info("trial %d not added to the zoo: torch.fx cannot trace the model whole (opaque node %s)",
                     trial.id, desc["opaque"])
            return
        if trial.metric is None or math.isnan(trial.metric):
            return
        try:
            self.zoo.add_description(desc, dict(weights), accuracy=self.objective.score(trial.metric),
                                     trial=trial.id, experiment=self.name, store=str(self.db.path))
        except Exception as err:
            log.warning("trial %d not added to the zoo: %s: %s", trial.id, type(err).__name__, err)

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
        return Job(trial, model, trial.max_steps)

    def _seed_of(self, sample: Mapping[str, Any]) -> int:
        """The new trial's seed: from its position in the experiment (ids are global to the
        store), or with ``seeds="per-architecture"`` from the model-space part of its sample."""
        if self.exp.seeds == "per-architecture":
            labels = self.space.search_space() if self.space is not None else {}
            architecture = {k: v for k, v in sample.items() if k in labels}
            return _trial_seed(self.exp.seed, json.dumps(architecture, sort_keys=True, default=str))
        return _trial_seed(self.exp.seed, self.position)

    def _new_job(self, sample: Mapping[str, Any], group: TrialGroup) -> Job | None:
        try:
            clean = self.search_space.validate(sample)
        except InvalidSample as err:
            raise TridensError(f"strategy {type(self.strategy).__name__} proposed an invalid sample: {err}") from err
        trial = Trial(id=-1, sample=clean, seed=self._seed_of(clean), group=self.group_index,
                      max_steps=group.max_steps, experiment=self.name, parent=group.parent_of(sample),
                      number=self.position)
        self.position += 1
        try:
            model = self._instantiate(trial)
        except Exception as err:
            self.db.add_trial(self.name, trial)
            self.finish(trial, TrialStatus.FAILED, error=str(err) if isinstance(err, (InvalidSample, InvalidSpace)) else error_text(err))
            return None
        key = self._dedup_key(trial)
        original = self.seen.get(key)
        if original is not None:
            if model is not None and not any(p.is_meta for p in model.parameters()):
                self.built_duplicates += 1  # initialised for nothing (see _instantiate)
            trial.status = TrialStatus.DUPLICATE
            trial.metric = original.metric
            trial.info["duplicate_of"] = original.id
            trial.finished_at = time.time()
            self.db.add_trial(self.name, trial)
            self.strategy.tell(trial)
            return None
        # One row, written with its fingerprint; _materialize needs the id (warm start, inheritance).
        self.db.add_trial(self.name, trial)
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
        return Job(trial, model, group.max_steps)


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
