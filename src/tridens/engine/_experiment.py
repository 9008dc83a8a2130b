"""``td.Experiment``: what a user configures -- its parameters (stored, checked when a run starts),
reading results back (``trials``, ``top``, ``export``, ``load``), and ``run()``, which opens the
store, settles what an interrupted run left, makes the executor and the cross-model optimization
settings, and hands over to the engine loop (:mod:`._loop`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NoReturn, Sequence


from ..errors import InvalidSpace, TridensError, UnknownMetric
from ..evaluators import Evaluator, StepwiseEvaluator
from ..space import BaseSpace, RecipeError, space_recipe
from ..store import StorageFault, Store, StoreError
from ..strategy import Strategy
from ..trial import Objective, Trial, TrialStatus
from ..units import PlanContext, parse_memory
from ..executors import Executor, InlineExecutor, RunContext, check_forks, make_executor
from ._leftovers import claim, interrupted_text, mark_interrupted, release
from ._loop import _Run, _parse_duration
from ..executors import RunHalted
from ._progress import print_stopped

__all__ = ["Experiment", "Budget", "RunOptions", "ExperimentFailed", "ExperimentInterrupted", "NoFinishedTrial",
           "default_store_path"]

log = logging.getLogger("tridens")

RUN_COUNT = 0  # experiments started in this process (the `tridens run` command checks a script started one)


# The hooks of a tridens.loggers.Callback, in the order a run calls them.
_CALLBACK_HOOKS = ("on_experiment_start", "on_trial_step", "on_trial_end", "on_experiment_end", "close")


_EXECUTOR_OPTIONS = {"workers": "Process(workers=...) or Ray(workers=...)", "ray_address": "Ray(address=...)",
                     "storage": "Ray(storage=...)", "max_retries": "Ray(max_retries=...)"}


def _policy(executor: Any, moved: Mapping[str, Any], key: str, default: Any) -> Any:
    """An executor policy (``optimize``, ``max_unit_memory``, ``allocation``): the executor
    object's own where it sets one, else the deprecated keyword of Experiment, else ``default``.
    Both at once is refused (which one was meant is not ours to guess)."""
    own = getattr(executor, key, None) if isinstance(executor, Executor) else None
    if own is not None:
        if key in moved:
            raise ValueError(f"The '{key}' parameter of Experiment belongs to the executor, which sets it too: "
                             f"pass only td.executors.{type(executor).__name__.removesuffix('Executor')}({key}=...).")
        return own
    return moved.get(key, default)


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


@dataclass(frozen=True)
class Budget:
    """What an experiment may spend: ``max_trials`` (trials in all, earlier runs of a resumed
    experiment included), ``max_duration`` (seconds, or a string such as ``"2h"``, per run: once
    past it, no group starts and the running trials stop after their current step, ``STOPPED``
    with ``info["stopped_by"] == "max_duration"``) and ``trial_timeout`` (seconds one trial may train). ``td.Experiment(..., budget=32)`` is
    ``Budget(max_trials=32)``.

    >>> Budget(max_trials=32, max_duration="1h").max_trials
    32
    """

    max_trials: int | None = None
    max_duration: float | str | None = None
    trial_timeout: float | None = None


@dataclass(frozen=True)
class RunOptions:
    """How a run treats its trials beyond space, evaluator, strategy, budget and executor:
    ``seed`` and ``seeds`` (:data:`SEED_POLICIES`), the ``second_objective`` (name, mode) and the
    ``constraints`` of a multi-objective search, ``warm_start`` (False, True, a store path or a
    ``td.warmup.Zoo``), ``verbose`` (a progress table), ``resume`` (``"auto"``: an experiment of
    the same search space; ``"force"``: any), ``retry_failed`` (a resumed run trains the trials an
    earlier run failed again, or new ones in their place) and ``stage_policy`` (a
    ``td.store.StagePolicy``).

    >>> RunOptions(seed=3, verbose=False).seeds
    'per-trial'
    """

    seed: int = 0
    seeds: str = "per-trial"
    second_objective: tuple[str, str] | None = None
    constraints: Sequence[Any] = ()
    warm_start: Any = False
    verbose: bool = True
    resume: str = "auto"
    retry_failed: bool = True
    stage_policy: Any = None


# Deprecated keywords of Experiment -> the policy object that holds each (its DeprecationWarning names it).
_MOVED = {"max_trials": "budget=td.Budget(max_trials=...)", "max_duration": "budget=td.Budget(max_duration=...)",
          "trial_timeout": "budget=td.Budget(trial_timeout=...)",
          "seed": "options=td.RunOptions(seed=...)", "seeds": "options=td.RunOptions(seeds=...)",
          "second_objective": "options=td.RunOptions(second_objective=...)",
          "constraints": "options=td.RunOptions(constraints=...)", "warm_start": "options=td.RunOptions(warm_start=...)",
          "verbose": "options=td.RunOptions(verbose=...)", "resume": "options=td.RunOptions(resume=...)",
          "retry_failed": "options=td.RunOptions(retry_failed=...)",
          "stage_policy": "options=td.RunOptions(stage_policy=...)",
          "optimize": "executor=td.executors.Inline(optimize=...) (or Process / Ray)",
          "max_unit_memory": "executor=td.executors.Inline(max_unit_memory=...) (or Process / Ray)",
          "allocation": "executor=td.executors.Process(allocation=...) (or Ray)"}
_BUDGET_KEYS = ("max_trials", "max_duration", "trial_timeout")
_OPTION_KEYS = tuple(f.name for f in dataclasses.fields(RunOptions))


def _moved_keywords(given: dict[str, Any]) -> dict[str, Any]:
    """The old keywords in ``given`` (removed from it), each with one DeprecationWarning, one line,
    naming its new home."""
    import warnings

    moved = {}
    for key in [k for k in given if k in _MOVED]:
        warnings.warn(f"Experiment({key}=...) is deprecated: pass {_MOVED[key]}", DeprecationWarning, stacklevel=3)
        moved[key] = given.pop(key)
    return moved


def _with_moved(policy: Any, moved: Mapping[str, Any], keys: Sequence[str], parameter: str) -> Any:
    """``policy`` (a :class:`Budget` or :class:`RunOptions` the caller gave, or None) with the old
    keywords among ``keys``; an old keyword beside a given policy object is refused."""
    given = {k: moved[k] for k in keys if k in moved}
    kind = Budget if parameter == "budget" else RunOptions
    if policy is None:
        return kind(**given)
    if given:
        raise ValueError(f"The '{next(iter(given))}' parameter of Experiment belongs to {parameter}=td.{kind.__name__}"
                         f"(...), which is given too: pass only {parameter}=.")
    return policy


class ExperimentFailed(TridensError):
    """Every trial of a run failed: nothing was learned (the trials and their errors are stored)."""


class NoFinishedTrial(TridensError, ValueError):
    """``Experiment.best()`` of an experiment with no finished trial (none ran, or every one failed)."""


class ExperimentInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run; the message is one line naming the command that resumes it
    (finished trials are kept)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch scheduler preempting the job) stopped a run: handled as Ctrl-C."""


@contextlib.contextmanager
def _sigterm_stops_cleanly() -> Iterator[None]:
    """While the block runs, SIGTERM stops the run as Ctrl-C does: its trials still running are
    ``interrupted`` (not charged a death, so a job preempted any number of times resumes to the
    end) and it says so in one line. Only in the main thread, and only where SIGTERM still has its
    default action (a handler the user installed is kept). Later SIGTERMs, while the run stops,
    are ignored."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the run is stopping: once is enough
        raise Terminated("SIGTERM")

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


_TRIDENS_SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mark_user_error(err: BaseException) -> None:
    """Mark an error a user caused that :meth:`Experiment.run` raises -- a :class:`TridensError`,
    or a ``ValueError`` raised by tridens' own checks (the innermost frame is tridens' code, not
    the user's) -- so that, if it ends a script, it prints as one line (:func:`_print_interrupt_as_one_line`)."""
    if not isinstance(err, (TridensError, ValueError)):
        return
    if not isinstance(err, TridensError):
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None or not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_TRIDENS_SOURCE + os.sep):
            return
    with contextlib.suppress(AttributeError, TypeError):
        setattr(err, "tridens_one_line", True)


def _print_interrupt_as_one_line() -> None:
    """An error that ends a script (``python search.py``) and that a run stopped with on purpose
    -- :class:`ExperimentInterrupted` (Ctrl-C), or a user's mistake marked by
    :func:`_mark_user_error` -- is printed as its one line, as ``tridens run`` prints it, not as a
    traceback through the engine: ``sys.excepthook`` is wrapped once, and passes every other
    exception (and every one, with ``TRIDENS_DEBUG=1``) to the hook it wrapped. Interactive
    shells (IPython, Jupyter) do not call ``sys.excepthook`` for a cell: there the exception
    shows as usual, and can be caught like any other."""
    previous = sys.excepthook
    if getattr(previous, "prints_interrupts", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, ExperimentInterrupted):
            print(f"tridens: {value}", file=sys.stderr, flush=True)
        elif getattr(value, "tridens_one_line", False) and not os.environ.get("TRIDENS_DEBUG"):
            message = " ".join(str(value).split())
            print(f"tridens: error: {message} (TRIDENS_DEBUG=1 shows the traceback)", file=sys.stderr, flush=True)
        else:
            previous(kind, value, tb)

    hook.prints_interrupts = True  # type: ignore[attr-defined]
    sys.excepthook = hook


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


SEED_POLICIES = ("per-trial", "per-architecture")
"""How a trial's seed (its initial weights, dropout) is chosen: from its position in the
experiment, or from its architecture (the model-space part of its sample) and the experiment's
seed -- trials that differ only in training hyperparameters then start from the same weights,
compare with common random numbers, and share training prefixes (stage trees)."""


class Experiment:
    """Explore ``space`` with ``strategy``, training each model with ``evaluator``.

    >>> exp = td.Experiment(Net(), evaluator, td.strategy.RegularizedEvolution(), budget=32,
    ...                     store="tridens.db", name="cnn-search")       # doctest: +SKIP
    >>> exp.run()                                                         # doctest: +SKIP
    >>> exp.top(5)                                                        # doctest: +SKIP

    Running the same script against the same store and name resumes the experiment: finished
    trials are kept, interrupted ones are trained again, and the budget is completed. Trials an
    earlier run failed do not use up the budget: with ``RunOptions(retry_failed=True)`` (the
    default) they are trained again first, with their sample and seed (as Optuna's
    ``RetryFailedCallback``); with False they stay failed and new trials take their place (as
    Optuna's ``MaxTrialsCallback`` counting completed trials). A failure that is an outcome of the
    sample -- a constraint it violates, a process it killed twice -- counts and is not retried. A
    resumed run whose search space or evaluator (settings, data, the training function's code)
    changed is refused unless ``RunOptions(resume="force")``.
    Parameters are only stored here; they are checked when :meth:`run` starts. The experiment
    composes policies: ``budget`` (a :class:`Budget`, or an int: its ``max_trials``), the
    ``executor`` with its own policies (``td.executors.Inline(optimize=..., max_unit_memory=...)``,
    ``Process(workers=..., allocation=...)``, ``Ray(...)``: whether and how trials are fused,
    :mod:`tridens.xopt`, the memory bound of a fused unit, Fluid allocation), ``callbacks``, and
    :class:`RunOptions` for seeds, a second objective, constraints, warm start, verbosity, resume,
    retrying failed trials and the stage policy. The keywords these replace (``max_trials=``,
    ``optimize=``, ``verbose=``, ...) still work for one release, each with a DeprecationWarning
    naming its new place.
    """

    def __init__(self, space: BaseSpace | None, evaluator: Evaluator | None, strategy: Strategy | None = None, *,
                 objective: str | Objective | None = None, budget: Budget | int | None = None,
                 store: str | os.PathLike[str] | None = None, name: str | None = None,
                 executor: Executor | str | None = None, callbacks: Sequence[Any] = (),
                 options: RunOptions | None = None, **deprecated: Any) -> None:
        moved = _moved_keywords(deprecated)   # the keywords of before, each warned about
        if isinstance(budget, int) and not isinstance(budget, bool):
            budget = Budget(max_trials=budget)
        if budget is not None and not isinstance(budget, Budget):
            raise ValueError(f"The 'budget' parameter of Experiment must be a td.Budget or an int (max_trials). "
                             f"Got {budget!r} instead.")
        if options is not None and not isinstance(options, RunOptions):
            raise ValueError(f"The 'options' parameter of Experiment must be a td.RunOptions. Got {options!r} instead.")
        self.budget: Budget = _with_moved(budget, moved, _BUDGET_KEYS, "budget")
        self.options: RunOptions = _with_moved(options, moved, _OPTION_KEYS, "options")
        self.space = space
        self.evaluator = evaluator
        self.strategy = strategy
        self.max_trials = self.budget.max_trials
        self.max_duration = self.budget.max_duration
        self.store = store
        self.name = name
        self.objective = objective
        self.seed = self.options.seed
        self.seeds = self.options.seeds  # "per-trial" or "per-architecture" (SEED_POLICIES)
        self.executor = executor  # td.executors.Inline() (None), Process(...) or Ray(...)
        self.trial_timeout = self.budget.trial_timeout
        self.constraints = self.options.constraints
        self.second_objective = self.options.second_objective
        # the executor's policies: its own, else those given the old way (optimize=, ...), else the defaults
        self.optimize = _policy(executor, moved, "optimize", True)
        self.max_unit_memory = _policy(executor, moved, "max_unit_memory", None)  # a fused unit's bound (tridens.xopt)
        self.allocation = _policy(executor, moved, "allocation", None)  # Fluid: shares of the workers per trial
        self.verbose = self.options.verbose
        self.warm_start = self.options.warm_start  # False, True (a zoo beside the store), a store path or a td.warmup.Zoo
        # The executor's own settings given to the experiment (workers=, ray_address=, storage=,
        # max_retries=): still accepted, with a DeprecationWarning; they belong to the executor object.
        executor_settings = _executor_options(executor, deprecated)
        self.workers = executor_settings.get("workers", 2)
        self.ray_address = executor_settings.get("ray_address")  # executor="ray": None starts a local Ray
        self.storage = executor_settings.get("storage")  # where Ray workers write checkpoints
        self.max_retries = executor_settings.get("max_retries", 0)  # a Ray unit whose worker died restarts
        self.resume = self.options.resume  # "auto": resume an experiment of the same search space; "force": any
        # A resumed run trains the trials an earlier run failed again (True), or new ones in their place (False)
        self.retry_failed = self.options.retry_failed
        self.stop_reason: str | None = None  # why the last run() stopped
        self.callbacks = list(callbacks)  # tridens.loggers.Callback objects, told what the run records
        self.stage_policy = self.options.stage_policy  # a td.store.StagePolicy: stage-tree checkpoints shared through the store
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
        stored = config.get("second_objective")   # [name, mode] in the store's JSON
        second = (str(stored[0]), str(stored[1])) if stored else None
        exp = cls(None, None, None, store=path, name=name, budget=Budget(max_trials=config.get("max_trials")),
                  objective=record.objective() if "objective" in config else None,
                  options=RunOptions(seed=config.get("seed", 0), seeds=config.get("seeds", "per-trial"),
                                     second_objective=second))
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
        from ..strategy import best_first

        second = Objective(*self.second_objective) if self.second_objective else None
        return best_first(self.trials(), self._objective(), second)[:k]

    def best(self) -> Trial:
        """The best finished trial. Raises :class:`NoFinishedTrial` (a ``ValueError``, as Optuna's
        ``study.best_trial``) when none finished with a value: none ran yet, or every one failed.

        >>> exp.best().sample                                             # doctest: +SKIP
        {'width': 32, 'lr': 0.05}
        """
        top = self.top(1)
        if not top:
            trials = self.trials()
            failed = sum(t.status is TrialStatus.FAILED for t in trials)
            done = any(t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED) for t in trials)
            why = (f"every trial failed ({failed} failed; their errors: tridens show {self._name()})"
                   if failed and not done else f"none of its {len(trials)} trials finished with a value")
            raise NoFinishedTrial(f"experiment {self._name()!r} has no best trial: {why}")
        return top[0]

    def export(self, directory: str | os.PathLike[str], top: int = 1, trust_code: bool = False, *, force: bool = False,
               allow_modules: Sequence[str] = ()) -> list[Path]:
        """Write the ``top`` best models to ``directory``, one ``rank{r}-trial{n}/`` folder each, with
        what :func:`tridens.load` needs to rebuild them: weights, sample, space recipe, metrics.
        A non-empty ``directory`` is refused unless ``force`` (which replaces the exports in it).
        The space's modules are imported only when already imported, in ``allow_modules``, or with
        ``trust_code`` (:func:`tridens.space.build_space`)."""
        from ._export import export_trials

        with Store(self._store_path(), readonly=True) as db:
            record = db.get_experiment(self._name())
            trials = self.top(top)
            # trust_code: the recorded space may name a script; importing it runs it (tridens.space.build_space)
            return export_trials(db, record.config, trials, Path(directory), trust_code=trust_code, force=force,
                                 allow_modules=allow_modules)

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
        if not isinstance(self.retry_failed, bool):
            raise ValueError(f"The 'retry_failed' parameter of Experiment must be a bool. Got {self.retry_failed!r} instead.")
        if self.resume not in ("auto", "force"):
            raise ValueError(f"The 'resume' parameter of Experiment must be one of ['auto', 'force']. Got {self.resume!r} instead.")
        if isinstance(self.strategy, str):
            _strategy_by_name(self.strategy)
        elif self.strategy is not None and not isinstance(self.strategy, Strategy) and not getattr(self.strategy, "one_shot", False):
            raise ValueError(f"The 'strategy' parameter of Experiment must be a td.strategy.Strategy (e.g. "
                             f"td.strategy.Random()). Got {self.strategy!r} instead.")
        if self.max_trials is not None and (not isinstance(self.max_trials, int) or self.max_trials < 1):
            raise ValueError(f"The 'max_trials' of td.Budget must be an int in the range [1, inf). Got {self.max_trials!r} instead.")
        if self.trial_timeout is not None and not (isinstance(self.trial_timeout, (int, float)) and self.trial_timeout > 0):
            raise ValueError(f"The 'trial_timeout' of td.Budget must be a positive number of seconds. Got {self.trial_timeout!r} instead.")
        if self.seeds not in SEED_POLICIES:
            raise ValueError(f"The 'seeds' parameter of Experiment must be one of {list(SEED_POLICIES)!r}. Got {self.seeds!r} instead.")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"The 'workers' parameter of Experiment must be an int in the range [1, inf). Got {self.workers!r} instead.")
        if self.allocation is not None:
            from ..executors import fluid_policy

            fluid_policy(self.allocation)  # Fluid shares of the workers (tridens.executors)
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

    def _executor(self, store_path: Path, name: str, plan: PlanContext | None = None) -> Executor:
        """The executor object, started for this run (the old string names built here) with the
        run's plan context ``plan``."""
        executor = self.executor if self.executor is not None else "inline"
        executor = make_executor(executor, self.workers, ray_address=self.ray_address, max_retries=self.max_retries,
                                 storage=self.storage)
        executor.start(RunContext(experiment=name, storage=self._storage(store_path), optimize=self._settings(),
                                  allocation=self.allocation, forks=bool(getattr(self.strategy, "forks", False)),
                                  plan=plan if plan is not None else self._plan_context(), verbose=bool(self.verbose)))
        return executor

    def _settings(self) -> Any:
        """The run's cross-model optimization settings, made once: a :class:`tridens.xopt.Settings`
        (``optimize`` itself, or with ``optimize=True`` the environment's), or False (no fusion)."""
        if self.optimize is False:
            return False
        from ..xopt import resolve_settings

        return resolve_settings(self.optimize) or False

    def _plan_context(self) -> PlanContext:
        """A new run's plan context: its settings and memory bound, nothing measured yet."""
        return PlanContext(settings=self._settings() or None,
                           max_unit_memory=parse_memory(self.max_unit_memory, "max_unit_memory", "Experiment"))

    @contextlib.contextmanager
    def _stage_archive(self, db: Store, name: str, plan: PlanContext) -> Iterator[None]:
        """Stage trees store their stages in ``db`` and start from stored ones (``stage_policy``),
        through ``plan.archive`` while the block runs; then the checkpoints the policy does not
        keep are removed."""
        if not self.optimize or not isinstance(self.evaluator, StepwiseEvaluator):
            yield
            return
        from ..store import StageArchive

        archive = plan.archive = StageArchive(db, name, self.stage_policy)
        archive.remove_orphans()   # stages whose trials are gone (a deleted experiment's), a resume included
        try:
            yield
        finally:
            plan.archive = None
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

    def _record_new_limits(self, db: Store, name: str, config: Mapping[str, Any]) -> None:
        """A resumed run's own ``max_trials`` / ``max_duration`` replace the stored ones, so that the
        store, ``tridens ls`` and ``tridens resume`` count against the budget this run was given."""
        changed = {key: value for key, value in (("max_trials", self.max_trials), ("max_duration", self.max_duration))
                   if config.get(key) != value}
        if changed:
            log.info("%s: %s", name, ", ".join(f"{k} {config.get(k)!r} -> {v!r}" for k, v in changed.items()))
            db.update_experiment(name, config={**config, **changed})

    def _interrupted(self, db: Store, name: str, path: Path, err: BaseException | None = None) -> NoReturn:
        """Ctrl-C (or SIGTERM: ``err`` is :class:`Terminated`) stopped a run of ``name`` (multi-trial
        or one-shot): the one line saying what was kept and how to finish it becomes the stop
        reason, raised as :class:`ExperimentInterrupted` (printed as that line, not a traceback,
        when it ends a script)."""
        try:
            self.stop_reason = interrupted_text(db, name, path)
        except StoreError:  # stopped before the experiment was stored
            self.stop_reason = f"{name!r} interrupted before anything was stored"
        if isinstance(err, Terminated):
            self.stop_reason = f"SIGTERM: {self.stop_reason}"
        _print_interrupt_as_one_line()
        raise ExperimentInterrupted(self.stop_reason) from None

    def _stopped(self, name: str, reason: str) -> None:
        """A run of ``name`` ended (multi-trial or one-shot): ``reason`` is the stop reason and its last line."""
        self.stop_reason = reason
        if self.verbose:
            print_stopped(name, reason)
        log.info("%s stopped: %s", name, reason)

    def run(self) -> "Experiment":
        """Run (or resume) the exploration until ``max_trials`` trials finished, ``max_duration``
        passed, or the strategy is done. Returns the experiment. Ctrl-C or SIGTERM stops it
        cleanly (:class:`ExperimentInterrupted`): finished trials are kept, the running ones run
        again on the next run."""
        _print_interrupt_as_one_line()
        try:
            with _sigterm_stops_cleanly():
                return self._run()
        except (TridensError, ValueError) as err:
            _mark_user_error(err)
            raise

    def _run(self) -> "Experiment":
        global RUN_COUNT
        self._check()
        RUN_COUNT += 1
        strategy = _strategy_by_name(self.strategy) if isinstance(self.strategy, str) or self.strategy is None else self.strategy
        if getattr(strategy, "one_shot", False):  # tridens.oneshot: one supernet instead of separate trials
            from ..oneshot import OneShotStrategy
            from ._oneshot import run_one_shot

            assert isinstance(strategy, OneShotStrategy)  # its one_shot marker says so
            from ._preflight import check_evaluator

            check_evaluator(self.evaluator, self._objective(), constraints=self.constraints,  # type: ignore[arg-type]
                            second_objective=self.second_objective)
            self.stop_reason = None
            try:
                reason = run_one_shot(self, strategy)
            except KeyboardInterrupt as err:
                if isinstance(err, ExperimentInterrupted):
                    raise
                with Store(self._store_path()) as db:
                    mark_interrupted(db, self._name())  # the supernet's checkpoint and the scored subnets stay
                    self._interrupted(db, self._name(), self._store_path(), err)
            except (RunHalted, StorageFault) as err:
                # A storage fault (full disk, the store file gone) stops the run in one line; what is
                # stored stays (the supernet's last checkpoint, the scored subnets) for the next run.
                fault = err.cause if isinstance(err, RunHalted) else err
                with contextlib.suppress(StoreError), Store(self._store_path()) as db:
                    mark_interrupted(db, self._name(), quiet=True)
                self.stop_reason = str(fault)
                _print_interrupt_as_one_line()
                raise fault from None
            self._stopped(self._name(), reason)
            return self
        from ._no_model import NoModelSpace
        from ..evaluators import evaluator_fingerprint
        from ._preflight import check_before_run, check_same_evaluator, check_same_space, describe_space, fill_max_steps

        objective = self._objective()
        path = self._store_path()
        name = self._name()
        space = self.space if self.space is not None else NoModelSpace()
        fill_max_steps(strategy, self.evaluator)  # type: ignore[arg-type]
        # The evaluator's and the strategy's settings, before anything is written or trained.
        measured = self.space is not None and getattr(self.evaluator, "needs_model", True)  # params, flops, latency
        described = describe_space(check_before_run(space, self.evaluator, strategy, objective, self.seed,  # type: ignore[arg-type]
                                                    constraints=self.constraints, second_objective=self.second_objective,
                                                    measured=measured))
        with Store(path) as db, contextlib.ExitStack() as leaving:
            db.lock_run(name)  # a second process running this experiment is refused, naming this one
            try:
                record = db.get_experiment(name)
                resumed = True
            except StoreError:
                record, resumed = None, False
            computes = evaluator_fingerprint(self.evaluator)  # settings, data and code: what a trial computes
            if record is not None and self.resume != "force":
                check_same_space(name, record.config.get("search_space"), described)
                if any(t.status in (TrialStatus.COMPLETED, TrialStatus.STOPPED) for t in db.trials(name)):
                    # (an experiment whose every trial failed has nothing to compare with: the fix trains)
                    check_same_evaluator(name, record.config.get("evaluator_fingerprint"), computes)
            if record is not None and self.objective is None and self.evaluator.objective_from_reports:  # type: ignore[union-attr]
                objective = record.objective()  # the name an earlier run's first report gave it
            if record is None:
                db.create_experiment(name, {**self._config(objective), "search_space": described,
                                            "evaluator_fingerprint": computes})
            else:
                self._record_new_limits(db, name, record.config)
                if record.config.get("evaluator_fingerprint") != computes:  # (recorded by an older tridens, or forced)
                    config = db.get_experiment(name).config
                    db.update_experiment(name, config={**config, "evaluator_fingerprint": computes})
            lease = claim(db, name)  # settles what a killed earlier driver left running
            leaving.callback(release, db, name, lease)   # however the run ends, short of being killed
            plan = self._plan_context()   # this run's planning state, nothing shared with another run
            run = _Run(self, db, name, strategy, objective, space, plan)
            self.stop_reason = None
            try:
                with self._stage_archive(db, name, plan):
                    run.loop(resumed)  # stage trees stored (tridens.xopt)
            except BaseException as err:
                run.progress.close()
                # A storage fault (full disk, the store file gone) or an executor's (the process
                # that starts workers gone) stops the run: its running trials stay unfinished, to
                # run again on the next run.
                halted = err.cause if isinstance(err, RunHalted) else err if isinstance(err, StorageFault) else None
                try:
                    trials = db.trials(name)
                    if not resumed and (not trials or (isinstance(err, UnknownMetric)
                                                       and not any(t.status.finished for t in trials))):
                        db.delete_experiment(name)  # a start that failed leaves nothing behind
                    else:
                        mark_interrupted(db, name, quiet=halted is not None)
                except StoreError:
                    if halted is None:
                        raise
                if isinstance(err, KeyboardInterrupt) and not isinstance(err, ExperimentInterrupted):
                    self._interrupted(db, name, path, err)
                if halted is not None:
                    self.stop_reason = str(halted)
                    _print_interrupt_as_one_line()
                    raise halted from None
                raise
            run.progress.close()
            self._stopped(name, run.stop_reason)
            db.update_experiment(name, status="done")
            failed = [t for t in run.finished_here if t.status is TrialStatus.FAILED]
            if run.finished_here and len(failed) == len(run.finished_here):
                reason = (failed[0].error or "").strip().splitlines()[-1] if failed[0].error else "unknown"
                raise ExperimentFailed(f"every trial of {name!r} failed ({len(failed)} in this run; "
                                       f"trial {failed[0].label}: {reason}); their errors are in {path}")
        return self

    def __repr__(self) -> str:
        return f"Experiment(name={self.name!r}, store={str(self._store_path())!r})"
