"""Operator batching: K same-shaped models trained as ONE vectorized model.

Trials whose models have the same structure (module tree, parameter and buffer shapes, forward
graph; Dropout ``p`` and the activation modules may differ: :mod:`._variants`) and whose training
setups agree on everything but the learning rate, momentum, weight decay and lr schedule (same optimizer kind, batch size, epochs, loss, data,
transforms and data order) are stacked with ``torch.func``: parameters and buffers become tensors
with a leading model dimension, the forward is ``vmap(functional_call(...))`` over it, and the
shared input batch is *not* batched (``in_dims=None``), so the first layer runs as one wide
convolution / matmul with K times the output channels. Per-model hyperparameters are tensors
broadcast over the model dimension, and the optimizer step (SGD, Adam, AdamW, RMSprop, with
``torch.optim``'s semantics) is vectorized.

Two engines run the stacked forward (``BatchedMember.engine`` says which; the unit's log line too):

* **grouped kernels** (default where it applies, :class:`~._grouped.GroupedProgram`, an fx pass): for models whose fx
  graph is a chain (with adds) of Conv1d/2d, Linear, BatchNorm1d/2d, pooling, activations,
  Flatten and dropout, the K models run without vmap on packed tensors: ``(B, K*C, H, W)`` for
  feature maps (the first convolution as ONE convolution with K*O outputs on the shared input,
  later ones as one grouped convolution, BatchNorm over K*C channels with the stacked running
  statistics as views, pooling/activations as they are) and ``(K, B, F)`` after Flatten (Linear
  as one ``baddbmm``; a Linear on the shared input as one matmul with K*O outputs). It is used
  only after it reproduced the vmapped forward on the first batch.
* **vmap** (the fallback for everything else): ``vmap(functional_call(...))``.

Fused equals separate (CPU):

* Dropout modules (``nn.Dropout``, ``Dropout1d/2d/3d``) are replaced in the fused forward by a
  multiplication with masks drawn *outside* vmap, per model, from that trial's own random stream
  (a ``torch.Generator`` started like :class:`SupervisedTrainer`'s: ``manual_seed(seed)``), in
  forward order, exactly as ``F.dropout`` draws them on CPU: ``empty_like(x).bernoulli_(1 - p)
  .div_(1 - p)`` (feature dropout: one value per ``(sample, channel)``). The masks are therefore
  the ones each separate trainer would draw, bit for bit. Any other random op in a forward makes
  the planner leave the group unfused (vmap runs with ``randomness="error"``). On CUDA the masks
  are drawn per model from CUDA generators seeded with the trial seed: independent, but not the
  ones a separate trainer's fused dropout kernel draws.
* BatchNorm running statistics are stacked buffers, updated in the fused forward in training
  mode and used in eval mode: per model.
* Per-model train loss and validation metrics every epoch, with the same names, reductions and
  Python-float accumulation as :meth:`SupervisedTrainer.validate`.

* Exact kernels (``BatchingSettings.exact``, default True): the vectorized optimizer repeats
  ``torch.optim``'s per-parameter operations on each model's rows with its own scalars
  (:mod:`._vector_optim`), each model's loss runs on its own contiguous rows, and the grouped
  program runs convolutions and Linear layers per model (:mod:`._exact`): every model's values
  and gradients are separate training's bit for bit (tests/xopt/test_exact.py, every step). A
  model the grouped program does not cover runs its own forward per model ("per model" engine).
  ``exact=False`` allows the kernels over all K models at once (one grouped convolution, one
  ``baddbmm``, :class:`~tridens.xopt._kernels.BatchNormTrain`, vmap): what differs is then
  floating-point rounding, which adaptive optimizers can amplify (the tests hold per-epoch
  metrics within 1e-4 in float32).

A model whose loss becomes NaN/inf fails alone (:class:`NonFiniteLoss`, same message as the
separate trainer) and leaves the stack before the optimizer step; a model the strategy stops
leaves through :meth:`BatchedUnit.drop`; the others' arithmetic is independent of both.

**When it pays.** On a CPU, vmapped convolutions become grouped convolutions, which can be slower
than K ordinary ones (compute-bound CNNs can train slower fused than separately), while small
models gain a lot (BENCHMARKS.md, "Operator batching"). So a group whose fusion has not been measured yet becomes an
:class:`~tridens.xopt._adaptive.AdaptiveUnit`, which decides from its OWN first real training steps
(no throwaway steps; see :mod:`tridens.xopt._adaptive`): one model's first separate steps (a
roofline check against the peak matmul rate first), then fused steps interleaved with them, and
keeps training whichever way pays, with results exactly those of fused or separate training from
the start. The speed-up is cached per (structure, setup, K, device type, threads): later groups
with the same key are planned fused (an adaptive unit that starts fused and measures again if its
stack shrinks) or left to the next optimization and separate training directly, from the median of
the measurements -- except while that median is within 25% of ``min_speedup`` and fewer than
``marginal_measurements`` were taken, where one noisy measurement may have landed on the wrong
side: those groups measure again (:func:`settled_speedup`). Kept for the run in its plan context
(:class:`tridens.units.PlanContext`, ``decisions``), and in later runs on the same machine through the file ``BatchingSettings.decision_cache`` names
(:mod:`tridens.xopt._decision_cache`). Grouping traces a model's graph only where another model
shares its module tree and tensor shapes, and once per set of models whose modules agree in class
and plain attributes (:func:`_attribute_key`), once per run. Knobs (:class:`~tridens.xopt.BatchingSettings`, the ``batching`` part of
the :class:`~tridens.xopt.Settings` the planner is given):

* ``mode`` (``$TRIDENS_BATCHING``): ``"auto"`` (decide from real steps, default),
  ``"force"`` (fuse every compatible group whatever the measurement: used by tests to compare fused
  with separate), ``"off"``.
* memory: a unit's estimated parameters + gradients + optimizer state + activations stay under
  the experiment's ``max_unit_memory`` (one bound for every optimization, resolved by
  :func:`tridens.units.resolve_max_unit_memory`: ``td.executors.Inline(max_unit_memory=)``,
  ``$TRIDENS_MAX_UNIT_MEMORY``, else half the RAM / 80% of free GPU memory; or
  ``plan_batching(..., max_unit_memory=)``); larger groups are split. The estimate comes from one
  evaluation-mode forward of one model on 8 examples (:func:`_model_costs`).
* ``max_unit_size`` (default 64): the most models in one unit. Within it the size is measured
  (:func:`measured_unit_size`): later groups use the stack size ``k`` (size, size/2, ...) whose
  settled speed-up was best, and a group whose fusion ``k`` at a time measured below the bar
  tries ``k/2`` (at least 4) next.
* ``min_speedup`` (default 1.1): the measured speed-up a group must reach to stay fused
  (measured on real, different batches in CPU time).
* ``measure_rounds`` (default 3): timed fused steps (after one warm-up) before deciding;
  up to twice as many while the ratio is at most 25% above ``min_speedup`` (confirming a
  marginal fusion; below the bar the group goes separate at once).
* No rule of thumb decides: one model's separate step rate against the peak fp32 matmul rate
  (:func:`peak_matmul_flops`) is recorded and logged beside the measured speed-up, but a group
  whose models already run near the peak still measures (a rule that skipped fusion near the
  peak turned down fusions of small CNNs that paid).
* ``override_speedup`` (default None): replaces the measured speed-up in the decision
  (tests drive both paths with it on real training).
* ``packed`` (default True): use the grouped-kernel engine where it applies.
* ``keep_freed_memory`` (default True, Linux/glibc): a fused step allocates and frees
  activations of several MiB each; glibc returns such blocks to the system and takes them back at
  the next step, page fault by page fault (a large share of a small step's CPU time). The first batched member sets ``mallopt`` so blocks up to 64 MiB come from
  the heap and up to 512 MiB of freed heap is kept for reuse (process-wide; numerics unchanged).
* ``channels_last`` (default False; always on where the evaluator's ``memory_format`` runs separate
  training channels-last, e.g. under a mixed ``precision``): run the grouped engine's 2-d feature
  maps channels-last (convolution weights too, so outputs stay channels-last without copies).
  Against NCHW separate training that is not exact (the channels-last BatchNorm sums in float
  where the NCHW kernel sums in double), so it needs ``exact=False``; against channels-last
  separate training the exact program runs each model's convolution and BatchNorm on its own map.

2x2 max-pools on per-model maps run as :class:`_MaxPool2x2` (two passes, bit-identical values and
gradients, faster forward than the NCHW kernel on small maps), taking over a ReLU right before
them (exact: max commutes with ReLU); without gradients (validation) only the maxima are computed.
Training BatchNorm of packed maps of >= 256 Ki values runs as :class:`~tridens.xopt._kernels.
BatchNormTrain` (vectorized plane sums with float64 over the batch, as accurate as the native
kernel and faster on packed small maps), with a ReLU right after it folded in.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import statistics
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from ..units import Decisions, ExecutionUnit, Job, PlanContext
from ..evaluators import StepwiseEvaluator
from ..evaluators import TrainConfig, BatchSource, SupervisedEvaluator
from ._batched import BatchedMember, BatchedUnit
from ._decision_cache import SEPARATE_STEP, DecisionCache, stored_key
from ._settings import BatchingSettings, CSESettings, Settings
from ._stacked import _DROPOUTS, _ForwardState, _first_line, _forward_state
from ._variants import is_hook_attribute, is_site, order_by_variant, sites_as_placeholders

__all__ = ["BatchedUnit", "BatchingSettings", "plan_batching", "group_key"]

log = logging.getLogger("tridens")


MARGIN = 1.25
"""A speed-up within this factor of ``min_speedup`` (either side) is *marginal*: one measurement
of it may fall on the wrong side, so later groups measure again (:func:`settled_speedup`)."""


def settled_speedup(measured: Sequence[float], settings: BatchingSettings) -> float | None:
    """The speed-up a group is planned from: the median of the ``measured`` ones, or None (measure
    again) where there are none, or the median is marginal (within :data:`MARGIN` of
    ``settings.min_speedup``) and fewer than ``settings.marginal_measurements`` were taken.

    >>> settings = BatchingSettings()                      # min_speedup 1.1, marginal_measurements 3
    >>> settled_speedup([2.4], settings), settled_speedup([1.0], settings), settled_speedup([1.0, 1.2, 1.05], settings)
    (2.4, None, 1.05)
    """
    if not measured:
        return None
    ratio = statistics.median(measured)
    bar = settings.min_speedup
    if len(measured) < settings.marginal_measurements and bar / MARGIN <= ratio <= bar * MARGIN:
        return None
    return ratio


# -- grouping ----------------------------------------------------------------------------------------
def _structure_key(model: nn.Module) -> str:
    """The graph fingerprint of ``model`` with every dropout's ``p`` normalized (p may differ
    within a unit) and every activation site seen as one placeholder (the activation may differ:
    :mod:`._variants`), plus its parameter and buffer names and shapes (what stacking needs)."""
    from ..graph import trace

    dropouts = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and type(m) in _DROPOUTS]
    saved = [m.p for m in dropouts]
    try:
        for m in dropouts:
            m.p = 0.5
        with warnings.catch_warnings(), sites_as_placeholders(model):
            warnings.simplefilter("ignore")
            fingerprint = trace(model).fingerprint()
    finally:
        for m, p in zip(dropouts, saved):
            m.p = p
    tensors: list[tuple[Any, ...]] = [(n, tuple(t.shape), str(t.dtype), t.requires_grad)
                                      for n, t in model.named_parameters()]
    tensors += [(n, tuple(t.shape), str(t.dtype)) for n, t in model.named_buffers()]
    digest = hashlib.blake2b(repr(tensors).encode(), digest_size=16).hexdigest()  # the same in every process
    return f"{fingerprint}|{digest}"


def _data_key(ds: Any) -> Any:
    return getattr(ds, "spec", None) or id(ds)


# The parts of a TrainConfig that must agree within a unit, with the reason given when they don't.
_SETUP_FIELDS: tuple[tuple[str, Callable[[TrainConfig, int], Any]], ...] = (
    ("optimizer", lambda c, s: c.optimizer),
    ("batch size", lambda c, s: (c.batch_size, c.batch_schedule)),
    ("epochs", lambda c, s: c.epochs),
    ("loss", lambda c, s: id(c.loss)),
    ("metrics", lambda c, s: c.metrics),
    ("training data", lambda c, s: _data_key(c.train)),
    ("validation data", lambda c, s: _data_key(c.val)),
    ("transforms", lambda c, s: id(c.transforms)),
    ("data order", lambda c, s: c.data_seed_of(s)),
    ("device", lambda c, s: str(c.device)),
    ("task", lambda c, s: c.task),
    ("precision", lambda c, s: c.precision),
    ("memory format", lambda c, s: c.memory_format),
)


def _setup_key(cfg: TrainConfig, seed: int) -> tuple[Any, ...]:
    return tuple(get(cfg, seed) for _, get in _SETUP_FIELDS)


def group_key(model: nn.Module, cfg: TrainConfig, seed: int) -> tuple[str, tuple[Any, ...]]:
    """``(structure key, setup key)``: trials with equal keys can train as one batched unit."""
    return _structure_key(model), _setup_key(cfg, seed)


# -- the planner ---------------------------------------------------------------------------------------
def _per_model_bytes(unit: BatchedMember, x: torch.Tensor) -> int:
    """Estimated bytes one model adds to a unit: parameters, gradients, optimizer state, buffers,
    and twice the outputs of its leaf modules on a training batch (activations kept for backward
    and their gradients)."""
    states = {"sgd": 1, "adam": 2, "adamw": 2, "rmsprop": 2}.get(unit.cfg.optimizer, 2)
    param_bytes = sum(p[0].numel() * p.element_size() for p in unit.params.values())
    buffer_bytes = sum(b[0].numel() * b.element_size() for b in unit.buffers.values())
    activations = 0

    def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
        nonlocal activations
        if isinstance(output, torch.Tensor):
            activations += output.numel() * output.element_size()

    handles = [m.register_forward_hook(hook) for m in unit.base.modules() if not list(m.children())]
    try:
        params = {n: p[0].detach() for n, p in unit.params.items()}
        buffers = {n: b[0].clone() for n, b in unit.buffers.items()}
        with torch.no_grad(), _forward_state(_ForwardState(record=[])):
            functional_call(unit.base, (params, buffers), (x,))
    finally:
        for h in handles:
            h.remove()
    return param_bytes * (2 + states) + buffer_bytes + 2 * activations


def _first_batch(cfg: TrainConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    source = BatchSource(cfg.train, cfg.device)
    x, y = next(iter(source.epoch_batches(cfg, seed, 0)))
    return cfg.augment(x, seed, 0, 0), y


def peak_matmul_flops(device: torch.device) -> float:
    """FLOPs per CPU second of a 256x256 fp32 matmul on ``device`` (a warm-up, then the best of
    eight; cached per process and thread count): the roof one model's step is compared with. Small
    on purpose: a larger probe costs a noticeable share of planning small models and reads about
    the same rate."""
    return _peak_matmul_flops(device.type, torch.get_num_threads())


@functools.lru_cache(maxsize=None)  # a fact of this machine and thread count, not of a run
def _peak_matmul_flops(device_type: str, threads: int) -> float:
    a, b = torch.randn(256, 256, device=device_type), torch.randn(256, 256, device=device_type)
    a @ b
    best = 0.0
    for _ in range(8):
        t0 = time.process_time()
        a @ b
        best = max(best, 2 * 256 ** 3 / max(time.process_time() - t0, 1e-6))
    return best


def _probe(jobs: Sequence[Job], evaluator: SupervisedEvaluator, x: torch.Tensor, y: torch.Tensor,
           settings: BatchingSettings) -> BatchedMember:
    """A throwaway member that ran one fused step and a validation batch (proves the models
    vectorize, and finds whether they can share their input). Forced fusion only: an adaptive
    unit finds the same on its first real steps."""
    probe = BatchedMember(jobs, evaluator, settings=settings)
    probe.begin_epoch()
    probe.train_batch(x, y, 0)
    probe.begin_validation()
    probe.validate_batch(x, y)
    probe.end_validation()
    return probe


class _SeesMaxPools(TorchFunctionMode):
    """Notes whether a forward calls a 2-d max-pool (module or functional)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen = self.seen or "max_pool2d" in getattr(func, "__name__", "")
        return func(*args, **(kwargs or {}))


def _model_costs(model: nn.Module, x: torch.Tensor, cfg: TrainConfig) -> tuple[int, float, bool]:
    """``(bytes one model adds to a unit, training FLOPs of one step, whether it max-pools)`` from
    ONE evaluation-mode forward of the model on 8 examples of ``x`` under ``no_grad`` with copies of its buffers (nothing
    of the model changed, no random numbers drawn; cheaper than a meta-device forward or
    ``torch.utils.flop_counter``): parameters, gradients, optimizer state and
    buffers, plus twice the outputs of its leaf modules scaled to the batch (as
    :func:`_per_model_bytes`). FLOPs are those of its ``Linear`` and ``Conv`` layers (the matmul-like
    work the roofline compares with the peak matmul rate; other layers count 0, which can only
    understate the rate and so lead to measuring fusion), times 3 for forward and backward. Max-pools
    are what separate trainers run with exact faster kernels (the timing trial is checked for
    them only where there are some)."""
    states = {"sgd": 1, "adam": 2, "adamw": 2, "rmsprop": 2}.get(cfg.optimizer, 2)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    activations = 0
    flops = 0.0

    def hook(module: nn.Module, _inputs: Any, output: Any) -> None:
        nonlocal activations, flops
        if not isinstance(output, torch.Tensor):
            return
        activations += output.numel() * output.element_size()
        if isinstance(module, nn.Linear):
            flops += 2.0 * module.in_features * output.numel()
        elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            flops += 2.0 * output.numel() * module.in_channels // module.groups * math.prod(module.kernel_size)

    part = x[:8]
    scale = len(x) / max(len(part), 1)
    flags = [(m, m.training) for m in model.modules()]
    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    pools = _SeesMaxPools()
    try:
        model.eval()  # (activation shapes as in training; no dropout drawn, no running statistics moved)
        with torch.no_grad(), pools:
            functional_call(model, buffers, (part,), strict=False)
    finally:
        for h in handles:
            h.remove()
        for m, flag in flags:
            m.training = flag
    return param_bytes * (2 + states) + buffer_bytes + int(2 * activations * scale), 3.0 * flops * scale, pools.seen


# -- cheap structure keys: trace only models that can be grouped -----------------------------------
_MODULE_STATE = {"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                 "_is_full_backward_hook"}
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device, torch.Size)


def _shape_key(model: nn.Module) -> tuple[Any, ...]:
    """Module tree (names and classes; an activation site's class left out) and parameter/buffer
    names, shapes and dtypes: a necessary condition for two models to stack (no trace; microseconds)."""
    tree = tuple((n, "activation") if is_site(m) else (n, type(m).__module__, type(m).__qualname__)
                 for n, m in model.named_modules())
    tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in model.named_parameters())
    return tree, tensors, tuple((n, tuple(t.shape), t.dtype) for n, t in model.named_buffers())


def _plain(value: Any) -> Any:
    """A hashable stand-in for an attribute value, or raise TypeError for values it cannot judge."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_plain(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((repr(k), _plain(v)) for k, v in value.items()))))
    if isinstance(value, torch.Tensor) and value.numel() <= 4096 and value.device.type == "cpu":
        return ("tensor", tuple(value.shape), value.dtype, value.detach().numpy().tobytes()
                if value.dtype != torch.bfloat16 else value.detach().float().numpy().tobytes())
    raise TypeError(type(value).__name__)


def _attribute_key(model: nn.Module) -> tuple[Any, ...] | None:
    """Every module's class and plain attributes (what ``td.choice`` resolves to in constructors;
    a dropout's ``p`` left out, as the structure key normalizes it), with parameter and buffer
    shapes. Models with equal keys run the same forward, so their graph fingerprint is traced once.
    None where an attribute is of a type it cannot compare, or a hook is registered: traced alone."""
    parts: list[Any] = [_shape_key(model)]
    try:
        for name, m in model.named_modules():
            if is_site(m):  # the activation is the model's variant, not its structure
                continue
            attrs = []
            for key, value in m.__dict__.items():
                if key in _MODULE_STATE or (key == "p" and type(m) in _DROPOUTS):
                    continue
                if is_hook_attribute(key):
                    if value:
                        return None
                    continue
                attrs.append((key, _plain(value)))
            parts.append((name, tuple(attrs)))
    except TypeError:
        return None
    return tuple(parts)


def _structure_keys(jobs: Sequence[Job], decisions: Decisions) -> list[str | BaseException | None]:
    """The structure key (:func:`_structure_key`, a graph trace) of each job whose model shares its
    module tree and tensor shapes with another job's; models with equal attribute keys and module
    classes share one trace, in this call and later ones of the run (``decisions.traced``). None for a job with no
    partner to stack with (in ``jobs``' order)."""
    by_shape: dict[tuple[Any, ...], list[int]] = {}
    for index, job in enumerate(jobs):
        by_shape.setdefault(_shape_key(job.concrete_model), []).append(index)
    keys: list[str | BaseException | None] = [None] * len(jobs)
    for group in by_shape.values():
        if len(group) < 2:
            continue
        for index in group:
            job = jobs[index]
            model = job.concrete_model
            attrs = _attribute_key(model)
            # the classes themselves (not their names): a class defined again, e.g. in a notebook, is traced again
            cached = None if attrs is None else (attrs, tuple(type(m) for m in model.modules()))
            if cached is not None and cached in decisions.traced:
                keys[index] = decisions.traced[cached]
                continue
            try:
                key: str | BaseException = _structure_key(model)
            except Exception as err:
                key = err
            keys[index] = key
            if cached is not None:
                decisions.remember_traced(cached, key)
    return keys


def _differing(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    for (name, _), x, y in zip(_SETUP_FIELDS, a, b):
        if x != y:
            return name
    return "setup"


def plan_batching(jobs: Sequence[Job], evaluator: StepwiseEvaluator, *, settings: Settings | None = None,
                  max_unit_memory: int | str | None = None, context: PlanContext | None = None
                  ) -> tuple[list[ExecutionUnit], list[Job]]:
    """Group ``jobs`` by (structure, training setup) and fuse each group of two or more, within
    ``max_unit_memory`` (bytes or e.g. ``"2GiB"``; default: the run's bound,
    :meth:`tridens.units.PlanContext.memory_bound`): as a :class:`BatchedUnit` where
    ``settings.batching.mode == "force"``; as an :class:`~tridens.xopt._adaptive.AdaptiveUnit` that
    starts fused where earlier groups with the same key measured that fusion pays, and one that
    decides from its own first real steps where nothing (or too little, near the bar) was measured;
    not at all where groups with the same key measured that it does not pay. Returns the units
    and the jobs left for other optimizations /
    separate training. Logs one line per group that is not fused, saying why (fused units log
    their own line through the planner). ``settings`` (None: the context's, else
    :meth:`Settings.from_env`) holds the knobs (see the module docstring); ``context`` is the
    run's :class:`~tridens.units.PlanContext`, whose decisions earlier groups measured (None: a
    fresh one, nothing known)."""
    context = context if context is not None else PlanContext()
    full = settings if settings is not None else context.settings if context.settings is not None else \
        Settings.from_env()
    knobs = full.batching
    if knobs.mode == "off" or not isinstance(evaluator, SupervisedEvaluator):
        return [], list(jobs)
    if len(jobs) < 2:  # nothing to fuse with: skip tracing
        for job in jobs:
            log.info("batching: trial %d not fused: no other trial in its group", job.trial.id)
        return [], list(jobs)
    leftover: list[Job] = []
    candidates: list[tuple[Job, TrainConfig]] = []
    for job in jobs:
        if not isinstance(job.model, nn.Module):
            leftover.append(job)
            continue
        try:
            cfg = job.config(evaluator)
            if cfg.optimizer not in ("sgd", "adam", "adamw", "rmsprop"):
                raise ValueError(f"no vectorized optimizer {cfg.optimizer!r}")
            if cfg.precision == "16-mixed":
                raise ValueError("precision '16-mixed' steps through a gradient scaler, which the fused step has not")
        except Exception as err:  # the separate trainer reports invalid setups as the trial's error
            log.info("batching: trial %d not fused: %s", job.trial.id, _first_line(err))
            leftover.append(job)
            continue
        candidates.append((job, cfg))
    keys = _structure_keys([job for job, _ in candidates], context.decisions)
    structures: dict[str, list[tuple[tuple[Any, ...], Job, TrainConfig]]] = {}
    for (job, cfg), key in zip(candidates, keys):
        if key is None:
            log.info("batching: trial %d not fused: no other trial with the same model structure", job.trial.id)
            leftover.append(job)
            continue
        if isinstance(key, BaseException):
            log.info("batching: trial %d not fused: %s", job.trial.id, _first_line(key))
            leftover.append(job)
            continue
        structures.setdefault(key, []).append((_setup_key(cfg, job.trial.seed), job, cfg))
    units: list[ExecutionUnit] = []
    for skey, members in structures.items():
        setups: dict[tuple[Any, ...], list[Job]] = {}
        for setup, job, _ in members:
            setups.setdefault(setup, []).append(job)
        for setup, group in setups.items():
            ids = [j.trial.id for j in group]
            if len(group) == 1:
                why = ("no other trial with the same model structure" if len(setups) == 1 else
                       f"different {_differing(setup, next(s for s in setups if s != setup))} from trials with the "
                       "same model structure")
                log.info("batching: trial %d not fused: %s", ids[0], why)
                leftover.extend(group)
                continue
            budget = context.memory_bound(group[0].config(evaluator).device, max_unit_memory)
            group = [group[i] for i in order_by_variant([job.concrete_model for job in group])]
            made, rest = _plan_group(skey, setup, group, evaluator, budget, knobs, full.cse, context.decisions)
            units.extend(made)
            leftover.extend(rest)
    order = {id(job): i for i, job in enumerate(jobs)}
    leftover.sort(key=lambda j: order[id(j)])
    return units, leftover


def _chunks(group: list[Job], size: int) -> list[list[Job]]:
    chunks = [group[i:i + size] for i in range(0, len(group), size)]
    if len(chunks) > 1 and len(chunks[-1]) == 1:  # never leave one model alone: rebalance
        chunks = [group[i::len(chunks)] for i in range(len(chunks))]
    return chunks


def _plan_group(skey: str, setup: tuple[Any, ...], group: list[Job], evaluator: SupervisedEvaluator,
                budget: int, settings: BatchingSettings, cse: CSESettings | None = None,
                decisions: Decisions | None = None) -> tuple[list[ExecutionUnit], list[Job]]:
    decisions = decisions if decisions is not None else Decisions()
    ids = [j.trial.id for j in group]
    cfg = group[0].config(evaluator)
    try:
        x, y = _first_batch(cfg, group[0].trial.seed)
    except Exception as err:
        log.info("batching: trials %s not fused: %s", ids, _first_line(err))
        return [], list(group)
    if settings.mode == "force":
        return _plan_forced(group, evaluator, budget, x, y, settings)
    try:
        per_model, flops, pools = _model_costs(group[0].concrete_model, x, cfg)
    except Exception:  # a forward the meta device cannot run: measure on a throwaway fused step
        try:
            per_model, flops, pools = _per_model_bytes(_probe(group[:2], evaluator, x, y, settings), x), 0.0, True
        except Exception as err:
            log.info("batching: trials %s not fused: the models do not vectorize (%s)", ids, _first_line(err))
            return [], list(group)
    size = _unit_size(ids, per_model, budget, settings.max_unit_size)
    if size < 2:
        return [], list(group)
    from ._adaptive import AdaptiveUnit, decision_key

    size, why = measured_unit_size(min(size, len(group)), lambda k: decisions.speedups.get(
        decision_key(skey, setup, k, cfg.device), []), settings)
    if why:
        log.info("batching: trials %s in units of at most %d: %s", ids, size, why)

    steps = cse if cse is not None else CSESettings()  # how the group's trials step if not fused
    if not pools:  # nothing for the exact max-pool kernel: no model check for it
        steps = dataclasses.replace(steps, fast_pools=False)

    units: list[ExecutionUnit] = []
    rest: list[Job] = []
    cache = DecisionCache(settings.decision_cache) if settings.decision_cache else None
    for chunk in _chunks(group, size):
        k, chunk_ids = len(chunk), [j.trial.id for j in chunk]
        key = decision_key(skey, setup, k, cfg.device)
        measured, where = decisions.speedups.get(key, []), "an earlier unit's first steps"
        stored = stored_key(skey, cfg.optimizer, (cfg.batch_size, cfg.batch_schedule), cfg.loss, cfg.task, x, k,
                            cfg.device, torch.get_num_threads(),
                            (settings.packed, settings.channels_last, settings.exact, steps.joint, steps.fast_pools)) \
            if cache is not None else None
        if not measured and cache is not None and stored is not None:
            measured, where = cache.get(stored), f"an earlier run on this machine ({cache.path})"
            if measured:
                decisions.speedups[key] = list(measured)
                separate = cache.get(stored + SEPARATE_STEP)
                if separate:  # what the stack compares its steps with if trials leave it
                    decisions.separate_steps.setdefault(decision_key(skey, setup, 1, cfg.device),
                                                        statistics.median(separate))
        speedup = settled_speedup(measured, settings)
        if len(measured) > 1:
            where = f"{where}, the median of {len(measured)}"
        if speedup is not None and speedup < settings.min_speedup:
            log.info("batching: trials %s not fused: measured %.2fx on %s (below %.2fx)",
                     chunk_ids, speedup, where, settings.min_speedup)
            rest.extend(chunk)
            continue
        try:
            if speedup is not None:  # fused from the start; re-measured if trials leave (see AdaptiveMember)
                unit: BatchedUnit = AdaptiveUnit(chunk, evaluator, reason=f"{k} trials, fused: measured {speedup:.2f}x "
                                                 f"on {where}", skey=skey, setup=setup, flops=flops, settings=settings,
                                                 cse=steps, stored_key=stored, known=(speedup, where),
                                                 decisions=decisions, max_unit_memory=budget)
            else:
                unit = AdaptiveUnit(chunk, evaluator, reason=f"{k} trials, fused or not as measured on their first "
                                    "real steps", skey=skey, setup=setup, flops=flops, settings=settings, cse=steps,
                                    stored_key=stored, decisions=decisions, max_unit_memory=budget)
        except Exception as err:
            log.info("batching: trials %s not fused: the models do not vectorize (%s)", chunk_ids, _first_line(err))
            rest.extend(chunk)
            continue
        unit.memory = per_model * k
        units.append(unit)
    return units, rest


def measured_unit_size(size: int, measured: Callable[[int], Sequence[float]],
                       settings: BatchingSettings) -> tuple[int, str]:
    """The models per unit for a group that memory allows ``size`` of, from the speed-ups
    ``measured(k)`` of this structure and setup fused ``k`` at a time, for ``k`` = size, size/2,
    size/4, ... >= 2 (a larger stack is not always faster per model: memory bandwidth caps
    float32 convolutions of many models). The ``k`` whose settled speed-up is best; where even the
    best is below the bar, the next smaller ``k`` of at least 4 nobody measured yet (measured by
    its first group; pairs are not tried); ``size`` where nothing is settled. Returns it with the reason ('' for ``size``).

    >>> measured = {8: [0.6], 4: [], 2: []}
    >>> measured_unit_size(8, lambda k: measured[k], BatchingSettings())
    (4, 'fused 8 at a time measured 0.60x, below 1.10x: trying 4')
    >>> measured.update({4: [1.6]})
    >>> measured_unit_size(8, lambda k: measured[k], BatchingSettings())
    (4, 'fused 4 at a time measured 1.60x, the best per model (8: 0.60x)')
    """
    sizes = []
    k = size
    while k >= 2:
        sizes.append(k)
        k //= 2
    settled = {k: settled_speedup(measured(k), settings) for k in sizes}
    known = {k: v for k, v in settled.items() if v is not None}
    if not known:
        return size, ""
    best = max(known, key=lambda k: (known[k], k))
    if known[best] < settings.min_speedup:
        untried = [k for k in sizes if 4 <= k < min(known) and not measured(k)]
        if untried:
            smallest = min(known)
            return untried[0], (f"fused {smallest} at a time measured {known[smallest]:.2f}x, below "
                                f"{settings.min_speedup:.2f}x: trying {untried[0]}")
        return size, ""
    if best == size:
        return size, ""
    others = ", ".join(f"{k}: {v:.2f}x" for k, v in known.items() if k != best)
    return best, f"fused {best} at a time measured {known[best]:.2f}x, the best per model ({others})"


def _unit_size(ids: list[int], per_model: int, budget: int, max_unit_size: int) -> int:
    """The most models per unit under ``budget`` bytes (logged when not even two fit)."""
    size = min(max_unit_size, max(1, budget // max(per_model, 1)))
    if size < 2:
        log.info("batching: trials %s not fused: one model needs ~%.0f MiB, max_unit_memory is %.0f MiB",
                 ids, per_model / 2**20, budget / 2**20)
    return size


def _plan_forced(group: list[Job], evaluator: SupervisedEvaluator, budget: int, x: torch.Tensor,
                 y: torch.Tensor, settings: BatchingSettings) -> tuple[list[ExecutionUnit], list[Job]]:
    """``mode == "force"``: fuse every compatible group (a throwaway step proves the
    models vectorize first)."""
    ids = [j.trial.id for j in group]
    try:
        probe = _probe(group[:2], evaluator, x, y, settings)
        per_model = _per_model_bytes(probe, x)
        shared = probe.shared_input
        checked = probe._program is not None and probe._program_checked  # the structure's grouped program
    except Exception as err:
        log.info("batching: trials %s not fused: the models do not vectorize (%s)", ids, _first_line(err))
        return [], list(group)
    size = _unit_size(ids, per_model, budget, settings.max_unit_size)
    if size < 2:
        return [], list(group)
    units: list[ExecutionUnit] = []
    for chunk in _chunks(group, size):
        unit = BatchedUnit(chunk, evaluator, reason=f"{len(chunk)} trials, fused: forced (batching mode 'force')",
                           shared_input=shared, settings=settings)
        unit.memory = per_model * len(chunk)
        unit.member._program_checked = unit.member._program_checked or checked
        units.append(unit)
    return units, []
