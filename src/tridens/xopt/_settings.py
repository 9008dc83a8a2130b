"""The knobs of the cross-model optimizations as ONE frozen object, :class:`Settings`: operator
batching's (:class:`BatchingSettings`) and the shared pipeline's joint step's (:class:`CSESettings`).

An experiment makes one per run -- its executor's ``optimize=True`` (the default) reads the environment
(:meth:`Settings.from_env`), ``optimize=td.xopt.Settings(...)`` gives it whole -- and the planner
hands it to every optimization, which hands its part to the units it builds. Nothing reads a
module global, so two experiments in one process can plan differently, and the Ray executor sends
it to its workers as plain data (:meth:`Settings.as_dict`, :meth:`Settings.from_dict`).

>>> s = Settings().with_batching(mode="force")
>>> s.batching.mode, s.cse.wide
('force', 'auto')
>>> Settings.from_dict(s.as_dict()) == s
True
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ._decision_cache import default_path

__all__ = ["Settings", "BatchingSettings", "CSESettings", "resolve_settings"]

_MODES = ("auto", "force", "off")


@dataclass(frozen=True)
class BatchingSettings:
    """Operator batching (:mod:`tridens.xopt._batching`, whose docstring explains each knob).

    ``mode`` (``$TRIDENS_BATCHING``): ``"auto"`` fuses a group only where its first real steps
    measure a speed-up of ``min_speedup`` or more (``measure_rounds`` timed fused steps;
    ``override_speedup`` replaces the measurement, for tests), ``"force"`` fuses every compatible
    group, ``"off"`` none. ``max_unit_size``: the most models in one unit. ``exact`` (default
    True): every fused model trains bit for bit as it would alone (CPU; any stack, any
    hyperparameters): the grouped-kernel engine runs convolutions and Linear layers per model, and
    a model it does not cover runs its own forward per model; ``False`` allows kernels over all K
    models at once (grouped convolutions, batched matmuls, vmap, channels-last maps), faster but
    equal to separate training only to rounding, which training can amplify. ``packed``: the
    grouped-kernel engine where it applies (else per model, or vmap when not exact).
    ``channels_last``: that engine's 2-d maps channels-last even where separate training runs them
    NCHW (needs ``exact=False``; where the evaluator's ``memory_format`` runs separate training
    channels-last, fused training runs so regardless, exactly). ``keep_freed_memory``: keep
    freed heap blocks for the next fused step (glibc ``mallopt``, process-wide). ``decision_cache``:
    the SQLite file keeping measured speed-ups across processes (:mod:`tridens.xopt._decision_cache`;
    ``""``: this process only; :meth:`Settings.from_env` gives the user's cache file).
    ``marginal_measurements``: a later group of the same key reuses the median of the measured
    speed-ups, except while that median lies within 25% of ``min_speedup`` (either side) and
    fewer than this many were measured: then it measures again (1: always reuse the first).

    >>> BatchingSettings(mode="sometimes")
    Traceback (most recent call last):
    ...
    ValueError: The 'mode' parameter of BatchingSettings must be one of ['auto', 'force', 'off']. Got 'sometimes' instead.
    """

    mode: str = "auto"
    max_unit_size: int = 64
    exact: bool = True
    packed: bool = True
    channels_last: bool = False
    min_speedup: float = 1.1
    measure_rounds: int = 3
    override_speedup: float | None = None
    keep_freed_memory: bool = True
    decision_cache: str = ""
    marginal_measurements: int = 3

    def __post_init__(self) -> None:
        _check_mode("mode", self.mode, "BatchingSettings")
        if not isinstance(self.marginal_measurements, int) or self.marginal_measurements < 1:
            raise ValueError(f"The 'marginal_measurements' parameter of BatchingSettings must be an int in the range "
                             f"[1, inf). Got {self.marginal_measurements!r} instead.")
        if self.exact and self.channels_last:
            raise ValueError("The 'channels_last' parameter of BatchingSettings must be False while 'exact' is True "
                             "(channels-last BatchNorm rounds differently from separate training). Got True instead.")
        if not isinstance(self.max_unit_size, int) or self.max_unit_size < 2:
            raise ValueError(f"The 'max_unit_size' parameter of BatchingSettings must be an int in the range [2, inf). "
                             f"Got {self.max_unit_size!r} instead.")


@dataclass(frozen=True)
class CSESettings:
    """The joint step of shared-pipeline units (:mod:`tridens.xopt._cse`).

    ``joint`` (``$TRIDENS_CSE_JOINT=0`` switches it off): step a unit's whole-model members
    together (their forwards, ONE backward, each optimizer's step) where the memory bound allows.
    ``wide`` (``$TRIDENS_CSE_WIDE``): run compatible first layers as one op -- ``"auto"`` where it
    measured at least ``wide_min_speedup`` faster than the members' own layers (``measure_rounds``
    interleaved rounds), ``"force"`` always, ``"off"`` never. ``foreach_step``: one ``foreach``
    optimizer call per optimizer class and hyperparameters. ``fast_pools``: 2x2 max-pools by the
    exact two-pass kernel where it reproduced the model bit for bit at planning.

    >>> CSESettings().wide in ("auto", "force", "off")
    True
    """

    joint: bool = True
    wide: str = "auto"
    wide_min_speedup: float = 1.1
    measure_rounds: int = 5
    foreach_step: bool = True
    fast_pools: bool = True

    def __post_init__(self) -> None:
        _check_mode("wide", self.wide, "CSESettings")


def _check_mode(name: str, value: Any, owner: str) -> None:
    if value not in _MODES:
        raise ValueError(f"The '{name}' parameter of {owner} must be one of {list(_MODES)}. Got {value!r} instead.")


@dataclass(frozen=True)
class Settings:
    """Every knob of the cross-model optimizations, passed down from the experiment to the planner,
    the optimizations, their units and the Ray workers: ``batching`` (:class:`BatchingSettings`),
    ``cse`` (:class:`CSESettings`) and ``supergraph``.

    >>> import tridens as td
    >>> settings = td.xopt.Settings(batching=td.xopt.BatchingSettings(mode="off"))
    >>> exp = td.Experiment(space, evaluator, executor=td.executors.Inline(optimize=settings))  # doctest: +SKIP
    """

    batching: BatchingSettings = field(default_factory=BatchingSettings)
    cse: CSESettings = field(default_factory=CSESettings)
    supergraph: bool = True
    """Merge the children of one parent into a super-graph (False: each trains apart from the
    parent's weights, the benchmark's comparison)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """The defaults, with ``$TRIDENS_BATCHING`` (auto/force/off), ``$TRIDENS_CSE_JOINT``
        (``0``: off), ``$TRIDENS_CSE_WIDE`` (auto/force/off) and ``$TRIDENS_DECISION_CACHE`` (a
        file; ``off``: measure in every process; unset: ``~/.cache/tridens/batching.sqlite``) applied.

        >>> Settings.from_env({"TRIDENS_BATCHING": "off"}).batching.mode
        'off'
        """
        env = os.environ if environ is None else environ
        try:
            cache = env.get("TRIDENS_DECISION_CACHE") or str(default_path())
            return cls(BatchingSettings(mode=env.get("TRIDENS_BATCHING", "auto"),
                                        decision_cache="" if cache == "off" else cache),
                       CSESettings(joint=env.get("TRIDENS_CSE_JOINT", "1") != "0", wide=env.get("TRIDENS_CSE_WIDE", "auto")))
        except ValueError as err:
            names = {"mode": "TRIDENS_BATCHING", "wide": "TRIDENS_CSE_WIDE"}
            name = next(v for k, v in names.items() if f"'{k}'" in str(err))
            raise ValueError(f"${name} must be one of {list(_MODES)}. Got {env.get(name)!r} instead.") from None

    def with_batching(self, **changes: Any) -> "Settings":
        """A copy with some batching knobs changed.

        >>> Settings().with_batching(packed=False).batching.packed
        False
        """
        return dataclasses.replace(self, batching=dataclasses.replace(self.batching, **changes))

    def with_cse(self, **changes: Any) -> "Settings":
        """A copy with some joint-step knobs changed.

        >>> Settings().with_cse(joint=False).cse.joint
        False
        """
        return dataclasses.replace(self, cse=dataclasses.replace(self.cse, **changes))

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Plain data (JSON-able), e.g. for a Ray task's spec."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, Any]]) -> "Settings":
        """The settings :meth:`as_dict` wrote."""
        return cls(BatchingSettings(**data.get("batching", {})), CSESettings(**data.get("cse", {})),
                   supergraph=bool(data.get("supergraph", True)))


def resolve_settings(optimize: Any) -> Settings | None:
    """What an ``optimize`` argument means: ``False``/``None`` no cross-model optimization (None),
    ``True`` the settings of the environment (:meth:`Settings.from_env`), a :class:`Settings` itself.

    >>> resolve_settings(False) is None, resolve_settings(Settings()) == Settings()
    (True, True)
    """
    if isinstance(optimize, Settings):
        return optimize
    if optimize is None or optimize is False:
        return None
    if optimize is True:
        return Settings.from_env()
    raise ValueError(f"The 'optimize' parameter of Experiment must be True, False or a td.xopt.Settings. "
                     f"Got {optimize!r} instead.")
