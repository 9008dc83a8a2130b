"""Operator batching: K same-shaped models trained as ONE vectorized model.

Trials whose models have the same structure (module tree, parameter and buffer shapes, forward
graph; Dropout ``p`` may differ) and whose training setups agree on everything but the learning
rate, momentum, weight decay and lr schedule (same optimizer kind, batch size, epochs, loss, data,
transforms and data order) are stacked with ``torch.func``: parameters and buffers become tensors
with a leading model dimension, the forward is ``vmap(functional_call(...))`` over it, and the
shared input batch is *not* batched (``in_dims=None``), so the first layer runs as one wide
convolution / matmul with K times the output channels. Per-model hyperparameters are tensors
broadcast over the model dimension, and the optimizer step (SGD, Adam, AdamW, RMSprop, with
``torch.optim``'s semantics) is vectorized.

Two engines run the stacked forward (``BatchedMember.engine`` says which; the unit's log line too):

* **grouped kernels** (default where it applies, :class:`_PackedProgram`): for models whose fx
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

What differs is floating-point rounding only (grouped/batched kernels instead of per-model
kernels, the optimizer's products rounded separately instead of fused): the tests hold fused and
separate per-epoch metrics within 1e-4.

A model whose loss becomes NaN/inf fails alone (:class:`NonFiniteLoss`, same message as the
separate trainer) and leaves the stack before the optimizer step; a model the strategy stops
leaves through :meth:`BatchedUnit.drop`; the others' arithmetic is independent of both.

**When it pays.** On a CPU, vmapped convolutions become grouped convolutions, which can be slower
than K ordinary ones (4 Fashion-MNIST CNNs: 6.4 s separate, 11.0 s vmapped), while small models
gain a lot. So a group whose fusion has not been measured yet becomes an
:class:`~tridens.xopt._adaptive.AdaptiveUnit`, which decides from its OWN first real training steps
(no throwaway steps; see :mod:`tridens.xopt._adaptive`): one model's first separate steps (a
roofline check against the peak matmul rate first), then fused steps interleaved with them, and
keeps training whichever way pays, with results exactly those of fused or separate training from
the start. The speed-up is cached per (structure, setup, K, device type, threads): later groups
with the same key are planned fused (a :class:`BatchedUnit`) or left to the next optimization and
separate training directly. Grouping traces a model's graph only where another model shares its
module tree and tensor shapes, and once per set of models whose modules agree in class and plain
attributes (:func:`_attribute_key`). Knobs (module-level :data:`settings`, also read from the
environment at import):

* ``settings.mode`` (``TRIDENS_BATCHING``): ``"auto"`` (decide from real steps, default),
  ``"force"`` (fuse every compatible group whatever the measurement: used by tests to compare fused
  with separate), ``"off"``.
* memory: a unit's estimated parameters + gradients + optimizer state + activations stay under
  the experiment's ``max_unit_memory`` (one bound for every optimization, resolved by
  :func:`tridens.units.resolve_max_unit_memory`: ``td.Experiment(max_unit_memory=)``,
  ``$TRIDENS_MAX_UNIT_MEMORY``, else half the RAM / 80% of free GPU memory; or
  ``plan_batching(..., max_unit_memory=)``); larger groups are split. The estimate comes from one
  evaluation-mode forward of one model on 8 examples (:func:`_model_costs`).
* ``settings.max_unit_size`` (default 64): the most models in one unit.
* ``settings.min_speedup`` (default 1.1): the measured speed-up a group must reach to stay fused
  (measured on real, different batches in CPU time, not on one cache-hot batch as before: the
  former 1.25 margin against that bias is no longer needed).
* ``settings.measure_rounds`` (default 3): timed fused steps (after one warm-up) before deciding;
  up to twice as many while the ratio is within -20%/+25% of ``min_speedup``.
* ``settings.max_separate_efficiency`` (default 0.2): on a CPU, one model's separate step rate
  (training FLOPs of its Linear/Conv layers per CPU second, on its first real steps) against the
  peak fp32 matmul rate (:func:`peak_matmul_flops`, once per process). A model that already runs
  at this fraction of the peak has little per-operation overhead left for fusion to remove
  (grouped kernels then lose: 0.52-0.66x measured here), so the group trains separately without
  trying a fused step.
* ``settings.override_speedup`` (default None): replaces the measured speed-up in the decision
  (tests drive both paths with it on real training).
* ``settings.packed`` (default True): use the grouped-kernel engine where it applies.
* ``settings.keep_freed_memory`` (default True, Linux/glibc): a fused step allocates and frees
  activations of several MiB each; glibc returns such blocks to the system and takes them back at
  the next step, page fault by page fault (thousands per step measured here, up to a quarter of
  a step's CPU time). The first batched member sets ``mallopt`` so blocks up to 64 MiB come from
  the heap and up to 512 MiB of freed heap is kept for reuse (process-wide; numerics unchanged).
* ``settings.channels_last`` (default False): run the grouped engine's 2-d feature maps
  channels-last (convolution weights too, so outputs stay channels-last without copies). Pooling
  and BatchNorm over K*C channels are 3-5x faster so on 8x8 maps and whole fused steps of 16
  digits CNNs ~15% faster, but the native channels-last BatchNorm adds rows one after another in
  float (mean/var ~6e-6 relative off the NCHW kernel's double accumulation, against ~5e-8) and
  training amplifies it (val_loss 1.8e-3 apart after two epochs in one test; float64: equal), so
  it stays off -- fused must equal separate. (A BatchNorm by cascaded column sums on the
  ``(N*H*W, K*C)`` view was as close to separate training as NCHW, 3e-7, but took more passes
  over memory than it saved: whole steps 15-20% slower; not kept.)

2x2 max-pools on per-model maps run as :class:`_MaxPool2x2` (two passes, bit-identical values and
gradients, ~3x faster forward than the NCHW kernel on 8x8 maps), taking over a ReLU right before
them (exact: max commutes with ReLU); without gradients (validation) only the maxima are computed.
Training BatchNorm of packed maps of >= 256 Ki values runs as :class:`~tridens.xopt._kernels.
BatchNormTrain` (vectorized plane sums with float64 over the batch, as accurate as the native
kernel; its forward ~2.5x faster on ``(64, 256, 8, 8)``, whole fused steps of 16 digits CNNs
~6-8% faster), with a ReLU right after it folded in.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, vmap

from ..units import ExecutionUnit, Job, SeparateUnit, UnitResult, resolve_max_unit_memory
from ..evaluators._base import StepwiseEvaluator
from ..evaluators._errors import NonFiniteLoss
from ..evaluators._supervised import TrainConfig, BatchSource, SupervisedEvaluator, correct_count, align_output
from ._kernels import BatchNormTrain, batch_norm_pays, batch_norm_supported

__all__ = ["BatchedUnit", "BatchingSettings", "plan_batching", "settings", "group_key", "clear_cache"]

log = logging.getLogger("tridens")


@dataclass
class BatchingSettings:
    """Module-level knobs of operator batching (see the module docstring)."""

    mode: str = os.environ.get("TRIDENS_BATCHING", "auto")
    max_unit_size: int = 64
    packed: bool = True
    channels_last: bool = False
    min_speedup: float = 1.1
    measure_rounds: int = 3
    max_separate_efficiency: float = 0.2
    override_speedup: float | None = None
    keep_freed_memory: bool = True


settings = BatchingSettings()

# (group key, K, device type) -> measured speed-up of fused over separate training.
_SPEEDUPS: dict[tuple[Any, ...], float] = {}


def clear_cache() -> None:
    """Forget the measured speed-ups and separate-step rates (kept for the process's lifetime)."""
    _SPEEDUPS.clear()
    _EFFICIENCY.clear()


_MALLOC_TUNED = False


def _keep_freed_memory() -> None:
    """Keep freed blocks in glibc's heap for reuse (see ``settings.keep_freed_memory``); once."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED or not settings.keep_freed_memory or not sys.platform.startswith("linux"):
        return
    _MALLOC_TUNED = True
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h> constants
    mallopt(m_mmap_threshold, 64 << 20)
    mallopt(m_trim_threshold, 512 << 20)


# -- dropout with masks drawn outside vmap ---------------------------------------------------------
_DROPOUTS: dict[type, int | None] = {nn.Dropout: None, nn.Dropout1d: 3, nn.Dropout2d: 4, nn.Dropout3d: 5}
_local = threading.local()


class _MaskDropout(nn.Module):
    """Stands in for a dropout module in the fused forward: multiplies by the next mask of the
    current step (drawn per model outside vmap), or records the shape it would need."""

    def __init__(self, index: int, batched_dim: int | None):
        super().__init__()
        self.index, self.batched_dim = index, batched_dim

    def mask_shape(self, shape: torch.Size) -> tuple[int, ...]:
        if self.batched_dim is None:  # element-wise dropout: one value per element
            return tuple(shape)
        if len(shape) == self.batched_dim:  # feature dropout: one value per (sample, channel)
            return (shape[0], shape[1]) + (1,) * (len(shape) - 2)
        return (shape[0],) + (1,) * (len(shape) - 1)  # no batch dim: F.dropoutNd unsqueezes one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        state = _local.state
        if state.record is not None:
            state.record.append((self.index, self.mask_shape(x.shape), x.dtype))
            return x
        mask = state.masks[state.position]
        state.position += 1
        return x if mask is None else x * mask


@dataclass
class _ForwardState:
    record: list[tuple[int, tuple[int, ...], torch.dtype]] | None = None
    masks: Sequence[torch.Tensor | None] = ()
    position: int = 0


@contextlib.contextmanager
def _forward_state(state: _ForwardState) -> Iterator[None]:
    previous = getattr(_local, "state", None)
    _local.state = state
    try:
        yield
    finally:
        _local.state = previous


def _dropout_ps(model: nn.Module) -> list[float]:
    """Every dropout's ``p``, in ``named_modules`` order (the index :func:`_skeleton` gives it)."""
    return [float(m.p) for _, m in model.named_modules() if type(m) in _DROPOUTS]


def _dropout_names(model: nn.Module) -> dict[str, int]:
    return {n: i for i, n in enumerate(n for n, m in model.named_modules() if type(m) in _DROPOUTS)}


def _skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device with its dropouts replaced by :class:`_MaskDropout`
    (numbered in ``named_modules`` order, as :func:`_dropout_ps`): the module ``functional_call``
    runs with the stacked parameters."""
    base = copy.deepcopy(model).to("meta")
    index = {id(m): i for i, m in enumerate(m for _, m in base.named_modules() if type(m) in _DROPOUTS)}
    replaced: dict[int, _MaskDropout] = {}
    for _, module in list(base.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) in _DROPOUTS:
                if id(child) not in replaced:
                    replaced[id(child)] = _MaskDropout(index[id(child)], _DROPOUTS[type(child)])
                setattr(module, child_name, replaced[id(child)])
    return base


# -- grouping ----------------------------------------------------------------------------------------
def _structure_key(model: nn.Module) -> str:
    """The graph fingerprint of ``model`` with every dropout's ``p`` normalized (p may differ
    within a unit), plus its parameter and buffer names and shapes (what stacking needs)."""
    from ..graph import trace

    dropouts = [m for m in model.modules() if type(m) in _DROPOUTS]
    saved = [m.p for m in dropouts]
    try:
        for m in dropouts:
            m.p = 0.5
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fingerprint = trace(model).fingerprint()
    finally:
        for m, p in zip(dropouts, saved):
            m.p = p
    tensors = [(n, tuple(t.shape), str(t.dtype), t.requires_grad) for n, t in model.named_parameters()]
    tensors += [(n, tuple(t.shape), str(t.dtype)) for n, t in model.named_buffers()]
    return f"{fingerprint}|{hash(tuple(tensors))}"


def _data_key(ds: Any) -> Any:
    return getattr(ds, "spec", None) or id(ds)


# The parts of a TrainConfig that must agree within a unit, with the reason given when they don't.
_SETUP_FIELDS: tuple[tuple[str, Callable[[TrainConfig, int], Any]], ...] = (
    ("optimizer", lambda c, s: c.optimizer),
    ("batch size", lambda c, s: c.batch_size),
    ("epochs", lambda c, s: c.epochs),
    ("loss", lambda c, s: id(c.loss)),
    ("metrics", lambda c, s: c.metrics),
    ("training data", lambda c, s: _data_key(c.train)),
    ("validation data", lambda c, s: _data_key(c.val)),
    ("transforms", lambda c, s: id(c.transforms)),
    ("data order", lambda c, s: c.data_seed_of(s)),
    ("device", lambda c, s: str(c.device)),
    ("task", lambda c, s: c.task),
)


def _setup_key(cfg: TrainConfig, seed: int) -> tuple[Any, ...]:
    return tuple(get(cfg, seed) for _, get in _SETUP_FIELDS)


def group_key(model: nn.Module, cfg: TrainConfig, seed: int) -> tuple[str, tuple[Any, ...]]:
    """``(structure key, setup key)``: trials with equal keys can train as one batched unit."""
    return _structure_key(model), _setup_key(cfg, seed)


# -- the vectorized optimizers ----------------------------------------------------------------------
def _per_model(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-model scalars as a tensor broadcast over a stacked tensor shaped like ``like``."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).view(-1, *([1] * (like.dim() - 1)))


class _VectorOptimizer:
    """SGD / Adam / AdamW / RMSprop over stacked parameters, per-model lr, momentum (Adam's beta1)
    and weight decay, with ``torch.optim``'s single-tensor (CPU) update rules: SGD with dampening 0,
    no Nesterov; Adam/AdamW betas (momentum, 0.999), eps 1e-8; RMSprop alpha 0.99, eps 1e-8, not
    centered. A parameter without a gradient is skipped, as torch.optim does."""

    BETA2, EPS, ALPHA = 0.999, 1e-8, 0.99

    def __init__(self, kind: str, momentum: list[float], weight_decay: list[float]):
        self.kind = kind
        self.momentum, self.weight_decay = list(momentum), list(weight_decay)
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.steps: dict[str, int] = {}
        # per-model hyperparameters as broadcastable tensors, rebuilt only when their values change
        # (a schedule's lrs, models leaving): building them took a third of a fused MLP step's update
        self._rows: dict[tuple[Any, ...], tuple[tuple[float, ...], torch.Tensor]] = {}

    def select(self, rows: list[int]) -> None:
        """Keep only the models at ``rows`` (in that order)."""
        self.momentum = [self.momentum[r] for r in rows]
        self.weight_decay = [self.weight_decay[r] for r in rows]
        self._rows.clear()
        for name, state in self.state.items():
            for key, value in state.items():
                index = torch.tensor(rows, dtype=torch.long, device=value.device)
                state[key] = value.index_select(0, index)

    def _row(self, what: str, values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
        """``_per_model(values, like)``, cached per quantity and tensor rank while ``values`` stay."""
        key, values = (what, like.dim(), like.dtype, like.device), tuple(values)
        hit = self._rows.get(key)
        if hit is None or hit[0] != values:
            hit = self._rows[key] = (values, _per_model(values, like))
        return hit[1]

    @torch.no_grad()
    def step(self, params: Mapping[str, torch.Tensor], lrs: list[float]) -> None:
        wd_any = any(w != 0 for w in self.weight_decay)
        for name, p in params.items():
            g = p.grad
            if g is None:
                continue
            state = self.state.setdefault(name, {})
            count = self.steps[name] = self.steps.get(name, 0) + 1
            lr = self._row("lr", lrs, p)
            if self.kind == "adamw":
                if wd_any:
                    p.mul_(self._row("decay", [1 - a * w for a, w in zip(lrs, self.weight_decay)], p))
            elif wd_any:
                g = torch.addcmul(g, self._row("wd", self.weight_decay, p), p)  # g + wd * p
            if self.kind == "sgd":
                if any(m != 0 for m in self.momentum):
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = g.clone()
                    else:  # buf * momentum + g
                        torch.addcmul(g, buf, self._row("momentum", self.momentum, p), out=buf)
                    g = buf
                p.addcmul_(lr, g, value=-1)  # p - lr * g
            elif self.kind in ("adam", "adamw"):
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(g, self._row("1-beta1", [1 - m for m in self.momentum], p))
                exp_avg_sq.mul_(self.BETA2).addcmul_(g, g, value=1 - self.BETA2)
                bias_correction2 = 1 - self.BETA2 ** count
                step_size = [a / (1 - m ** count) for a, m in zip(lrs, self.momentum)]
                denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(self.EPS)
                p.add_((self._row("-step size", [-s for s in step_size], p) * exp_avg).div_(denom))
            elif self.kind == "rmsprop":
                if not state:
                    state["square_avg"] = torch.zeros_like(p)
                square_avg = state["square_avg"]
                square_avg.mul_(self.ALPHA).addcmul_(g, g, value=1 - self.ALPHA)
                avg = square_avg.sqrt().add_(self.EPS)
                if any(m > 0 for m in self.momentum):
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(self._row("momentum", self.momentum, p)).addcdiv_(g, avg)
                    p.sub_(lr * buf)
                else:
                    p.add_((-lr * g).div_(avg))
            else:  # pragma: no cover - planner checks the kind
                raise ValueError(f"no vectorized optimizer {self.kind!r}")


def _resolved_momentum(cfg: TrainConfig) -> float:
    if cfg.momentum is not None:
        return cfg.momentum
    return 0.0 if cfg.optimizer == "rmsprop" else 0.9


# -- packed layout: grouped kernels without vmap ---------------------------------------------------------
class _Unsupported(Exception):
    """The model has an op the packed program does not cover (the unit uses vmap instead)."""


_ELEMENTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid,
                        nn.Hardswish, nn.Hardtanh, nn.Mish, nn.Softplus, nn.Identity)
_POOL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d,
                 nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_ELEMENTWISE_FUNCTIONS = {torch.relu, F.relu, torch.tanh, torch.sigmoid, F.gelu, F.silu, F.leaky_relu, F.elu,
                          F.relu6, F.hardswish}
_POOL_FUNCTIONS = {F.max_pool1d, F.max_pool2d, F.avg_pool1d, F.avg_pool2d, F.adaptive_avg_pool1d,
                   F.adaptive_avg_pool2d}
_ELEMENTWISE_METHODS = {"relu", "tanh", "sigmoid", "to", "float", "double", "contiguous"}

# Layouts of a value in the packed program (K models, batch B):
#   "S": shared by every model, (B, ...) -- the input, and what is computed from it alone;
#   "C": channel-packed, (B, K*C, ...) -- model k's channels at [k*C, (k+1)*C): convolutions run as ONE
#        convolution (the first with K*O outputs, later ones grouped), BatchNorm/pooling/activations as is;
#   "M": model-major, (K, B, F) -- features after flatten; Linear runs as one batched matmul.


class _MaxPool2x2(torch.autograd.Function):
    """``max_pool2d(x, 2)`` on an NCHW map with even height and width, optionally followed by
    ReLU, in two passes (column pairs, then row pairs) with the same values and gradients as
    ``F.max_pool2d(F.relu(x), 2)`` bit for bit.

    Written by hand because the NCHW max-pool kernel is per-element bound on 8x8 maps (~5 ns per
    input element here, the largest single op of a fused step of 16 digits CNNs): this is ~3x
    faster forward. Ties: max_pool2d's gradient goes to the first maximum of a window in row-major
    order; taking the first of equal values across columns, then across rows, picks that same
    element. ReLU after the pool instead of before is exact: ``max`` commutes with it, and where
    the maximum is <= 0 both give a zero gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, relu: bool) -> torch.Tensor:
        b, c, h, w = x.shape
        pairs = x.view(b, c, h, w // 2, 2)
        left, right = pairs[..., 0], pairs[..., 1]
        right_wins = torch.gt(right, left).to(x.dtype)  # float masks: products are cheaper than bool ops
        rows = torch.maximum(left, right).view(b, c, h // 2, 2, w // 2)
        top, bottom = rows[:, :, :, 0], rows[:, :, :, 1]
        bottom_wins = torch.gt(bottom, top).to(x.dtype)
        out = torch.maximum(top, bottom)
        if relu:
            out.clamp_min_(0)
        ctx.save_for_backward(right_wins, bottom_wins, out if relu else None)
        ctx.relu = relu
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        right_wins, bottom_wins, out = ctx.saved_tensors
        if ctx.relu:
            grad = torch.ops.aten.threshold_backward(grad, out, 0)
        b, c, h, half = right_wins.shape
        rows = grad.new_empty(b, c, h // 2, 2, half)
        torch.mul(grad, bottom_wins, out=rows[:, :, :, 1])
        torch.sub(grad, rows[:, :, :, 1], out=rows[:, :, :, 0])  # g - g*1 = 0, g - 0 = g: exact
        rows = rows.view(b, c, h, half)
        pairs = grad.new_empty(b, c, h, half, 2)
        torch.mul(rows, right_wins, out=pairs[..., 1])
        torch.sub(rows, pairs[..., 1], out=pairs[..., 0])
        return pairs.view(b, c, h, 2 * half), None


def _is_pool2x2(kind: str, node: Any, info: Mapping[str, Any]) -> bool:
    """A 2x2, stride-2 max-pool without padding, dilation, ceil mode or indices."""
    if kind == "apply":
        m = info["module"]
        if type(m) is not nn.MaxPool2d:
            return False
        k, s, p, d, ceil, idx = m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode, m.return_indices
    elif kind == "call" and info["fn"] is F.max_pool2d:
        names = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
        given = dict(zip(names, node.args[1:]), **node.kwargs)
        if set(given) - set(names):
            return False
        k, s, p, d = (given.get(n) for n in names[:4])
        ceil, idx = given.get("ceil_mode", False), given.get("return_indices", False)
        s = k if s is None or s == [] else s
        p = 0 if p is None else p
        d = 1 if d is None else d
    else:
        return False
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
    return pair(k) == (2, 2) and pair(s) == (2, 2) and pair(p) == (0, 0) and pair(d) == (1, 1) and \
        not ceil and not idx


def _is_relu(kind: str, node: Any, info: Mapping[str, Any]) -> bool:
    if kind == "apply":
        return type(info["module"]) is nn.ReLU
    if kind == "call":
        return info["fn"] in (torch.relu, F.relu) and len(node.args) == 1
    return kind == "method" and node.target == "relu" and len(node.args) == 1 and not node.kwargs


class _PackedProgram:
    """The model's forward over the K stacked models without vmap, for chains (and adds) of common
    layers: Conv1d/2d, Linear, BatchNorm1d/2d, pooling, activations, Flatten, dropout (masks drawn
    per model in call order, as separate training draws them). Built from the model's fx graph;
    anything else raises :class:`_Unsupported` and the unit uses vmap."""

    def __init__(self, model: nn.Module):
        import operator

        import torch.fx as fx

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graph = fx.symbolic_trace(model).graph
        except Exception as err:
            raise _Unsupported(f"fx: {_first_line(err)}") from err
        modules = dict(model.named_modules())
        self.conv2d = False
        self.steps: list[tuple[str, Any, list[Any], dict[str, Any]]] = []
        layout: dict[fx.Node, str] = {}
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            raise _Unsupported("more than one input")
        for node in graph.nodes:
            inputs = [a for a in node.args if isinstance(a, fx.Node)]
            if any(isinstance(v, fx.Node) for v in node.kwargs.values()) or any(
                    isinstance(a, (list, tuple)) and any(isinstance(b, fx.Node) for b in a) for a in node.args):
                raise _Unsupported(f"node {node.name}: nested inputs")
            ins = [layout[a] for a in inputs]
            if node.op == "placeholder":
                layout[node] = "S"
                self.steps.append(("input", node, [], {}))
                continue
            if node.op == "output":
                if ins != ["M"]:
                    raise _Unsupported("the output is not a (batch, features) tensor per model")
                self.steps.append(("output", node, inputs, {}))
                continue
            if node.op in ("call_function", "call_method") and node.target in (operator.add, torch.add, "add"):
                if len(inputs) != 2 or len(node.args) != 2 or ins[0] != ins[1] or node.kwargs:
                    raise _Unsupported(f"node {node.name}: add of differently laid-out values")
                layout[node] = ins[0]
                self.steps.append(("add", node, inputs, {}))
                continue
            if len(inputs) != 1 or node.args[0] is not inputs[0]:
                raise _Unsupported(f"node {node.name}: not a chain of single-input ops")
            src = ins[0]
            if node.op == "call_module":
                m = modules[str(node.target)]
                kind, out = self._module(m, src, str(node.target))
                layout[node] = out
                self.steps.append((kind, node, inputs, {"module": m, "name": str(node.target), "src": src}))
            elif node.op == "call_function" and node.target in _ELEMENTWISE_FUNCTIONS:
                layout[node] = src
                self.steps.append(("call", node, inputs, {"fn": node.target, "src": src}))
            elif node.op == "call_function" and node.target in _POOL_FUNCTIONS and src in "SC":
                layout[node] = src
                self.steps.append(("call", node, inputs, {"fn": node.target, "src": src}))
            elif node.op == "call_method" and node.target in _ELEMENTWISE_METHODS:
                layout[node] = src
                self.steps.append(("method", node, inputs, {"src": src}))
            elif (node.op, node.target) in (("call_function", torch.flatten), ("call_method", "flatten")) and \
                    tuple(node.args[1:]) in ((1,), (1, -1)) and not node.kwargs:
                layout[node] = "S" if src == "S" else "M"
                self.steps.append(("flatten", node, inputs, {"src": src}))
            else:
                raise _Unsupported(f"node {node.name}: {node.op} {getattr(node.target, '__name__', node.target)}")
        self._fuse_pooling()
        self._fuse_bn_relu()

    def _fuse_pooling(self) -> None:
        """2x2 max-pools on per-model maps run as :class:`_MaxPool2x2`, taking over a ReLU right
        before them when the pool is its only user (ReLU then runs on a quarter of the elements)."""
        for i, (kind, node, inputs, info) in enumerate(self.steps):
            if info.get("src") != "C" or not _is_pool2x2(kind, node, info):
                continue
            relu = False
            if i and self.steps[i - 1][1] is inputs[0] and len(inputs[0].users) == 1:
                before, before_node, before_inputs, before_info = self.steps[i - 1]
                if _is_relu(before, before_node, before_info) and before_info.get("src") == "C":
                    self.steps[i - 1] = ("alias", before_node, before_inputs, {})
                    relu = True
            self.steps[i] = ("pool2x2", node, inputs, {"relu": relu, "fallback": (kind, info)})

    def _fuse_bn_relu(self) -> None:
        """A ReLU right after a BatchNorm of per-model maps (its only user) runs inside it
        (:class:`~tridens.xopt._kernels.BatchNormTrain`: in place on its output, no extra map)."""
        for i, (kind, node, inputs, info) in enumerate(self.steps):
            if kind != "bn" or info["src"] != "C" or len(node.users) != 1 or i + 1 == len(self.steps):
                continue
            after, after_node, after_inputs, after_info = self.steps[i + 1]
            if after_inputs == [node] and _is_relu(after, after_node, after_info):
                self.steps[i + 1] = ("alias", after_node, after_inputs, {})
                info["relu"] = True

    def _module(self, m: nn.Module, src: str, name: str) -> tuple[str, str]:
        t = type(m)
        if t in (nn.Conv1d, nn.Conv2d) and m.padding_mode == "zeros" and src in "SC":
            self.conv2d = self.conv2d or t is nn.Conv2d
            return "conv", "C"
        if t is nn.Linear and src in "SM":
            return "linear", "M"
        if t in (nn.BatchNorm1d, nn.BatchNorm2d) and src in "CM":
            return "bn", src
        if t in _ELEMENTWISE_MODULES:
            return "apply", src
        if t in _POOL_MODULES and src in "SC":
            return "apply", src
        if t is nn.Flatten and m.start_dim == 1 and m.end_dim == -1:
            return "flatten", "S" if src == "S" else "M"
        if t in _DROPOUTS and src in "CM":
            return "dropout", src
        raise _Unsupported(f"module {name} ({t.__name__}) on a {'shared' if src == 'S' else 'per-model'} input")

    def run(self, member: "BatchedMember", x: torch.Tensor, training: bool) -> torch.Tensor:
        params, buffers, k = member.params, member.buffers, len(member.ids)
        env: dict[Any, torch.Tensor] = {}
        for kind, node, inputs, info in self.steps:
            if kind == "input":
                # channels-last: pooling, BatchNorm and grouped convolutions over K*C channels run
                # several times faster on CPU than in NCHW
                env[node] = x.contiguous(memory_format=torch.channels_last) if (
                    self.conv2d and settings.channels_last and x.dim() == 4) else x
                continue
            if kind == "output":
                return env[inputs[0]]
            if kind == "add":
                env[node] = env[inputs[0]] + env[inputs[1]]
                continue
            if kind == "alias":  # a ReLU folded into the pooling after it
                env[node] = env[inputs[0]]
                continue
            if kind == "pool2x2":
                env[node] = self._pool2x2(node, env[inputs[0]], info)
                continue
            v = env[inputs[0]]
            if kind == "conv":
                m, name = info["module"], info["name"]
                w = params[f"{name}.weight"]
                w = w.reshape(k * w.shape[1], *w.shape[2:])
                b = params.get(f"{name}.bias")
                b = None if b is None else b.reshape(-1)
                shared = v.shape[1] == m.in_channels and v.dim() == w.dim()
                fn = F.conv1d if type(m) is nn.Conv1d else F.conv2d
                if fn is F.conv2d and settings.channels_last:  # a channels-last weight gives a channels-last output
                    w = w.contiguous(memory_format=torch.channels_last)
                groups = m.groups if shared else k * m.groups
                if not shared and v.shape[1] != k * m.in_channels:
                    raise _Unsupported(f"{name}: {v.shape[1]} input channels")
                out = fn(v, w, b, m.stride, m.padding, m.dilation, groups)
                if fn is F.conv2d and settings.channels_last:  # (a 1-channel input does not say its format)
                    out = out.contiguous(memory_format=torch.channels_last)
                env[node] = out
            elif kind == "linear":
                name = info["name"]
                w, b = params[f"{name}.weight"], params.get(f"{name}.bias")
                # Outputs are (K, B, O) views of contiguous (K, O, B) tensors: activations and
                # dropout then run on contiguous memory, the next Linear is a plain bmm and a
                # classifier's cross entropy runs over the class dim of (K, C, B) (vectorized
                # along B; over rows of 10 classes it is per-row bound): fused forward + backward
                # of 16 digits MLPs 1.33 -> 0.69 ms
                if v.dim() == 2 and info["src"] == "S":  # shared (B, F): one matmul with K*O outputs
                    wf = w.reshape(-1, w.shape[-1])
                    out = torch.mm(wf, v.t()) if b is None else torch.addmm(b.reshape(-1, 1), wf, v.t())
                    env[node] = out.view(k, w.shape[1], v.shape[0]).transpose(1, 2)
                elif v.dim() == 3 and v.shape[0] == k:
                    vt = v.transpose(1, 2)
                    out = torch.bmm(w, vt) if b is None else torch.baddbmm(b.unsqueeze(2), w, vt)
                    env[node] = out.transpose(1, 2)
                else:
                    raise _Unsupported(f"{name}: Linear on a {v.dim()}-d input")
            elif kind == "bn":
                env[node] = self._batch_norm(info["module"], info["name"], v, params, buffers, k, training,
                                             info["src"] == "M", info.get("relu", False))
            elif kind == "apply":
                env[node] = info["module"](v)
            elif kind == "call":
                env[node] = info["fn"](v, *node.args[1:], **node.kwargs)
            elif kind == "method":
                env[node] = getattr(v, node.target)(*node.args[1:], **node.kwargs)
            elif kind == "flatten":
                src = info["src"]
                env[node] = v.flatten(1) if src == "S" else v.flatten(2) if src == "M" else \
                    v.reshape(v.shape[0], k, -1).transpose(0, 1)
            elif kind == "dropout":
                env[node] = member._packed_dropout(v, info["name"], info["src"]) if training else v
        raise RuntimeError("the packed program has no output")  # pragma: no cover

    @staticmethod
    def _pool2x2(node: Any, v: torch.Tensor, info: Mapping[str, Any]) -> torch.Tensor:
        if v.dim() == 4 and v.shape[-1] % 2 == 0 and v.shape[-2] % 2 == 0 and v.is_contiguous():
            if torch.is_grad_enabled() and v.requires_grad:
                return _MaxPool2x2.apply(v, info["relu"])
            # validation: the same maxima without the gradient-routing masks (a third of the passes)
            b, c, h, w = v.shape
            pairs = v.view(b, c, h, w // 2, 2)
            rows = torch.maximum(pairs[..., 0], pairs[..., 1]).view(b, c, h // 2, 2, w // 2)
            out = torch.maximum(rows[:, :, :, 0], rows[:, :, :, 1])
            return out.clamp_min_(0) if info["relu"] else out
        kind, fallback = info["fallback"]  # odd sizes, channels-last: the module/function itself
        if info["relu"]:
            v = F.relu(v)
        return fallback["module"](v) if kind == "apply" else fallback["fn"](v, *node.args[1:], **node.kwargs)

    @staticmethod
    def _batch_norm(m: nn.Module, name: str, v: torch.Tensor, params: Mapping[str, torch.Tensor],
                    buffers: Mapping[str, torch.Tensor], k: int, training: bool, model_major: bool,
                    relu: bool = False) -> torch.Tensor:
        weight, bias = params.get(f"{name}.weight"), params.get(f"{name}.bias")
        mean, var = buffers.get(f"{name}.running_mean"), buffers.get(f"{name}.running_var")
        tracked = buffers.get(f"{name}.num_batches_tracked")
        factor = 0.0 if m.momentum is None else m.momentum
        if training and m.track_running_stats and tracked is not None:
            tracked.add_(1)
            if m.momentum is None:
                factor = 1.0 / float(tracked[0])
        use_batch = training or (mean is None and var is None)
        if model_major and v.dim() != 3:
            raise _Unsupported(f"{name}: BatchNorm on a {v.dim() - 1}-d per-model input")
        if use_batch and not model_major and batch_norm_supported(v) and batch_norm_pays(v):
            # the native NCHW kernel is per-element bound on packed small maps: ~2.5x slower forward
            return BatchNormTrain.apply(v, None if weight is None else weight.reshape(-1),
                                        None if bias is None else bias.reshape(-1),
                                        None if mean is None or not training else mean.view(-1),
                                        None if var is None or not training else var.view(-1), factor, m.eps, relu)
        x = v.transpose(0, 1).reshape(v.shape[1], -1) if model_major else v
        out = F.batch_norm(x, None if mean is None else mean.view(-1), None if var is None else var.view(-1),
                           None if weight is None else weight.reshape(-1), None if bias is None else bias.reshape(-1),
                           use_batch, factor, m.eps)
        if model_major:
            return out.view(v.shape[1], k, -1).transpose(0, 1)
        return F.relu(out) if relu else out  # (eval mode with running statistics, CUDA: native kernels)


# -- the fused models ------------------------------------------------------------------------------------
class BatchedMember:
    """The K fused models of a unit: stacked parameters, buffers, optimizer state and random
    streams, stepped on batches its driver supplies.

    It answers the pipeline-member protocol of :mod:`tridens.xopt._cse` (``inputs``,
    ``trial_ids``, ``limit``, ``epoch``, ``wants_epoch``, ``begin_epoch``, ``train_batch(x, y,
    batch)``, ``end_epoch``, ``begin_validation``, ``validate_batch(x, y)``, ``end_validation``,
    ``weights``, ``leave``), so a shared-pipeline unit can feed it like one trainer;
    :class:`BatchedUnit` drives it with its own pipeline. Per epoch: ``end_epoch()`` gives each
    trial trained ``{"train_loss": ...}`` or the error that failed it, ``end_validation()`` its
    validation metrics.
    """

    inputs: tuple[str, ...] = ("batch",)

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, *, shared_input: bool | None = None):
        if not isinstance(evaluator, SupervisedEvaluator):
            raise TypeError(f"operator batching trains Classification/Regression trials, not {type(evaluator).__name__}")
        models = [job.model for job in jobs]
        if len(jobs) == 0 or any(not isinstance(m, nn.Module) for m in models):
            raise TypeError("operator batching needs a model per trial")
        _keep_freed_memory()
        self.jobs = {job.trial.id: job for job in jobs}
        self.configs = {job.trial.id: evaluator.config(job.trial.sample) for job in jobs}
        self.cfg = cfg = self.configs[jobs[0].trial.id]
        self.owner = type(evaluator).__name__
        self.device = cfg.device
        self.ids: list[int] = [job.trial.id for job in jobs]  # the stack's rows, in order
        self._members = list(self.ids)                         # every trial not left yet
        first = models[0]
        self.base = _skeleton(first)
        self._keys = _state_keys(first)
        with torch.no_grad():
            named = [(dict(m.named_parameters()), dict(m.named_buffers())) for m in models]
            self.params: dict[str, torch.Tensor] = {
                n: torch.stack([p[n].detach().to(self.device) for p, _ in named]).requires_grad_(t.requires_grad)
                for n, t in first.named_parameters()}
            self.buffers: dict[str, torch.Tensor] = {
                n: torch.stack([b[n].detach().to(self.device) for _, b in named]) for n, _ in first.named_buffers()}
        self._ps = {job.trial.id: _dropout_ps(job.model) for job in jobs}
        self._dropout_index = _dropout_names(first)
        self._dropout_dims = {n: _DROPOUTS[type(m)] for n, m in first.named_modules() if type(m) in _DROPOUTS}
        self._mask_shapes: dict[tuple[Any, ...], tuple[int, ...]] = {}
        self._scales: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._program: _PackedProgram | None = None
        self._program_checked = False
        self.why_vmap = "" if settings.packed else "settings.packed is False"
        if settings.packed:
            try:
                self._program = _PackedProgram(copy.deepcopy(first).to("meta"))
            except _Unsupported as err:
                self.why_vmap = str(err)
        self._generators = {job.trial.id: self._generator(job.trial.seed) for job in jobs}
        self.optimizer = _VectorOptimizer(cfg.optimizer, [_resolved_momentum(self.configs[i]) for i in self.ids],
                                          [self.configs[i].weight_decay for i in self.ids])
        self._epochs = {i: 0 for i in self.ids}
        self.step = 0
        self._parked: dict[int, dict[str, torch.Tensor]] = {}
        self._errors: dict[int, BaseException] = {}
        self._calls: dict[tuple[int, ...], list[tuple[int, tuple[int, ...], torch.dtype]]] = {}
        self.shared_input = shared_input
        self._fwd_shared = vmap(self._forward, in_dims=(0, 0, 0, None), randomness="error")
        self._fwd_each = vmap(self._forward, in_dims=(0, 0, 0, 0), randomness="error")
        self._training: list[int] = []
        self._totals: dict[int, float] = {}
        self._count = 0
        self._val_sums: dict[int, dict[str, float]] = {}
        self._val_n = self._val_elements = 0

    # -- the member protocol ---------------------------------------------------------------------
    def trial_ids(self) -> list[int]:
        return list(self._members)

    def limit(self, trial_id: int) -> int:
        job = self.jobs[trial_id]
        epochs = self.configs[trial_id].epochs
        return epochs if job.max_steps is None else min(epochs, job.max_steps)

    def epoch(self, trial_id: int) -> int:
        return self._epochs.get(trial_id, 0)

    def wants_epoch(self) -> bool:
        return any(self.epoch(t) < self.limit(t) for t in self.ids)

    def begin_epoch(self) -> None:
        """Park the trials out of budget (not left yet), put the others in training mode."""
        done = [r for r, i in enumerate(self.ids) if self._epochs[i] >= self.limit(i)]
        if done:
            self._remove(done, park=True)
        self._training = list(self.ids)
        self._totals = {i: 0.0 for i in self.ids}
        self._count = 0
        self.base.train()

    def train_batch(self, x: torch.Tensor, y: torch.Tensor, batch: int) -> dict[int, float]:
        """One optimizer step of every model in the stack; returns each one's training loss.
        A model whose loss is not finite fails (reported by :meth:`end_epoch`) and leaves the
        stack before the step; the others' steps do not depend on it."""
        if not self.ids:
            return {}
        cfg = self.cfg
        lrs = [self.configs[i].lr_at(self.step) for i in self.ids]
        out = self._train_outputs(x)
        losses = _stacked_loss(cfg.loss, out, y)
        values = losses.detach().tolist()
        bad = [r for r, v in enumerate(values) if not math.isfinite(v)]
        good = [r for r in range(len(values)) if r not in bad]
        if good:
            (losses[torch.tensor(good, device=losses.device)] if bad else losses).sum().backward()
        result: dict[int, float] = {}
        for r, i in enumerate(self.ids):
            if r in bad:
                self._errors[i] = NonFiniteLoss.at(self.owner, values[r], epoch=self._epochs[i], batch=batch,
                                                   step=self.step, lr=lrs[r])
            else:
                result[i] = values[r]
                if i in self._totals:
                    self._totals[i] += values[r] * len(y)
        self._count += len(y)
        if bad:
            self._remove(bad, park=True, keep_grads=True)
            lrs = [lrs[r] for r in good]
        if self.ids:
            self.optimizer.step(self.params, lrs)
        for p in self.params.values():
            p.grad = None
        self.step += 1
        return result

    def end_epoch(self) -> dict[int, dict[str, float] | BaseException]:
        out: dict[int, dict[str, float] | BaseException] = {}
        for i in self._training:
            if i in self._errors:
                out[i] = self._errors.pop(i)
            elif i in self.ids:
                self._epochs[i] += 1
                out[i] = {"train_loss": self._totals[i] / self._count}
        return out

    def begin_validation(self) -> None:
        self.base.eval()
        self._val_sums = {i: {name: 0.0 for name in self.cfg.metrics} for i in self.ids}
        self._val_n = self._val_elements = 0

    @torch.no_grad()
    def validate_batch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Accumulate every model's metrics on a validation batch, as ``SupervisedTrainer.validate``
        does (per-batch values as Python floats, summed in the same order)."""
        if not self.ids:
            return
        cfg, names = self.cfg, self.cfg.metrics
        out = self._eval_outputs(x)
        size = len(y)
        self._val_n += size
        per: dict[str, list[float]] = {}
        if "val_loss" in names:
            per["val_loss"] = [v * size for v in _stacked_loss(cfg.loss, out, y).tolist()]
        if "val_acc" in names:
            # max's indices are argmax's (the first maximum, NaN first), and over the class dim of
            # the grouped program's (K, C, B) outputs 11x faster (argmax walks it per element)
            per["val_acc"] = [float(c) for c in (out.max(dim=2).indices == y).sum(dim=1).tolist()]
        if "val_mse" in names or "val_mae" in names:
            diff = vmap(lambda o: align_output(o, y) - y.to(o.dtype))(out)
            self._val_elements += diff[0].numel()
            flat = diff.reshape(len(self.ids), -1)
            if "val_mse" in names:
                per["val_mse"] = (flat * flat).sum(dim=1).tolist()
            if "val_mae" in names:
                per["val_mae"] = flat.abs().sum(dim=1).tolist()
        for name, values in per.items():
            for i, v in zip(self.ids, values):
                self._val_sums[i][name] += float(v)

    def end_validation(self) -> dict[int, dict[str, float] | BaseException]:
        self.base.train()
        n, elements = self._val_n, self._val_elements
        return {i: {name: value / (elements if name in ("val_mse", "val_mae") else n) for name, value in sums.items()}
                for i, sums in self._val_sums.items() if i in self._training}

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        if trial_id in self._parked:
            return dict(self._parked[trial_id])
        return self._row_state(self.ids.index(trial_id))

    def leave(self, trial_id: int) -> None:
        if trial_id in self.ids:
            self._remove([self.ids.index(trial_id)], park=False)
        for store in (self._parked, self._errors, self._generators):
            store.pop(trial_id, None)
        if trial_id in self._members:
            self._members.remove(trial_id)

    # -- the vectorized forward ------------------------------------------------------------------
    def _generator(self, seed: int) -> torch.Generator:
        if self.device.type == "cpu":
            # The state torch.manual_seed(seed) gives the CPU stream: what a separate trainer draws from.
            return torch.Generator().manual_seed(seed)
        return torch.Generator(device=self.device).manual_seed(seed)

    def _forward(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                 masks: tuple[torch.Tensor | None, ...], x: torch.Tensor) -> torch.Tensor:
        with _forward_state(_ForwardState(masks=masks)):
            return functional_call(self.base, (params, buffers), (x,))

    def _dropout_calls(self, x: torch.Tensor) -> list[tuple[int, tuple[int, ...], torch.dtype]]:
        """The dropout calls of a training forward on ``x``: (dropout index, mask shape, dtype) in
        call order, found once per input shape by a forward of one model that records them."""
        key = tuple(x.shape)
        if key not in self._calls:
            record: list[tuple[int, tuple[int, ...], torch.dtype]] = []
            if any(type(m) is _MaskDropout for m in self.base.modules()):
                params = {n: p[0].detach() for n, p in self.params.items()}
                buffers = {n: b[0].clone() for n, b in self.buffers.items()}
                with torch.no_grad(), _forward_state(_ForwardState(record=record)):
                    functional_call(self.base, (params, buffers), (x,))
            self._calls[key] = record
        return self._calls[key]

    @property
    def engine(self) -> str:
        """``"grouped kernels"`` (the packed program) or ``"vmap"``."""
        return "vmap" if self._program is None else "grouped kernels"

    def _check_program(self, x: torch.Tensor) -> None:
        """Use the packed program only if it reproduces the vmapped forward (eval mode) on ``x``."""
        self._program_checked = True
        assert self._program is not None
        was_training = self.base.training
        self.base.eval()
        try:
            with torch.no_grad():
                reference = self._outputs(x, ())
                try:
                    got = self._program.run(self, x, training=False)
                except Exception as err:
                    self.why_vmap, self._program = _first_line(err), None
                    return
                if got.shape != reference.shape or not torch.allclose(got, reference, rtol=1e-4, atol=1e-5):
                    self.why_vmap, self._program = "the grouped program disagreed with vmap", None
        finally:
            self.base.train(was_training)

    def _train_outputs(self, x: torch.Tensor) -> torch.Tensor:
        if self._program is not None and not self._program_checked:
            self._check_program(x)
        if self._program is not None:
            return self._program.run(self, x, training=True)
        return self._outputs(x, self._masks(x))

    def _eval_outputs(self, x: torch.Tensor) -> torch.Tensor:
        if self._program is not None and not self._program_checked:
            self._check_program(x)
        if self._program is not None:
            return self._program.run(self, x, training=False)
        return self._outputs(x, ())  # eval mode: dropout is the identity

    def _draw(self, shape: tuple[int, ...], dtype: torch.dtype, ps: Sequence[float],
              like: torch.Tensor | None = None) -> torch.Tensor:
        """Masks ``(K, *shape)``, row k drawn from model k's stream as ``F.dropout`` draws on CPU
        (laid out in memory like ``like`` where that has their shape and dtype)."""
        numel = math.prod(shape)
        if self.device.type == "cpu" and dtype in (torch.float32, torch.float64) and _uniform_dropout():
            # F.dropout's mask is bernoulli_(1 - p) / (1 - p), and bernoulli_ compares one double
            # uniform per element (torch.rand's draw) with 1 - p: drawing the uniforms per model,
            # then comparing and scaling every row in one op each, gives the same masks bit for
            # bit in ~60% of the time (16 masks of 64x64: 0.62 -> 0.37 ms)
            u = torch.empty((len(ps), *shape), dtype=torch.float64)
            for r, (i, p) in enumerate(zip(self.ids, ps)):
                if 0 < p < 1 and numel:
                    u[r].uniform_(0, 1, generator=self._generators[i])
                else:  # F.dropout draws nothing: ones (0 < 1) for p = 0, zeros (0 < 0) for p = 1
                    u[r].zero_()
            q, c = self._mask_scales(tuple(ps), dtype, len(shape))
            out = torch.empty_like(like) if like is not None and like.shape == u.shape and like.dtype == dtype \
                else torch.empty(u.shape, dtype=dtype)
            return torch.lt(u, q, out=out).mul_(c)
        rows = []
        for i, p in zip(self.ids, ps):
            if p == 0 or numel == 0:  # F.dropout returns its input without drawing
                rows.append(torch.ones(shape, dtype=dtype, device=self.device))
            elif p == 1:
                rows.append(torch.zeros(shape, dtype=dtype, device=self.device))
            else:
                rows.append(torch.empty(shape, dtype=dtype, device=self.device)
                            .bernoulli_(1 - p, generator=self._generators[i]).div_(1 - p))
        return torch.stack(rows)

    def _mask_scales(self, ps: tuple[float, ...], dtype: torch.dtype, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, ``1 - p`` (float64: what bernoulli_ compares with; 1 / 0 where nothing is drawn)
        and the scale ``1 / (1 - p)`` as ``F.dropout`` divides (in ``dtype``), shaped to broadcast."""
        key = (ps, dtype, dims)
        if key not in self._scales:
            shape = (-1,) + (1,) * dims
            q = torch.tensor([1.0 if p == 0 else 0.0 if p == 1 else 1 - p for p in ps], dtype=torch.float64)
            keep = torch.tensor([1 - p if 0 < p < 1 else 1.0 for p in ps], dtype=dtype)
            self._scales[key] = (q.view(shape), (torch.ones((), dtype=dtype) / keep).view(shape))
        return self._scales[key]

    def _packed_dropout(self, v: torch.Tensor, name: str, src: str) -> torch.Tensor:
        """Dropout of a packed value: "C" ``(B, K*C, ...)`` or "M" ``(K, B, F)``."""
        index = self._dropout_index[name]
        ps = [self._ps[i][index] for i in self.ids]
        if all(p == 0 for p in ps):
            return v
        k = len(self.ids)
        key = (name, src, k, tuple(v.shape))
        shape = self._mask_shapes.get(key)
        if shape is None:
            per_model = (v.shape[0], v.shape[1] // k, *v.shape[2:]) if src == "C" else tuple(v.shape[1:])
            shape = self._mask_shapes[key] = _MaskDropout(index, self._dropout_dims[name]).mask_shape(
                torch.Size(per_model))
        mask = self._draw(shape, v.dtype, ps, like=v if src == "M" else None)
        if src == "C":
            mask = mask.transpose(0, 1).reshape(shape[0], k * shape[1], *shape[2:])
        return v * mask

    def _masks(self, x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """This step's dropout masks, ``(K, *mask shape)`` per call; each model's rows drawn from
        its own stream in call order, as ``F.dropout`` draws on CPU."""
        masks: list[torch.Tensor | None] = []
        for index, shape, dtype in self._dropout_calls(x):
            ps = [self._ps[i][index] for i in self.ids]
            masks.append(None if all(p == 0 for p in ps) else self._draw(shape, dtype, ps))
        return tuple(masks)

    def _outputs(self, x: torch.Tensor, masks: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """The stacked outputs ``(K, ...)``. The input is shared (not batched) so the first layer
        runs as one wide layer; if the models cannot take an unbatched input (BatchNorm on the raw
        input updates batched statistics from it), each gets its own expanded copy."""
        if self.shared_input is None:  # first call: try sharing on copies of the buffers
            trial = {n: b.clone() for n, b in self.buffers.items()}
            try:
                out = self._fwd_shared(self.params, trial, masks, x)
            except RuntimeError:
                self.shared_input = False
            else:
                self.shared_input = True
                with torch.no_grad():
                    for n, b in self.buffers.items():
                        b.copy_(trial[n])
                return out
        if self.shared_input:
            return self._fwd_shared(self.params, self.buffers, masks, x)
        return self._fwd_each(self.params, self.buffers, masks, x.expand(len(self.ids), *x.shape))

    # -- the stack -------------------------------------------------------------------------------
    def _row_state(self, row: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, name in self._keys:
            source = self.params[name] if name in self.params else self.buffers[name]
            out[key] = source[row].detach().clone().cpu()
        return out

    def _remove(self, rows: list[int], *, park: bool, keep_grads: bool = False) -> None:
        """Take the models at ``rows`` out of the stack (keeping their weights if ``park``)."""
        if park:
            for r in rows:
                self._parked[self.ids[r]] = self._row_state(r)
        keep = [r for r in range(len(self.ids)) if r not in rows]
        self.ids = [self.ids[r] for r in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        with torch.no_grad():
            params = {}
            for n, p in self.params.items():
                q = p.detach().index_select(0, index).requires_grad_(p.requires_grad)
                if keep_grads and p.grad is not None:
                    q.grad = p.grad.index_select(0, index)
                params[n] = q
            self.params = params
            self.buffers = {n: b.index_select(0, index) for n, b in self.buffers.items()}
        self.optimizer.select(keep)


def _stacked_loss(loss: Callable[..., torch.Tensor], out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each model's loss on stacked outputs ``(K, B, ...)``: vmapped, except the default
    classification loss, computed as ONE cross entropy over the K*B rows, averaged per model (the
    same gradients as per-model ``F.cross_entropy`` here, values within an ulp, in a third less
    time than vmap: 0.37 vs 0.57 ms forward + backward for 16 models). Outputs of the grouped
    program are ``(K, C, B)`` tensors seen as ``(K, B, C)``: their cross entropy runs over the
    class dim of ``(K, C, B)`` as it lies (log-softmax vectorized along B)."""
    if loss is F.cross_entropy and out.dim() == 3 and y.dim() == 1 and not y.is_floating_point():
        k, b = out.shape[:2]
        if out.transpose(1, 2).is_contiguous():
            return F.cross_entropy(out.transpose(1, 2), y.expand(k, b), reduction="none").mean(1)
        return F.cross_entropy(out.reshape(k * b, -1), y.repeat(k), reduction="none").view(k, b).mean(1)
    return vmap(loss, in_dims=(0, None))(out, y)


_UNIFORM_DROPOUT: list[bool] = []


def _uniform_dropout() -> bool:
    """Whether this build's CPU ``bernoulli_(q)`` is ``torch.rand(dtype=float64) < q`` (its default
    kernel; with MKL on Intel CPUs it draws from an MKL stream instead): checked once per process."""
    if not _UNIFORM_DROPOUT:
        a, b = torch.Generator().manual_seed(20261123), torch.Generator().manual_seed(20261123)
        drawn = torch.empty(1000).bernoulli_(0.7, generator=a)
        compared = torch.rand(1000, dtype=torch.float64, generator=b).lt(0.7).float()
        _UNIFORM_DROPOUT.append(torch.equal(drawn, compared) and torch.equal(a.get_state(), b.get_state()))
    return _UNIFORM_DROPOUT[0]


def _state_keys(model: nn.Module) -> list[tuple[str, str]]:
    """``(state_dict key, name of the stacked tensor holding it)``: tied parameters and buffers
    appear under every name in a state_dict but are stacked once."""
    canonical = {id(t): n for n, t in model.named_parameters()}
    for n, t in model.named_buffers():
        canonical.setdefault(id(t), n)
    alias = {n: canonical[id(t)] for n, t in model.named_parameters(remove_duplicate=False)}
    alias.update({n: canonical[id(t)] for n, t in model.named_buffers(remove_duplicate=False)})
    return [(k, alias.get(k, k)) for k in model.state_dict().keys()]


class BatchedUnit(ExecutionUnit):
    """K trials with identical model structure and training setup, trained as one vectorized
    model (see the module docstring) on one data pipeline. Built by :func:`plan_batching`;
    usable directly::

        unit = BatchedUnit(jobs, evaluator)
        while unit.active():
            results = unit.train_epoch()       # {trial id: metrics, or the error that failed it}
            ...                                 # unit.drop(trial_id) when a trial ends or stops

    ``weights(trial_id)`` is the trial's own ``state_dict`` (same keys as its model's).
    """

    kind = "batched"

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, reason: str = "", *,
                 shared_input: bool | None = None):
        super().__init__(jobs, evaluator)
        self.reason = reason
        self.memory: int | None = None  # the planner's estimate (bytes), read by the mixed-unit pass
        self.member = BatchedMember(jobs, evaluator, shared_input=shared_input)
        cfg = self.member.cfg
        self._seed = jobs[0].trial.seed  # data order and augmentation: shared (the group key says so)
        self._train = BatchSource(cfg.train, cfg.device)
        self._val = BatchSource(cfg.val, cfg.device)

    def describe(self) -> str:
        m = self.member  # (the planner's probe already checked the grouped program on this structure)
        return super().describe() + f" ({m.engine}" + (f": {m.why_vmap}" if m._program is None else "") + ")"

    def limit(self, trial_id: int) -> int:
        return self.member.limit(trial_id)

    def epoch(self, trial_id: int) -> int:
        return self.member.epoch(trial_id)

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        return self.member.weights(trial_id)

    def _leave(self, trial_id: int) -> None:
        self.member.leave(trial_id)

    def train_epoch(self) -> dict[int, UnitResult]:
        member, cfg = self.member, self.member.cfg
        if not member.wants_epoch():
            return {}
        t0 = time.monotonic()
        epoch = min(member.epoch(i) for i in member.ids if member.epoch(i) < member.limit(i))
        member.begin_epoch()
        trained = list(member.ids)
        for batch, (x, y) in enumerate(self._train.epoch_batches(cfg, self._seed, epoch)):
            if not member.ids:
                break  # every model failed: the rest of the epoch trains nothing
            member.train_batch(cfg.augment(x, self._seed, epoch, batch), y, batch)
        train = member.end_epoch()
        val: dict[int, dict[str, float] | BaseException] = {}
        if member.ids:
            member.begin_validation()
            for x, y in self._val.validation_batches(cfg, self._seed):
                member.validate_batch(x, y)
            val = member.end_validation()
        results: dict[int, UnitResult] = {}
        metric = self.objective.metric
        for i in trained:
            result = train.get(i)
            if isinstance(result, BaseException) or result is None:
                results[i] = result if result is not None else RuntimeError(f"trial {i} was not trained")
                continue
            metrics = {**val[i], **result} if isinstance(val.get(i), dict) else result
            results[i] = {metric: metrics[metric], **metrics}
        share = (time.monotonic() - t0) / max(len(trained), 1)
        for i in trained:
            info = self.jobs[i].trial.info
            info["train_seconds"] = info.get("train_seconds", 0.0) + share
        return results


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


_PEAKS: dict[tuple[str, int], float] = {}
# (structure key, setup key, threads) -> (fraction of the peak, FLOPs per CPU second, CPU seconds) of
# one model's separate step, from the first real steps of an adaptive unit
_EFFICIENCY: dict[tuple[Any, ...], tuple[float, float, float]] = {}


def peak_matmul_flops(device: torch.device) -> float:
    """FLOPs per CPU second of a 256x256 fp32 matmul on ``device`` (a warm-up, then the best of
    eight; cached per process and thread count): the roof one model's step is compared with. ~3 ms
    (the 512x512 probe it replaces took ~14 ms, a tenth of the planner's cost for 16 small MLPs, and
    read 81-87 GFLOP/s where this one reads 80-99: close enough for a bar at 20% of it)."""
    key = (device.type, torch.get_num_threads())
    if key not in _PEAKS:
        a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)
        a @ b
        best = 0.0
        for _ in range(8):
            t0 = time.process_time()
            a @ b
            best = max(best, 2 * 256 ** 3 / max(time.process_time() - t0, 1e-6))
        _PEAKS[key] = best
    return _PEAKS[key]


def _probe(jobs: Sequence[Job], evaluator: SupervisedEvaluator, x: torch.Tensor, y: torch.Tensor) -> BatchedMember:
    """A throwaway member that ran one fused step and a validation batch (proves the models
    vectorize, and finds whether they can share their input). Forced fusion only: an adaptive
    unit finds the same on its first real steps."""
    probe = BatchedMember(jobs, evaluator)
    probe.begin_epoch()
    probe.train_batch(x, y, 0)
    probe.begin_validation()
    probe.validate_batch(x, y)
    probe.end_validation()
    return probe


def _model_costs(model: nn.Module, x: torch.Tensor, cfg: TrainConfig) -> tuple[int, float]:
    """``(bytes one model adds to a unit, training FLOPs of one step)`` from ONE evaluation-mode
    forward of the model on 8 examples of ``x`` under ``no_grad`` with copies of its buffers (nothing
    of the model changed, no random numbers drawn; ~0.3 ms where a meta-device forward took 2-6 ms
    and ``torch.utils.flop_counter`` 1-2 ms more): parameters, gradients, optimizer state and
    buffers, plus twice the outputs of its leaf modules scaled to the batch (as
    :func:`_per_model_bytes`). FLOPs are those of its ``Linear`` and ``Conv`` layers (the matmul-like
    work the roofline compares with the peak matmul rate; other layers count 0, which can only
    understate the rate and so lead to measuring fusion), times 3 for forward and backward."""
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
    try:
        model.eval()  # (activation shapes as in training; no dropout drawn, no running statistics moved)
        with torch.no_grad():
            functional_call(model, buffers, (part,), strict=False)
    finally:
        for h in handles:
            h.remove()
        for m, flag in flags:
            m.training = flag
    return param_bytes * (2 + states) + buffer_bytes + int(2 * activations * scale), 3.0 * flops * scale


# -- cheap structure keys: trace only models that can be grouped -----------------------------------
_MODULE_STATE = {"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                 "_is_full_backward_hook"}
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device, torch.Size)


def _shape_key(model: nn.Module) -> tuple[Any, ...]:
    """Module tree (names and classes) and parameter/buffer names, shapes and dtypes: a necessary
    condition for two models to stack (no trace; microseconds)."""
    tree = tuple((n, type(m).__module__, type(m).__qualname__) for n, m in model.named_modules())
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
            attrs = []
            for key, value in m.__dict__.items():
                if key in _MODULE_STATE or (key == "p" and type(m) in _DROPOUTS):
                    continue
                if key.startswith("_") and key.endswith("hooks") or key.endswith("hooks_with_kwargs") \
                        or key.endswith("hooks_always_called"):
                    if value:
                        return None
                    continue
                attrs.append((key, _plain(value)))
            parts.append((name, tuple(attrs)))
    except TypeError:
        return None
    return tuple(parts)


def _structure_keys(jobs: Sequence[Job]) -> list[str | BaseException | None]:
    """The structure key (:func:`_structure_key`, a graph trace) of each job whose model shares its
    module tree and tensor shapes with another job's; models with equal attribute keys share one
    trace. None for a job with no partner to stack with (in ``jobs``' order)."""
    by_shape: dict[tuple[Any, ...], list[int]] = {}
    for index, job in enumerate(jobs):
        by_shape.setdefault(_shape_key(job.model), []).append(index)
    keys: list[str | BaseException | None] = [None] * len(jobs)
    traced: dict[tuple[Any, ...], str | BaseException] = {}
    for group in by_shape.values():
        if len(group) < 2:
            continue
        for index in group:
            job = jobs[index]
            attrs = _attribute_key(job.model)
            if attrs is not None and attrs in traced:
                keys[index] = traced[attrs]
                continue
            try:
                key: str | BaseException = _structure_key(job.model)
            except Exception as err:
                key = err
            keys[index] = key
            if attrs is not None:
                traced[attrs] = key
    return keys


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]


def _differing(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    for (name, _), x, y in zip(_SETUP_FIELDS, a, b):
        if x != y:
            return name
    return "setup"


def plan_batching(jobs: Sequence[Job], evaluator: StepwiseEvaluator, *,
                  max_unit_memory: int | str | None = None) -> tuple[list[ExecutionUnit], list[Job]]:
    """Group ``jobs`` by (structure, training setup) and fuse each group of two or more, within
    ``max_unit_memory`` (bytes or e.g. ``"2GiB"``; default: the experiment's bound, see
    :func:`tridens.units.resolve_max_unit_memory`): as a :class:`BatchedUnit` where
    ``settings.mode == "force"`` or an earlier group with the same key measured that fusion pays;
    as an :class:`~tridens.xopt._adaptive.AdaptiveUnit` (fused or separate, decided from its own
    first real steps) where nothing was measured yet; not at all where a group with the same key
    measured that it does not pay. Returns the units and the jobs left for other optimizations /
    separate training. Logs one line per group that is not fused, saying why (fused units log
    their own line through the planner)."""
    if settings.mode == "off" or not isinstance(evaluator, SupervisedEvaluator):
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
            cfg = evaluator.config(job.trial.sample)
            if cfg.optimizer not in ("sgd", "adam", "adamw", "rmsprop"):
                raise ValueError(f"no vectorized optimizer {cfg.optimizer!r}")
        except Exception as err:  # the separate trainer reports invalid setups as the trial's error
            log.info("batching: trial %d not fused: %s", job.trial.id, _first_line(err))
            leftover.append(job)
            continue
        candidates.append((job, cfg))
    keys = _structure_keys([job for job, _ in candidates])
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
            budget = resolve_max_unit_memory(max_unit_memory, evaluator.config(group[0].trial.sample).device)
            made, rest = _plan_group(skey, setup, group, evaluator, budget)
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
                budget: int) -> tuple[list[ExecutionUnit], list[Job]]:
    ids = [j.trial.id for j in group]
    cfg = evaluator.config(group[0].trial.sample)
    try:
        x, y = _first_batch(cfg, group[0].trial.seed)
    except Exception as err:
        log.info("batching: trials %s not fused: %s", ids, _first_line(err))
        return [], list(group)
    if settings.mode == "force":
        return _plan_forced(group, evaluator, budget, x, y)
    threads = torch.get_num_threads()
    efficiency = _EFFICIENCY.get((skey, setup, threads)) if cfg.device.type == "cpu" else None
    if efficiency is not None and efficiency[0] >= settings.max_separate_efficiency:
        log.info("batching: trials %s not fused: one model's step already runs at %.0f%% of the peak matmul "
                 "rate (%.1f GFLOP/s; >= %.0f%%; measured on an earlier unit's first steps), no per-operation "
                 "overhead left for fusion to remove", ids, 100 * efficiency[0], efficiency[1] / 1e9,
                 100 * settings.max_separate_efficiency)
        return [], list(group)
    try:
        per_model, flops = _model_costs(group[0].model, x, cfg)
    except Exception:  # a forward the meta device cannot run: measure on a throwaway fused step
        try:
            per_model, flops = _per_model_bytes(_probe(group[:2], evaluator, x, y), x), 0.0
        except Exception as err:
            log.info("batching: trials %s not fused: the models do not vectorize (%s)", ids, _first_line(err))
            return [], list(group)
    size = _unit_size(ids, per_model, budget)
    if size < 2:
        return [], list(group)
    from ._adaptive import AdaptiveUnit, decision_key

    units: list[ExecutionUnit] = []
    rest: list[Job] = []
    for chunk in _chunks(group, size):
        k, chunk_ids = len(chunk), [j.trial.id for j in chunk]
        speedup = _SPEEDUPS.get(decision_key(skey, setup, k, cfg.device))
        if speedup is not None and speedup < settings.min_speedup:
            log.info("batching: trials %s not fused: measured %.2fx on an earlier unit's first steps (below %.2fx)",
                     chunk_ids, speedup, settings.min_speedup)
            rest.extend(chunk)
            continue
        try:
            if speedup is not None:
                unit: BatchedUnit = BatchedUnit(chunk, evaluator, reason=f"{k} trials, fused: measured {speedup:.2f}x "
                                                "on an earlier unit's first steps")
            else:
                unit = AdaptiveUnit(chunk, evaluator, reason=f"{k} trials, fused or not as measured on their first "
                                    "real steps", skey=skey, setup=setup, flops=flops)
        except Exception as err:
            log.info("batching: trials %s not fused: the models do not vectorize (%s)", chunk_ids, _first_line(err))
            rest.extend(chunk)
            continue
        unit.memory = per_model * k
        units.append(unit)
    return units, rest


def _unit_size(ids: list[int], per_model: int, budget: int) -> int:
    """The most models per unit under ``budget`` bytes (logged when not even two fit)."""
    size = min(settings.max_unit_size, max(1, budget // max(per_model, 1)))
    if size < 2:
        log.info("batching: trials %s not fused: one model needs ~%.0f MiB, max_unit_memory is %.0f MiB",
                 ids, per_model / 2**20, budget / 2**20)
    return size


def _plan_forced(group: list[Job], evaluator: SupervisedEvaluator, budget: int, x: torch.Tensor,
                 y: torch.Tensor) -> tuple[list[ExecutionUnit], list[Job]]:
    """``settings.mode == "force"``: fuse every compatible group (a throwaway step proves the
    models vectorize first)."""
    ids = [j.trial.id for j in group]
    try:
        probe = _probe(group[:2], evaluator, x, y)
        per_model = _per_model_bytes(probe, x)
        shared = probe.shared_input
        checked = probe._program is not None and probe._program_checked  # the structure's grouped program
    except Exception as err:
        log.info("batching: trials %s not fused: the models do not vectorize (%s)", ids, _first_line(err))
        return [], list(group)
    size = _unit_size(ids, per_model, budget)
    if size < 2:
        return [], list(group)
    units: list[ExecutionUnit] = []
    for chunk in _chunks(group, size):
        unit = BatchedUnit(chunk, evaluator, reason=f"{len(chunk)} trials, fused: forced (settings.mode='force')",
                           shared_input=shared)
        unit.memory = per_model * len(chunk)
        unit.member._program_checked = unit.member._program_checked or checked
        units.append(unit)
    return units, []
