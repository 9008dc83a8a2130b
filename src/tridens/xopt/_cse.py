"""Common sub-expression elimination across the trials of a group (issue 4).

Two things that many trials of a TrialGroup compute alike are computed once per unit:

* **The data pipeline.** Trials whose training configs read the same datasets with the same batch
  size, the same ``transforms`` and the same data order (the same data seed: the default,
  ``data_seed=0``) read ONE loader: each training batch is indexed and augmented once and fed to
  every member, and each validation batch is read once. Members may be any architectures.
* **A frozen prefix.** When members' models start with the same non-trainable subgraph (a
  pretrained backbone in a fine-tuning space) -- found with the graph IR's prefix fingerprints,
  with identical weights checked by hashing them, and deterministic (no dropout or other random
  op; BatchNorm may be in training mode: every member sees the same batches, so its running
  statistics evolve alike) -- it is computed once per batch under ``torch.no_grad()`` and its
  output fed to each member's remaining part (the *suffix*, split off with ``torch.fx``), which
  alone trains. ``weights(trial_id)`` is still the whole model's ``state_dict`` (same keys).

**Fused equals separate.** Every member is a :class:`SupervisedTrainer` driven through
``train_batch``; the batches, the augmentation (its randomness is drawn from the data seed), the
learning rates and each trial's own random stream are those of separate training, so per-epoch
metrics are bit-identical on CPU. A split is used only after it reproduced the model's output on a
batch of real data in training and in evaluation mode, with the prefix consuming no random numbers.
A member that modifies its input in place is detected (version counters) and gets copies.

**Memory.** A unit's estimate -- every member's parameters, buffers, gradients and optimizer
state, plus the largest member's activations at the batch size (shapes from the graph IR), the
shared prefixes' activations and the shared batches -- is kept under ``max_unit_memory`` (the
experiment's, one bound for every optimization: :func:`tridens.units.
resolve_max_unit_memory`; or the ``max_unit_memory=`` argument of :func:`plan_cse`); a group
over it is split into several units, each with its own pipeline. Members train one at a time, so a
unit never holds more than separate training of the same trials would, plus the shared batches.

**Log.** One line per unit: what is shared, and which trials were not and why ("different batch
size (32, not 64)", "different data seed", "prefix weights differ", ...).

**Members.** A unit drives *members* (:class:`PipelineMember`): anything that trains one or more
trials on the shared batches. :class:`TrainerMember` wraps one trial's trainer (its whole model, or
its suffix after a shared prefix). A fused group of same-shaped models (``tridens.xopt._batching``)
can join a unit as one member answering the same protocol (a "mixed unit"): ``inputs`` says which
shared tensor it reads, ``train_batch(x, y, batch)`` steps every trial it holds, the validation
calls accumulate per trial, ``weights``/``leave`` work per trial. ``tridens.xopt._batching.
BatchedMember`` is such a member: ``SharedPipelineUnit(jobs, evaluator, members=[BatchedMember(
same_shaped_jobs, evaluator), TrainerMember(...), ...])`` trains both on one pipeline (tested). The
planner builds such mixed units itself: after the batching and CSE planners, the pass
:func:`merge_pipelines` puts batched units that read the same pipeline as other units (or as
leftover trials) into one shared-pipeline unit, within ``max_unit_memory``.

**The members' own steps, shared** (third session). Sharing the pipeline saves its work P once
per member, so K members gain K(P + T) / (P + KT), bounded by the members' steps T. The planner
therefore also puts the whole-model members of a unit into one :class:`JointMember`: per batch
each member's forward and loss (in its own random stream), ONE ``torch.autograd.backward`` over
the finite losses (the members' parameters are disjoint, so each gets exactly its own gradient),
then one multi-model optimizer step (torch's ``foreach`` implementation over every member's
parameters, grouped by optimizer class and hyperparameters, state kept in each member's own
optimizer: bit-identical to the members' own steps on CPU). Members whose first layer is the
only reader of the batch (through at most one flatten) and has a compatible shape (``nn.Linear``
with the same ``in_features``; bias-free ``nn.Conv2d`` with the same ``in_channels``, kernel,
stride, padding, dilation, groups 1) may run that layer as ONE wide op on ``torch.cat`` of their
own weights (:class:`_WideLayer`), each member's model after its first layer split off with
``torch.fx`` and checked on real data like a prefix split; the planner keeps a wide op only
where it measured it faster than the members' own layers (:data:`settings`). A joint step holds
every member's activations at once, so it is used only within ``max_unit_memory``. Members that
modify their input in place step alone. Per-epoch metrics stay bit-identical to separate training
(tested; see ``BENCHMARKS.md`` for what it gains).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..units import ExecutionUnit, Job, UnitResult, default_max_unit_memory, resolve_max_unit_memory
from ..evaluators._base import StepwiseEvaluator
from ..evaluators._errors import NonFiniteLoss
from ..evaluators._supervised import SupervisedTrainer, TrainConfig, ValidationSums, BatchSource, SupervisedEvaluator
from ..graph import Graph, trace
from ..graph import meta

__all__ = [
    "MIN_PREFIX_SHARE", "BATCH", "CSESettings", "settings",
    "PipelineMember", "TrainerMember", "JointMember", "SharedPrefix", "SharedPipelineUnit",
    "plan_cse", "default_max_unit_memory", "unit_memory",
]

log = logging.getLogger("tridens")

#: A shared frozen prefix is used only when it holds at least this fraction of the members'
#: forward FLOPs (below that, saving it does not repay splitting the models).
MIN_PREFIX_SHARE = 0.05

#: The key of the shared (augmented) input batch among a unit's shared tensors.
BATCH = "batch"

#: Examples of the training set the planner traces and checks models with.
_EXAMPLES = 8


# ------------------------------------------------------------------------------------------------
# members
# ------------------------------------------------------------------------------------------------
class PipelineMember:
    """What a :class:`SharedPipelineUnit` feeds: one or more trials training on the shared batches.

    ``inputs`` names the shared tensors the member reads (``(BATCH,)``: the augmented input batch;
    otherwise outputs of a :class:`SharedPrefix`); with one name it receives that tensor, with
    several a tuple. Per epoch the unit calls ``begin_epoch()``, ``train_batch(x, y, batch)`` for
    every batch, ``end_epoch()``, then ``begin_validation()``, ``validate_batch(x, y)`` for every
    validation batch and ``end_validation()``. Failures are per trial: a trial whose step raised
    reports the error from ``end_epoch`` and receives no more batches; the others go on.
    """

    inputs: tuple[str, ...] = (BATCH,)

    def trial_ids(self) -> list[int]:  # pragma: no cover - abstract
        """The member's trials still in the unit, in order."""
        raise NotImplementedError

    def limit(self, trial_id: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def epoch(self, trial_id: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def wants_epoch(self) -> bool:
        """Whether any of its trials trains this epoch."""
        return any(self.epoch(t) < self.limit(t) for t in self.trial_ids())

    def begin_epoch(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def train_batch(self, x: Any, y: torch.Tensor, batch: int) -> None:  # pragma: no cover - abstract
        """One optimizer step of every trial that trains this epoch and has not failed."""
        raise NotImplementedError

    def end_epoch(self) -> dict[int, dict[str, float] | BaseException]:  # pragma: no cover - abstract
        """Per trial trained this epoch: its training metrics, or the error that failed it."""
        raise NotImplementedError

    def begin_validation(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def validate_batch(self, x: Any, y: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def end_validation(self) -> dict[int, dict[str, float] | BaseException]:  # pragma: no cover - abstract
        raise NotImplementedError

    def weights(self, trial_id: int) -> dict[str, Any] | None:  # pragma: no cover - abstract
        """The trial's weights, keyed as its own model's state_dict."""
        raise NotImplementedError

    def leave(self, trial_id: int) -> None:  # pragma: no cover - abstract
        """Release the trial's state."""
        raise NotImplementedError


class TrainerMember(PipelineMember):
    """One trial: a :class:`SupervisedTrainer` of its model, or of its suffix after a shared prefix.

    ``model`` is the trial's whole model (what ``weights`` returns); ``trainer.model`` is what
    trains (the same model, or the suffix, whose modules are the model's own). ``prefix_buffers``
    maps the model's state_dict keys of the prefix's buffers to the tensors of the shared prefix
    that replace them (BatchNorm running statistics updated once for all members).
    """

    def __init__(self, job: Job, trainer: SupervisedTrainer, *, inputs: tuple[str, ...] = (BATCH,),
                 prefix_buffers: Mapping[str, torch.Tensor] | None = None):
        self.job = job
        self.trainer = trainer
        self.inputs = inputs
        self.prefix_buffers = dict(prefix_buffers or {})
        self.trial_id = job.trial.id
        self._training = False
        self._error: BaseException | None = None
        self._total = 0.0
        self._count = 0
        self._val: ValidationSums | None = None
        self._was_training = True
        self._left = False

    def trial_ids(self) -> list[int]:
        return [] if self._left else [self.trial_id]

    def limit(self, trial_id: int) -> int:
        steps = self.job.max_steps
        return self.trainer.epochs if steps is None else min(self.trainer.epochs, steps)

    def epoch(self, trial_id: int) -> int:
        return self.trainer.epoch

    def begin_epoch(self) -> None:
        self._training = self.wants_epoch()
        self._error = None
        self._total, self._count = 0.0, 0
        if self._training:
            try:
                self.trainer.begin_epoch()
            except Exception as err:
                self._error = err

    def train_batch(self, x: Any, y: torch.Tensor, batch: int) -> None:
        if not self._training or self._error is not None:
            return
        try:
            loss = self.trainer.train_batch(x, y, batch)
        except Exception as err:
            self._error = err
            return
        self._total += loss * len(y)
        self._count += len(y)

    def end_epoch(self) -> dict[int, dict[str, float] | BaseException]:
        if not self._training:
            return {}
        if self._error is not None:
            return {self.trial_id: self._error}
        try:
            return {self.trial_id: self.trainer.end_epoch(self._total / self._count)}
        except Exception as err:
            self._error = err
            return {self.trial_id: err}

    def begin_validation(self) -> None:
        self._val = None
        if not self._training or self._error is not None:
            return
        model = self.trainer.model
        self._was_training = model.training
        model.eval()
        self._val = ValidationSums(self.trainer.config)

    @torch.no_grad()
    def validate_batch(self, x: Any, y: torch.Tensor) -> None:
        if self._val is None or self._error is not None:
            return
        try:
            with self.trainer._random_stream():
                self._val.add(self.trainer.model(x), y)
        except Exception as err:
            self._error = err

    def end_validation(self) -> dict[int, dict[str, float] | BaseException]:
        if not self._training:
            return {}
        if self._val is not None:
            self.trainer.model.train(self._was_training)
        if self._error is not None:
            return {self.trial_id: self._error}
        assert self._val is not None
        return {self.trial_id: self._val.result()}

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        state = {k: v.detach().cpu() for k, v in self.job.model.state_dict().items()}
        for key, tensor in self.prefix_buffers.items():
            if key in state:
                state[key] = tensor.detach().cpu().clone()
        return state

    def leave(self, trial_id: int) -> None:
        self._left = True


# ------------------------------------------------------------------------------------------------
# several trainers stepped together: one backward, first layers as one wide op
# ------------------------------------------------------------------------------------------------
@dataclass
class CSESettings:
    """Knobs of the joint step (module-level :data:`settings`; ``TRIDENS_CSE_JOINT=0`` and
    ``TRIDENS_CSE_WIDE=auto|force|off`` set them at import).

    ``joint``: step the whole-model members of a unit together (:class:`JointMember`: their
    forwards, then ONE backward over their losses, then each optimizer's step) where the memory
    bound allows holding all their activations at once. ``wide``: run compatible first layers as
    one op: ``"auto"`` times the wide layer against the members' own layers on the real batch
    (forward and backward, interleaved, CPU time; cached per layer shapes, batch shape, device and
    threads) and keeps it only at ``wide_min_speedup`` or more; ``"force"`` always (tests);
    ``"off"``. ``foreach_step``: step the joint members' optimizers with one ``foreach`` call per
    optimizer class and hyperparameters (:class:`_MultiStep`; bit-identical on CPU). ``fast_pools``:
    run the joint members' 2x2 max-pools (and a ReLU right before one) by the exact two-pass kernel
    of ``tridens.xopt._batching`` (:func:`_with_fast_pools`; used only where it reproduced the
    model's values and gradients bit for bit on real data at planning).

    >>> from tridens.xopt import _cse
    >>> _cse.settings.wide in ("auto", "force", "off")
    True
    """

    joint: bool = True
    wide: str = "auto"
    wide_min_speedup: float = 1.1
    measure_rounds: int = 5
    foreach_step: bool = True
    fast_pools: bool = True


class _RoutedState(dict):
    """The state of a multi-model optimizer: each parameter's entry lives in its own trainer's
    optimizer (so that optimizer stays complete), found by the parameter."""

    def __init__(self, owners: Mapping[int, torch.optim.Optimizer]):
        super().__init__()
        self.owners = owners   # id(parameter) -> the optimizer that owns it

    def __getitem__(self, p: Any) -> Any:
        return self.owners[id(p)].state[p]

    def get(self, p: Any, default: Any = None) -> Any:
        state = self.owners[id(p)].state
        return state[p] if p in state else default

    def __contains__(self, p: Any) -> bool:
        return p in self.owners[id(p)].state


class _MultiStep:
    """One optimizer step for several trainers: members whose optimizers are of one class with equal
    hyperparameters (the lr of this step included) are stepped by ONE call of torch's ``foreach``
    implementation over all their parameters -- on CPU bit-identical to each optimizer's own
    for-loop step (checked for SGD, Adam, AdamW, RMSprop) -- with the state kept in each member's
    own optimizer. Members whose hyperparameters differ form separate calls."""

    def __init__(self) -> None:
        self._merged: dict[type, torch.optim.Optimizer] = {}
        self._owners: dict[int, torch.optim.Optimizer] = {}

    def step(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        groups: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        hyper: dict[tuple[Any, ...], dict[str, Any]] = {}
        for opt in optimizers:
            for group in opt.param_groups:
                settings_ = {k: v for k, v in group.items() if k != "params"}
                key = (type(opt), tuple(sorted(settings_.items())))
                hyper[key] = settings_
                params = groups.setdefault(key, [])
                for p in group["params"]:
                    self._owners[id(p)] = opt
                    params.append(p)
        for key, params in groups.items():
            cls = key[0]
            merged = self._merged.get(cls)
            if merged is None:
                # built once per class; its one param group is replaced at every step
                merged = self._merged[cls] = cls(params, lr=hyper[key]["lr"], foreach=True)
                merged.state = _RoutedState(self._owners)  # type: ignore[assignment]
            merged.param_groups = [{**hyper[key], "foreach": True, "params": params}]
            merged.step()

    def forget(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._owners.pop(id(p), None)


settings = CSESettings(joint=os.environ.get("TRIDENS_CSE_JOINT", "1") != "0",
                       wide=os.environ.get("TRIDENS_CSE_WIDE", "auto"))


class _WideLayer:
    """First layers of several members that read the same batch (``flatten``: flattened from dim 1),
    run as ONE ``linear``/``conv2d`` on their concatenated weights. The concatenation is
    ``torch.cat`` of the members' own parameters inside autograd, so the backward of the one op
    hands every member exactly the gradient of its own rows; each member's output slice is copied
    into a tensor of its own (the layout its own layer gives, and an own version counter, so a
    member's in-place op on it cannot touch the others' saved tensors)."""

    def __init__(self, kind: str, flatten: bool, layers: Mapping[int, nn.Module]):
        self.kind = kind
        self.flatten = flatten
        self.layers = dict(layers)   # trial id -> its first layer (the model's own module)

    def describe(self, ids: Sequence[int] | None = None) -> str:
        mods = [self.layers[t] for t in (self.layers if ids is None else ids)]
        width = sum(int(m.weight.shape[0]) for m in mods)
        m0 = mods[0]
        if self.kind == "linear":
            return f"Linear({m0.in_features} -> {width})"
        return (f"Conv2d({m0.in_channels} -> {width}, kernel {tuple(m0.kernel_size)}, stride {tuple(m0.stride)}, "
                f"padding {m0.padding if isinstance(m0.padding, str) else tuple(m0.padding)})")

    def __call__(self, x: torch.Tensor, ids: Sequence[int]) -> dict[int, torch.Tensor]:
        mods = [self.layers[t] for t in ids]
        inp = x.flatten(1) if self.flatten else x
        weight = torch.cat([m.weight for m in mods])
        # the biases enter the op (its rounding is the members' own) but not its backward: each
        # member's bias gradient is reduced from its own slice, as its own layer's backward does
        # (a wide reduction rounds differently, and a bias before BatchNorm has a gradient that is
        # rounding noise only, which Adam scales up to lr-sized steps)
        bias = torch.cat([m.bias for m in mods]).detach() if mods[0].bias is not None else None
        if self.kind == "linear":
            out, dim = F.linear(inp, weight, bias), -1
        else:
            m0 = mods[0]
            out, dim = F.conv2d(inp, weight, bias, m0.stride, m0.padding, m0.dilation, 1), 1
        parts = out.split([int(m.weight.shape[0]) for m in mods], dim)
        given: dict[int, torch.Tensor] = {}
        for t, m, part in zip(ids, mods, parts):
            part = part.clone(memory_format=torch.contiguous_format)
            if m.bias is not None and m.bias.requires_grad and torch.is_grad_enabled():
                shape = (-1,) if self.kind == "linear" else (-1, 1, 1)
                part = part + (m.bias - m.bias.detach()).view(shape)  # adds exact zeros
            given[t] = part
        return given


class JointMember(PipelineMember):
    """Several trials' trainers stepped together on the shared batch.

    Per batch: every member's lr and ``zero_grad`` as its trainer sets them; the wide first layers
    (:class:`_WideLayer`, members listed in ``after_first``: trial id -> the model after its first
    layer); every member's forward and loss in its own random stream; ONE
    ``torch.autograd.backward`` over the finite losses (the members' parameters are disjoint, so
    each receives exactly its own gradient); then each member's own optimizer step. A member whose
    loss is NaN/inf fails alone with the :class:`NonFiniteLoss` its separate trainer raises (same
    epoch, batch, step) and is left out of the backward and the step. Validation batches run the
    wide layers too (no grad). The bookkeeping per trial is its :class:`TrainerMember`'s.

    A member that modified the shared batch in place would corrupt what the members before it
    saved for the backward, so only the ``trusted`` trials (checked by the planner on real data not
    to do so) read the shared batch itself; the others get their own copy of it. A trusted member
    found modifying it anyway gets copies from then on, and the members after it a pristine copy.

    >>> member = JointMember([TrainerMember(job, evaluator.trainer(job.model, {}, 0))  # doctest: +SKIP
    ...                       for job in jobs])
    >>> unit = SharedPipelineUnit(jobs, evaluator, members=[member])                   # doctest: +SKIP
    """

    def __init__(self, members: Sequence[TrainerMember], *, wide: Sequence[_WideLayer] = (),
                 after_first: Mapping[int, nn.Module] | None = None, trusted: Iterable[int] = (),
                 fast: Mapping[int, nn.Module] | None = None, fast_after: Mapping[int, nn.Module] | None = None):
        self.members = list(members)
        self.trusted = set(trusted)
        self.inputs = (BATCH,)
        self.wide = list(wide)
        self.after_first = dict(after_first or {})
        # trial id -> what runs instead of its model (of its model after the first layer): the same
        # modules with exact faster kernels (2x2 max-pools: :func:`_with_fast_pools`), checked by
        # the planner to give the same values and gradients bit for bit
        self.fast = dict(fast or {})
        self.fast_after = dict(fast_after or {})
        self._by = {m.trial_id: m for m in self.members}
        self._copies: set[int] = set()   # trials that modify their input in place: own copies
        self._multi = _MultiStep()

    # -- per trial: the TrainerMember's ------------------------------------------------------
    def trial_ids(self) -> list[int]:
        return [t for m in self.members for t in m.trial_ids()]

    def limit(self, trial_id: int) -> int:
        return self._by[trial_id].limit(trial_id)

    def epoch(self, trial_id: int) -> int:
        return self._by[trial_id].epoch(trial_id)

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        return self._by[trial_id].weights(trial_id)

    def leave(self, trial_id: int) -> None:
        member = self._by.pop(trial_id, None)
        if member is None:
            return
        member.leave(trial_id)
        self.members.remove(member)
        self._multi.forget(member.trainer.optimizer)
        self.after_first.pop(trial_id, None)
        self.fast.pop(trial_id, None)
        self.fast_after.pop(trial_id, None)
        for group in list(self.wide):
            group.layers.pop(trial_id, None)
            if len(group.layers) < 2:  # a lone member runs its own first layer again
                for t in group.layers:
                    self.after_first.pop(t, None)
                self.wide.remove(group)

    def begin_epoch(self) -> None:
        for m in self.members:
            m.begin_epoch()

    def end_epoch(self) -> dict[int, dict[str, float] | BaseException]:
        out: dict[int, dict[str, float] | BaseException] = {}
        for m in self.members:
            out.update(m.end_epoch())
        return out

    def begin_validation(self) -> None:
        for m in self.members:
            m.begin_validation()

    def end_validation(self) -> dict[int, dict[str, float] | BaseException]:
        out: dict[int, dict[str, float] | BaseException] = {}
        for m in self.members:
            out.update(m.end_validation())
        return out

    # -- the joint step ----------------------------------------------------------------------
    def _model(self, m: TrainerMember, after_first: bool) -> nn.Module:
        """What runs for the member: its model (or its model after its first layer), with exact
        faster kernels where the planner found them."""
        t = m.trial_id
        if after_first:
            model = self.fast_after.get(t)
            return self.after_first[t] if model is None else model
        model = self.fast.get(t)
        return m.trainer.model if model is None else model

    def _first_layers(self, x: torch.Tensor, ids: set[int]) -> dict[int, torch.Tensor]:
        given: dict[int, torch.Tensor] = {}
        for group in self.wide:
            members = [t for t in group.layers if t in ids and t in self.after_first]
            if len(members) > 1:
                given.update(group(x, members))
        return given

    def _run(self, members: Sequence[TrainerMember], x: torch.Tensor,
             step: Callable[[TrainerMember, Any, bool], None]) -> None:
        """``step(member, input, after_first)`` for each member: the output of its first layer when
        that ran in a wide layer, else the batch. Every member reads the pristine batch: one found
        modifying it in place keeps its modified tensor, the next ones read a copy taken before,
        and that member gets its own copy from then on."""
        given = self._first_layers(x, {m.trial_id for m in members})
        direct = [m for m in members if m.trial_id not in given and m.trial_id in self.trusted]
        pristine = x.clone() if len(direct) > 1 else None
        current = x
        for m in members:
            if m.trial_id in given:
                step(m, given[m.trial_id], True)
                continue
            own = m.trial_id in self._copies or m.trial_id not in self.trusted
            inp = current.clone() if own else current
            version = inp._version
            step(m, inp, False)
            if not own and inp._version != version:
                self._copies.add(m.trial_id)
                if pristine is not None:
                    current = pristine.clone()

    def train_batch(self, x: Any, y: torch.Tensor, batch: int) -> None:
        active = [m for m in self.members if m._training and m._error is None and not m._left]
        if not active:
            return
        lrs: dict[int, float] = {}
        for m in active:
            t = m.trainer
            lrs[m.trial_id] = lr = t.config.lr_at(t.step)
            for group in t.optimizer.param_groups:
                group["lr"] = lr
            t.optimizer.zero_grad(set_to_none=True)
        roots: list[torch.Tensor] = []
        stepped: list[tuple[TrainerMember, float]] = []

        def forward(m: TrainerMember, inp: Any, after_first: bool) -> None:
            t = m.trainer
            model = self._model(m, after_first)
            try:
                with t._random_stream():
                    loss = t.config.loss(model(inp), y)
                value = float(loss.item())
                if not math.isfinite(value):
                    raise NonFiniteLoss.at(t.owner, value, epoch=t.epoch, batch=batch, step=t.step, lr=lrs[m.trial_id])
            except Exception as err:
                m._error = err
                return
            roots.append(loss)
            stepped.append((m, value))

        self._run(active, x, forward)
        if roots:
            try:
                torch.autograd.backward(roots)
            except Exception as err:  # one graph for all: the step fails for every member in it
                for m, _ in stepped:
                    m._error = err
                stepped = []
        if settings.foreach_step and len(stepped) > 1:
            self._multi.step([m.trainer.optimizer for m, _ in stepped])
        else:
            for m, _ in stepped:
                m.trainer.optimizer.step()
        for m, value in stepped:
            m.trainer.step += 1
            m._total += value * len(y)
            m._count += len(y)

    @torch.no_grad()
    def validate_batch(self, x: Any, y: torch.Tensor) -> None:
        active = [m for m in self.members if m._val is not None and m._error is None]
        if not active:
            return

        def forward(m: TrainerMember, inp: Any, after_first: bool) -> None:
            t = m.trainer
            model = self._model(m, after_first)
            try:
                with t._random_stream():
                    assert m._val is not None
                    m._val.add(model(inp), y)
            except Exception as err:
                m._error = err

        self._run(active, x, forward)


# ------------------------------------------------------------------------------------------------
# a shared frozen prefix
# ------------------------------------------------------------------------------------------------
class SharedPrefix:
    """A frozen prefix computed once per batch for several members.

    ``module`` is an fx ``GraphModule`` over the prefix modules of a representative model; it maps
    the input batch to the tuple of tensors named ``outputs``. Its modules' training flags are those
    the representative's own ``train()``/``eval()`` set (``train_flags``/``eval_flags``, over
    ``module.modules()``), so a model that keeps its backbone in eval mode keeps it so. ``calls``
    counts forward passes.
    """

    def __init__(self, key: str, module: fx.GraphModule, outputs: tuple[str, ...], description: str,
                 train_flags: Sequence[bool], eval_flags: Sequence[bool]):
        self.key = key
        self.module = module
        self.outputs = outputs
        self.description = description
        self.train_flags = list(train_flags)
        self.eval_flags = list(eval_flags)
        self.calls = 0

    def _set(self, flags: Sequence[bool]) -> None:
        for m, flag in zip(self.module.modules(), flags):
            m.training = flag

    def train_mode(self) -> None:
        self._set(self.train_flags)

    def eval_mode(self) -> None:
        self._set(self.eval_flags)

    def copy(self) -> "SharedPrefix":
        """An independent copy (own modules and buffers), for a second unit."""
        return SharedPrefix(self.key, copy.deepcopy(self.module), self.outputs, self.description,
                            self.train_flags, self.eval_flags)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        out = self.module(x)
        return dict(zip(self.outputs, out))


# ------------------------------------------------------------------------------------------------
# the unit
# ------------------------------------------------------------------------------------------------
class SharedPipelineUnit(ExecutionUnit):
    """Trials reading ONE data pipeline: each batch is indexed and augmented once per unit and fed
    to every member, validation batches too; shared frozen prefixes run once per batch.

    ``members`` default to one :class:`TrainerMember` per job training its whole model; the
    planner (:func:`plan_cse`) passes members that train suffixes after ``prefixes``. Every job's
    config must share dataset, transforms, batch size, data seed and device (the planner checks).
    ``counts`` holds ``batches`` (training batches read), ``augment`` (augmentation calls) and
    ``val_batches``.
    """

    kind = "cse"

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, *,
                 members: Sequence[PipelineMember] | None = None, prefixes: Sequence[SharedPrefix] = (),
                 reason: str = "", memory: int | None = None):
        super().__init__(jobs, evaluator)
        self.reason = reason
        self.memory = memory
        self.errors: dict[int, BaseException] = {}
        self.prefixes = {p.key: p for p in prefixes}
        self.counts = {"batches": 0, "augment": 0, "val_batches": 0}
        self._order = {job.trial.id: i for i, job in enumerate(jobs)}
        if members is None:
            built: list[PipelineMember] = []
            for job in jobs:
                try:
                    trainer = evaluator.trainer(job.model, job.trial.sample, job.trial.seed)
                except Exception as err:  # reported as the trial's failure at its first epoch
                    self.errors[job.trial.id] = err
                    continue
                built.append(TrainerMember(job, trainer))
            members = built
        self.members: list[PipelineMember] = list(members)
        self._by_trial: dict[int, PipelineMember] = {t: m for m in self.members for t in m.trial_ids()}
        self.config: TrainConfig | None = None
        self._seed = jobs[0].trial.seed if jobs else 0
        if jobs and isinstance(evaluator, SupervisedEvaluator):
            try:  # the pipeline every member shares (the planner checked they agree)
                self.config = evaluator.config(jobs[0].trial.sample)
            except Exception:  # the trials' own trainers failed too: reported per trial
                self.config = None
        self._train: BatchSource | None = None
        self._val: BatchSource | None = None
        if self.config is not None:
            self._train = BatchSource(self.config.train, self.config.device)
            self._val = BatchSource(self.config.val, self.config.device)
        self._copies: set[int] = set()  # ids of members that modify their inputs in place

    # -- the ExecutionUnit protocol -------------------------------------------------------------
    def limit(self, trial_id: int) -> int:
        member = self._by_trial.get(trial_id)
        return 0 if member is None else member.limit(trial_id)

    def epoch(self, trial_id: int) -> int:
        member = self._by_trial.get(trial_id)
        return 0 if member is None else member.epoch(trial_id)

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        member = self._by_trial.get(trial_id)
        if member is None:
            model = self.jobs[trial_id].model
            return None if model is None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return member.weights(trial_id)

    def _leave(self, trial_id: int) -> None:
        self.errors.pop(trial_id, None)
        member = self._by_trial.pop(trial_id, None)
        if member is None:
            return
        member.leave(trial_id)
        if not member.trial_ids():
            self.members.remove(member)
            self._copies.discard(id(member))
            used = {key for m in self.members for key in m.inputs}
            for key in [k for k, p in self.prefixes.items() if not used & set(p.outputs)]:
                del self.prefixes[key]  # nobody reads it any more: stop computing it

    def describe(self) -> str:
        ids = ", ".join(str(i) for i in self.jobs)
        text = f"{self.kind} unit of {len(self.jobs)} trial(s) [{ids}]"
        return text + (f": {self.reason}" if self.reason else "")

    # -- training ---------------------------------------------------------------------------------
    def _shared(self, x: torch.Tensor, prefixes: Iterable[SharedPrefix]) -> dict[str, Any]:
        env: dict[str, Any] = {BATCH: x}
        for prefix in prefixes:
            env.update(prefix(x))
        return env

    def _feed(self, members: Sequence[PipelineMember], env: dict[str, Any], y: torch.Tensor,
              call: Callable[[PipelineMember, Any, torch.Tensor], None], seconds: dict[int, float]) -> None:
        """Give each member its inputs; a member that modifies a shared tensor in place is found by
        the tensor's version counter, the tensor is restored and that member gets copies from then on."""
        readers: dict[str, int] = {}
        for m in members:
            for key in set(m.inputs):
                readers[key] = readers.get(key, 0) + 1
        watched = {k: v for k, v in env.items() if readers.get(k, 0) > 1 and isinstance(v, torch.Tensor)}
        if len(members) > 1:
            watched["__y__"] = y
        pristine = {k: v.clone() for k, v in watched.items()}
        for m in members:
            copies = id(m) in self._copies
            args = [env[k].clone() if copies else env[k] for k in m.inputs]
            x = args[0] if len(args) == 1 else tuple(args)
            versions = {k: v._version for k, v in watched.items()}
            t0 = time.monotonic()
            call(m, x, y.clone() if copies else y)
            seconds[id(m)] = seconds.get(id(m), 0.0) + time.monotonic() - t0
            changed = [k for k, v in watched.items() if v._version != versions[k]]
            if changed and not copies:
                self._copies.add(id(m))
                with torch.no_grad():
                    for k in changed:
                        watched[k].copy_(pristine[k])

    def train_epoch(self) -> dict[int, UnitResult]:
        results: dict[int, UnitResult] = {}
        for trial_id in list(self.errors):
            if trial_id in self.jobs:
                results[trial_id] = self.errors.pop(trial_id)
        members = [m for m in self.members if m.wants_epoch()]
        if not members or self.config is None:
            return results
        cfg = self.config
        assert self._train is not None and self._val is not None
        epochs = {m.epoch(t) for m in members for t in m.trial_ids() if m.epoch(t) < m.limit(t)}
        if len(epochs) != 1:
            raise RuntimeError(f"the members of a shared pipeline must be at the same epoch; got {sorted(epochs)}")
        epoch = epochs.pop()
        needed = {key for m in members for key in m.inputs}
        prefixes = [p for p in self.prefixes.values() if needed & set(p.outputs)]
        seconds: dict[int, float] = {}
        shared = 0.0
        for prefix in prefixes:
            prefix.train_mode()
        for m in members:
            m.begin_epoch()
        t_shared = time.monotonic()
        for batch, (x, y) in enumerate(self._train.epoch_batches(cfg, self._seed, epoch)):
            x = cfg.augment(x, self._seed, epoch, batch)
            self.counts["batches"] += 1
            if cfg.transforms is not None:
                self.counts["augment"] += 1
            env = self._shared(x, prefixes)
            shared += time.monotonic() - t_shared
            self._feed(members, env, y, lambda m, xb, yb: m.train_batch(xb, yb, batch), seconds)
            t_shared = time.monotonic()
        trained: dict[int, dict[str, float] | BaseException] = {}
        for m in members:
            trained.update(m.end_epoch())
        # validation: each batch read once (and each prefix run once) for every member
        for prefix in prefixes:
            prefix.eval_mode()
        for m in members:
            m.begin_validation()
        t_shared = time.monotonic()
        try:
            for x, y in self._val.validation_batches(cfg, self._seed):
                self.counts["val_batches"] += 1
                env = self._shared(x, prefixes)
                shared += time.monotonic() - t_shared
                self._feed(members, env, y, lambda m, xb, yb: m.validate_batch(xb, yb), seconds)
                t_shared = time.monotonic()
        finally:
            for prefix in prefixes:
                prefix.train_mode()
        validated: dict[int, dict[str, float] | BaseException] = {}
        for m in members:
            validated.update(m.end_validation())
        # results in the jobs' order, as the separate unit reports them
        metric = self.objective.metric
        for trial_id in sorted(trained, key=lambda t: self._order.get(t, 0)):
            train = trained[trial_id]
            val = validated.get(trial_id)
            if isinstance(train, BaseException):
                results[trial_id] = train
            elif isinstance(val, BaseException):
                results[trial_id] = val
            else:
                metrics = {**(val or {}), **train}
                if metric in metrics:
                    results[trial_id] = {metric: metrics[metric], **metrics}
                else:
                    results[trial_id] = KeyError(metric)
        # each trial's time: its own steps plus an equal share of the shared work
        share = (shared / len(trained)) if trained else 0.0
        for m in members:
            ids = [t for t in m.trial_ids() if t in trained]
            for trial_id in ids:
                info = self.jobs[trial_id].trial.info
                own = seconds.get(id(m), 0.0) / max(len(ids), 1)
                info["train_seconds"] = info.get("train_seconds", 0.0) + own + share
        return results


# ------------------------------------------------------------------------------------------------
# planning: pipelines
# ------------------------------------------------------------------------------------------------
def _dataset_key(ds: Any) -> Any:
    spec = getattr(ds, "spec", None)
    return ("spec", spec) if isinstance(spec, str) else ("id", id(ds))


_KEY_PARTS = ("training data", "validation data", "batch size", "transforms", "data seed", "device")


def _pipeline_key(cfg: TrainConfig, seed: int) -> tuple[Any, ...]:
    return (_dataset_key(cfg.train), _dataset_key(cfg.val), cfg.batch_size,
            None if cfg.transforms is None else id(cfg.transforms), cfg.data_seed_of(seed), str(cfg.device))


def _difference(key: tuple[Any, ...], other: tuple[Any, ...]) -> str:
    for name, a, b in zip(_KEY_PARTS, key, other):
        if a != b:
            if name in ("batch size", "data seed", "device"):
                return f"different {name} ({a}, not {b})"
            return f"different {name}"
    return "alone"  # pragma: no cover - equal keys are grouped


# ------------------------------------------------------------------------------------------------
# planning: frozen prefixes
# ------------------------------------------------------------------------------------------------
_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout, nn.RReLU)
_RANDOM_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                     F.feature_alpha_dropout, F.rrelu, torch.dropout, torch.rand, torch.randn,
                     torch.randint, torch.rand_like, torch.randn_like, torch.randint_like, torch.randperm,
                     torch.bernoulli, torch.normal, torch.multinomial, torch.poisson}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                   "geometric_", "cauchy_", "log_normal_", "multinomial"}


class _Hasher:
    """Hashes of weights and buffers, memoized for one planning call (while every model is alive,
    a storage address names one tensor)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[Any, ...], str] = {}

    def tensor(self, t: torch.Tensor) -> str:
        t = t.detach()
        key = (t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))
        digest = self.cache.get(key)
        if digest is None:
            h = hashlib.blake2b(f"{tuple(t.shape)}{t.dtype}".encode(), digest_size=16)
            if t.numel():
                h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            digest = self.cache[key] = h.hexdigest()
        return digest

    def state(self, obj: Any) -> str:
        """Weights, buffers and training flags of a node's module (or attribute)."""
        if isinstance(obj, nn.Module):
            parts = [f"{k}={self.tensor(v)}" for k, v in obj.state_dict(keep_vars=True).items()
                     if isinstance(v, torch.Tensor)]
            parts.append("".join("T" if m.training else "E" for m in obj.modules()))
            return ";".join(parts)
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        return repr(type(obj))


def _frozen(obj: Any) -> bool:
    if isinstance(obj, nn.Module):
        return all(not p.requires_grad for p in obj.parameters())
    if isinstance(obj, torch.Tensor):
        return not obj.requires_grad
    return True


def _random(n: fx.Node, module: nn.Module | None) -> bool:
    if n.op == "call_module" and module is not None:
        return any(isinstance(m, _RANDOM_MODULES) and m.training for m in module.modules())
    if n.op == "call_function":
        return n.target in _RANDOM_FUNCTIONS
    if n.op == "call_method":
        return n.target in _RANDOM_METHODS
    return False


def _bytes(shape: Any, dtype: Any) -> int:
    if isinstance(shape, torch.Size):
        size = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
        return math.prod(shape) * size
    if isinstance(shape, tuple):
        dtypes = dtype if isinstance(dtype, tuple) else (None,) * len(shape)
        return sum(_bytes(s, d) for s, d in zip(shape, dtypes))
    return 0


@dataclass
class _Analysis:
    """One job's model seen through the graph IR."""

    job: Job
    cfg: TrainConfig
    example: torch.Tensor
    graph: Graph | None = None
    eligible: dict[str, fx.Node] = field(default_factory=dict)   # value fingerprint -> first node
    key_of: dict[fx.Node, str] = field(default_factory=dict)     # eligible node -> value fingerprint
    cost: dict[str, float] = field(default_factory=dict)         # value fingerprint -> FLOPs
    total: float = 0.0                                           # the model's FLOPs
    activations: dict[fx.Node, int] = field(default_factory=dict)  # output bytes at the batch size
    why_not: str = ""


def _example_batch(cfg: TrainConfig) -> torch.Tensor:
    """The first few training examples (the planner traces and checks models on real data)."""
    tensors = getattr(cfg.train, "tensors", None)
    n = min(_EXAMPLES, len(cfg.train))
    if isinstance(tensors, (tuple, list)) and tensors and isinstance(tensors[0], torch.Tensor):
        x = tensors[0][:n]
    else:  # any map-style dataset of (input, target) pairs
        x = torch.stack([torch.as_tensor(cfg.train[i][0]) for i in range(n)])
    return x.detach().cpu().clone()  # a copy: a model may modify its input in place


def _analyse(job: Job, cfg: TrainConfig, example: torch.Tensor, hasher: _Hasher) -> _Analysis:
    a = _Analysis(job, cfg, example)
    model = job.model
    assert model is not None
    scale = cfg.batch_size / max(len(example), 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engine reported opaque modules when it traced the trial
        graph = trace(model, (example.clone(),))
    a.graph = graph
    try:
        a.total = float(graph.flops())
    except Exception:
        try:  # an op the FLOP pass does not know: shapes alone
            graph.propagate_shapes()
        except Exception as err:
            a.why_not = f"its shapes could not be computed ({type(err).__name__})"
            return a
    nodes = list(graph.fx_graph.nodes)
    for n in nodes:
        if n.op in ("call_module", "call_function", "call_method"):
            a.activations[n] = int(_bytes(n.meta.get(meta.SHAPE), n.meta.get(meta.DTYPE)) * scale)
    if sum(1 for n in nodes if n.op == "placeholder") != 1:
        a.why_not = "the model takes several inputs"
    elif not any(not p.requires_grad for p in model.parameters()):
        a.why_not = "no frozen parameters"
    else:
        _eligible_nodes(a, nodes, hasher)
    return a


def _eligible_nodes(a: _Analysis, nodes: list[fx.Node], hasher: _Hasher) -> None:
    """Value fingerprints of the nodes that may belong to a shared prefix: frozen, deterministic,
    fed only by such nodes. A value fingerprint hashes the node's prefix fingerprint (structure),
    its module's weights, buffers and training flags, and its inputs' value fingerprints."""
    graph, model = a.graph, a.job.model
    assert graph is not None and model is not None
    flags = [m.training for m in model.modules()]
    model.train()  # the flags separate training runs with (a model may keep its backbone in eval)
    try:
        for n in nodes:
            if n.op == "output":
                continue
            if n.op == "placeholder":
                key = "input"
            else:
                if any(src not in a.key_of for src in n.all_input_nodes):
                    continue
                state = ""
                if n.op in ("call_module", "get_attr"):
                    obj = graph._get(str(n.target))
                    if not _frozen(obj) or (n.op == "call_module" and _random(n, obj)):
                        continue
                    state = hasher.state(obj)
                elif _random(n, None):
                    continue
                fp = graph[n.name].prefix_fingerprint()
                text = fp + "|" + state + "|" + ",".join(a.key_of[s] for s in n.all_input_nodes)
                key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
            a.key_of[n] = key
            a.eligible.setdefault(key, n)
            a.cost[key] = float(n.meta.get(meta.FLOPS, 0) or 0)
    finally:
        for m, flag in zip(model.modules(), flags):
            m.training = flag


def _cost(keys: Iterable[str], a: _Analysis) -> float:
    return sum(a.cost.get(k, 0.0) for k in keys)


@dataclass
class _Split:
    """One member's split at a shared prefix."""

    suffix: nn.Module
    inputs: tuple[str, ...]
    buffers: dict[str, str] = field(default_factory=dict)  # member state_dict key -> prefix module's key


def _build_prefix(rep: _Analysis, keys: set[str], outputs: list[str]) -> fx.GraphModule:
    """The prefix (``keys``) of the representative's graph as a module returning ``outputs``."""
    graph = rep.graph
    assert graph is not None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.fx_graph.nodes:
        key = rep.key_of.get(n)
        if key is not None and (key in keys or key == "input") and rep.eligible[key] is n:
            env[n] = g.node_copy(n, lambda s: env[rep.eligible[rep.key_of[s]]])
    g.output(tuple(env[rep.eligible[k]] for k in outputs))
    return fx.GraphModule(graph.root, g, class_name="SharedPrefix")


class _Suffix(nn.Module):
    """The suffix of a model that reads several shared tensors (the trainer passes them as a tuple)."""

    def __init__(self, module: fx.GraphModule):
        super().__init__()
        self.module = module

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        return self.module(*inputs)


def _split(a: _Analysis, keys: set[str]) -> _Split | str:
    """The member's suffix after the prefix made of ``keys``, or why it cannot be split."""
    graph = a.graph
    assert graph is not None
    nodes = list(graph.fx_graph.nodes)
    in_prefix = {n for n in nodes if a.key_of.get(n) is not None and (a.key_of[n] in keys or n.op == "placeholder")}
    frontier: list[fx.Node] = []
    for n in nodes:
        if n not in in_prefix:
            frontier += [src for src in n.all_input_nodes if src in in_prefix and src not in frontier]
    prefix_targets = {str(n.target) for n in in_prefix if n.op in ("call_module", "get_attr")}
    for n in nodes:
        if n not in in_prefix and n.op in ("call_module", "get_attr"):
            t = str(n.target)
            if any(t == p or t.startswith(p + ".") or p.startswith(t + ".") for p in prefix_targets):
                return "a frozen module is used both in the prefix and after it"
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: g.placeholder(f"shared_{i}") for i, n in enumerate(frontier)}
    for n in nodes:
        if n not in in_prefix:
            env[n] = g.node_copy(n, lambda s: env[s])
    gm = fx.GraphModule(graph.root, g, class_name="Suffix")
    if not any(p.requires_grad for p in gm.parameters()):
        return "nothing trainable after the frozen prefix"
    inputs = tuple(BATCH if n.op == "placeholder" else a.key_of[n] for n in frontier)
    return _Split(gm if len(frontier) == 1 else _Suffix(gm), inputs)


def _buffer_map(member: _Analysis, rep: _Analysis, keys: set[str]) -> dict[str, str]:
    """The member's state_dict keys of its prefix buffers -> the prefix module's keys (the
    representative's target paths, which ``fx.GraphModule`` keeps)."""
    out: dict[str, str] = {}
    assert member.graph is not None
    for n, key in member.key_of.items():
        if key not in keys or n.op not in ("call_module", "get_attr"):
            continue
        r = rep.eligible[key]
        obj = member.graph._get(str(n.target))
        if isinstance(obj, nn.Module):
            for name, _ in obj.named_buffers():
                out[f"{n.target}.{name}"] = f"{r.target}.{name}"
        elif isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter):
            out[str(n.target)] = str(r.target)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b)


def _verify(member: _Analysis, rep: _Analysis, prefix: fx.GraphModule, outputs: list[str], split: _Split) -> str:
    """Check ``suffix(prefix(x)) == model(x)`` on real data in training and in evaluation mode, the
    prefix drawing no random numbers; buffers and flags are restored. '' when it holds."""
    model, rep_model = member.job.model, rep.job.model
    assert model is not None and rep_model is not None
    x = member.example
    saved = [(b, b.detach().clone()) for m in (model, rep_model) for b in m.buffers()]
    flags = [(m, m.training) for mm in (model, rep_model) for m in mm.modules()]
    try:
        with torch.no_grad():
            for mode in (True, False):
                model.train(mode)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    expected = model(x.clone())
                rep_model.train(mode)
                model.train(mode)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    state = torch.get_rng_state()
                    values = dict(zip(outputs, prefix(x.clone())))
                    if not torch.equal(state, torch.get_rng_state()):
                        return "the frozen prefix draws random numbers"
                    args = [x.clone() if k == BATCH else values[k] for k in split.inputs]
                    got = split.suffix(args[0] if len(args) == 1 else tuple(args))
                if not _same(expected, got):
                    return "the split model does not reproduce the model"
    except Exception as err:
        return f"the split model failed ({type(err).__name__})"
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
        for m, flag in flags:
            m.training = flag
    return ""


def _mode_flags(model: nn.Module, module: nn.Module) -> tuple[list[bool], list[bool]]:
    """The training flags of ``module.modules()`` after ``model.train()`` and after ``model.eval()``."""
    saved = [(m, m.training) for m in model.modules()]
    try:
        model.train()
        train = [m.training for m in module.modules()]
        model.eval()
        evaluation = [m.training for m in module.modules()]
    finally:
        for m, flag in saved:
            m.training = flag
    return train, evaluation


@dataclass
class _PrefixPlan:
    prefix: SharedPrefix
    keys: set[str]
    rep: _Analysis
    members: dict[int, _Split]        # trial id -> its split


def _find_prefixes(analyses: list[_Analysis], notes: dict[int, str]) -> list[_PrefixPlan]:
    """Cluster the members whose frozen prefixes overlap (greedily, keeping at least half of a
    cluster's prefix FLOPs), split them, keep the splits that reproduce their models."""
    clusters: list[tuple[set[str], list[_Analysis]]] = []
    for a in analyses:
        if not a.eligible or a.why_not:
            continue
        own = set(a.eligible) - {"input"}
        best, best_cost = None, 0.0
        for i, (keys, _members) in enumerate(clusters):
            cost = _cost(keys & own, a)
            if cost > best_cost and cost >= 0.5 * _cost(keys, a):
                best, best_cost = i, cost
        if best is None:
            clusters.append((own, [a]))
        else:
            keys, members = clusters[best]
            clusters[best] = (keys & own, members + [a])
    plans: list[_PrefixPlan] = []
    for keys, members in clusters:
        if len(members) < 2:
            notes.setdefault(members[0].job.trial.id, "no other trial shares its frozen prefix")
            continue
        mean_total = sum(m.total for m in members) / len(members)
        cost = _cost(keys, members[0])
        if cost <= 0 or cost < MIN_PREFIX_SHARE * mean_total:
            for m in members:
                notes.setdefault(m.job.trial.id, f"shared frozen prefix too small ({cost / max(mean_total, 1):.0%} of FLOPs)")
            continue
        rep = members[0]
        splits: dict[int, _Split] = {}
        for m in members:
            split = _split(m, keys)
            if isinstance(split, str):
                notes[m.job.trial.id] = split
            else:
                splits[m.job.trial.id] = split
        outputs = list(dict.fromkeys(k for s in splits.values() for k in s.inputs if k != BATCH))
        if len(splits) < 2 or not outputs:
            continue
        module = _build_prefix(rep, keys, outputs)
        by_id = {m.job.trial.id: m for m in members}
        verified: dict[int, _Split] = {}
        for trial_id, split in splits.items():
            why = _verify(by_id[trial_id], rep, module, outputs, split)
            if why:
                notes[trial_id] = why
            else:
                split.buffers = _buffer_map(by_id[trial_id], rep, keys)
                verified[trial_id] = split
        if len(verified) < 2:
            for trial_id in verified:
                notes.setdefault(trial_id, "no other trial shares its frozen prefix")
            continue
        n_nodes = sum(1 for n, k in rep.key_of.items() if k in keys)
        description = f"frozen prefix of {n_nodes} nodes ({cost / max(mean_total, 1):.0%} of FLOPs)"
        key = "prefix:" + hashlib.blake2b(",".join(sorted(keys)).encode(), digest_size=6).hexdigest()
        assert rep.job.model is not None
        train_flags, eval_flags = _mode_flags(rep.job.model, module)
        prefix = SharedPrefix(key, module, tuple(outputs), description, train_flags, eval_flags)
        plans.append(_PrefixPlan(prefix, keys, rep, verified))
    return plans


# ------------------------------------------------------------------------------------------------
# planning: joint steps and wide first layers
# ------------------------------------------------------------------------------------------------
@dataclass
class _First:
    """A member's first layer: the module that alone reads the (possibly flattened) batch."""

    key: tuple[Any, ...]          # members with equal keys may share one wide op
    kind: str                     # "linear" | "conv2d"
    flatten: bool
    layer: nn.Module
    graph: Graph                  # the member's graph IR
    skip: tuple[fx.Node, ...]     # its nodes up to the layer (input, flatten, layer)
    _after: fx.GraphModule | None = None

    @property
    def after(self) -> fx.GraphModule:
        """The model after the layer: its output -> the model's output (built when first asked:
        only for the groups whose wide op is kept)."""
        if self._after is None:
            g = fx.Graph()
            env: dict[fx.Node, fx.Node] = {self.skip[-1]: g.placeholder("first_layer")}
            for m in self.graph.fx_graph.nodes:
                if m not in self.skip:
                    env[m] = g.node_copy(m, lambda s: env[s])
            self._after = fx.GraphModule(self.graph.root, g, class_name="AfterFirstLayer")
        return self._after


def _is_flatten(n: fx.Node, graph: Graph, src: fx.Node) -> bool:
    """``nn.Flatten()``, ``torch.flatten(x, 1)`` or ``x.flatten(1)`` of ``src`` (from dim 1 on)."""
    if not n.args or n.args[0] is not src:
        return False
    if n.op == "call_module":
        m = graph._get(str(n.target))
        return type(m) is nn.Flatten and m.start_dim == 1 and m.end_dim == -1 and len(n.args) == 1 and not n.kwargs
    if (n.op == "call_function" and n.target is torch.flatten) or (n.op == "call_method" and n.target == "flatten"):
        dims = {"start_dim": 0, "end_dim": -1}
        for name, value in zip(("start_dim", "end_dim"), n.args[1:]):
            dims[name] = value
        dims.update(n.kwargs)
        return set(dims) == {"start_dim", "end_dim"} and dims["start_dim"] == 1 and dims["end_dim"] == -1
    return False


def _first_layer(a: _Analysis) -> _First | None:
    """The member's first layer if it can run in a wide op: a plain ``nn.Linear`` or ``nn.Conv2d``
    (groups 1, zero padding, no bias, as before BatchNorm) with no hooks, trainable, its weight used
    nowhere else, that is the only reader of the batch (through at most one flatten), called once."""
    graph, model = a.graph, a.job.model
    if graph is None or model is None:
        return None
    nodes = list(graph.fx_graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        return None
    src, flatten = placeholders[0], False
    while True:
        users = list(src.users)
        if len(users) != 1:
            return None
        n = users[0]
        if not flatten and _is_flatten(n, graph, src):
            src, flatten = n, True
            continue
        break
    if n.op != "call_module" or n.args != (src,) or n.kwargs:
        return None
    layer = graph._get(str(n.target))
    if type(layer) not in (nn.Linear, nn.Conv2d) or layer._forward_hooks or layer._forward_pre_hooks:
        return None
    if sum(1 for m in nodes if m.op == "call_module" and m.target == n.target) != 1:
        return None
    weight, bias = layer.weight, layer.bias
    if not weight.requires_grad or (bias is not None and not bias.requires_grad):
        return None
    if sum(1 for _, p in model.named_parameters(remove_duplicate=False) if p is weight or p is bias) != 1 + (bias is not None):
        return None  # a weight tied to another module
    common = (bias is not None, weight.dtype, str(weight.device), flatten)
    if isinstance(layer, nn.Linear):
        key: tuple[Any, ...] = ("linear", layer.in_features, *common)
    else:
        # a convolution's bias gradient is reduced inside oneDNN's backward, which rounds
        # differently over the wide op's output than over one member's; before BatchNorm that
        # gradient is rounding noise only, which Adam scales to lr-sized steps (val_acc moved by
        # one example in two epochs here): such layers keep their own op
        if layer.groups != 1 or layer.padding_mode != "zeros" or bias is not None:
            return None
        key = ("conv2d", layer.in_channels, tuple(layer.kernel_size), tuple(layer.stride),
               layer.padding if isinstance(layer.padding, str) else tuple(layer.padding), tuple(layer.dilation), *common)
    return _First(key, key[0], flatten, layer, graph, tuple(dict.fromkeys((placeholders[0], src, n))))


def _check_member(a: _Analysis, first: _First | None,
                  runs: Sequence[Callable[[torch.Tensor], Any]] = ()) -> tuple[str, _First | None, list[bool]]:
    """Run the member's model on the example batch in training and in evaluation mode (its own
    random stream seeded alike, its buffers as they were before each run): ``why`` it cannot join
    a joint step ('' if it can: it does not modify its input in place), ``first`` if
    ``after(layer(batch))`` reproduces the model, and for each of ``runs`` (rewrites of the model
    with exact kernels) whether it gives exactly the model's output. Buffers, flags and the global
    random state are restored."""
    model = a.job.model
    assert model is not None
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    flags = [(m, m.training) for m in model.modules()]
    exact = [True] * len(runs)

    def seeded(f: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Any:
        for b, value in saved:
            b.copy_(value)
        torch.default_generator.manual_seed(0)  # the CPU stream alone (torch.manual_seed costs ~0.1 ms)
        return f(x)

    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for mode in (True, False):
                model.train(mode)
                x = a.example.clone()
                version = x._version
                expected = seeded(model, x)
                if x._version != version:
                    return "it modifies its input in place", None, [False] * len(runs)
                if first is not None:
                    inp = a.example.clone()
                    got = seeded(first.after, first.layer(inp.flatten(1) if first.flatten else inp))
                    if not _same(expected, got):
                        first = None
                for i, run in enumerate(runs):
                    if exact[i]:
                        try:
                            got = seeded(run, a.example.clone())
                        except Exception:  # a rewrite that fails is not used
                            exact[i] = False
                            continue
                        exact[i] = (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)
                                    and expected.shape == got.shape and expected.dtype == got.dtype
                                    and torch.equal(expected, got))
    except Exception as err:
        return f"its forward failed ({type(err).__name__})", None, [False] * len(runs)
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
        for m, flag in flags:
            m.training = flag
    return "", first, exact


def _pool_2x2(x: torch.Tensor, relu: bool) -> torch.Tensor:
    """``F.max_pool2d(F.relu(x) if relu else x, 2)`` through the batching module's exact two-pass
    kernel (the fx target the rewrite below inserts)."""
    from ._batching import _MaxPool2x2

    return _MaxPool2x2.apply(x, relu)


def _ints(value: Any, n: int = 2) -> tuple[Any, ...] | None:
    if isinstance(value, int):
        return (value,) * n
    if isinstance(value, (tuple, list)) and len(value) == n:
        return tuple(value)
    return None


def _is_max_pool_2x2(gm: nn.Module, n: fx.Node) -> bool:
    """A 2x2, stride-2 max-pool without padding, dilation, ceil mode or indices, on ``n.args[0]``."""
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        if type(m) is not nn.MaxPool2d or m._forward_hooks or m._forward_pre_hooks or len(n.args) != 1 or n.kwargs:
            return False
        kernel, stride, padding, dilation = m.kernel_size, m.stride, m.padding, m.dilation
        ceil, indices = m.ceil_mode, m.return_indices
    elif n.op == "call_function" and n.target in (F.max_pool2d, torch.max_pool2d):
        names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
        given = dict(zip(names, n.args))
        if set(n.kwargs) - set(names) or set(n.kwargs) & set(given):
            return False
        given.update(n.kwargs)
        if "kernel_size" not in given:
            return False
        kernel, stride = given["kernel_size"], given.get("stride")
        padding, dilation = given.get("padding", 0), given.get("dilation", 1)
        ceil, indices = given.get("ceil_mode", False), given.get("return_indices", False)
    else:
        return False
    if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0):
        stride = kernel
    return (_ints(kernel) == (2, 2) and _ints(stride) == (2, 2) and _ints(padding) == (0, 0)
            and _ints(dilation) == (1, 1) and ceil is False and indices is False)


def _relu_of(gm: nn.Module, n: fx.Node) -> fx.Node | None:
    """The input of ``n`` if ``n`` is a plain ReLU (module, function or method), else None."""
    if not isinstance(n, fx.Node) or len(n.args) != 1 or not isinstance(n.args[0], fx.Node):
        return None
    inplace = False
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        if type(m) is not nn.ReLU or m._forward_hooks or m._forward_pre_hooks or n.kwargs:
            return None
        inplace = m.inplace
    elif n.op == "call_function" and n.target in (torch.relu, F.relu, torch.relu_):
        if set(n.kwargs) - {"inplace"}:
            return None
        inplace = n.target is torch.relu_ or bool(n.kwargs.get("inplace", False))
    elif n.op == "call_method" and n.target in ("relu", "relu_"):
        if n.kwargs:
            return None
        inplace = n.target == "relu_"
    else:
        return None
    src = n.args[0]
    # an in-place ReLU also changes its input for any other reader: taken over only when it has none
    return None if inplace and len(src.users) != 1 else src


def _fast_pool(root: nn.Module, n: fx.Node) -> bool:
    """Whether node ``n`` (of a graph over ``root``) is a 2x2 max-pool that :func:`_pool_2x2` can
    run: on a floating-point map of even height and width (the graph IR's shape metadata)."""
    if n.op not in ("call_module", "call_function") or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if not _is_max_pool_2x2(root, n):
        return False
    shape, dtype = n.args[0].meta.get(meta.SHAPE), n.args[0].meta.get(meta.DTYPE)
    return (isinstance(shape, torch.Size) and len(shape) == 4 and shape[2] % 2 == 0 and shape[3] % 2 == 0
            and isinstance(dtype, torch.dtype) and dtype.is_floating_point)


def _with_fast_pools(root: nn.Module, source: fx.Graph, class_name: str) -> fx.GraphModule | None:
    """A module over ``root``'s modules running ``source`` (a graph over ``root``) with its 2x2
    max-pools on maps of even height and width (from the graph IR's shape metadata) rewritten into
    :func:`_pool_2x2`, taking over a ReLU that alone feeds one; None if there is none. The caller
    checks the result against the model on real data (:func:`_check_member`)."""
    if not any(_fast_pool(root, n) for n in source.nodes):
        return None
    g = fx.Graph()
    g.output(g.graph_copy(source, {}))
    for n in list(g.nodes):
        if not _fast_pool(root, n):
            continue
        src = n.args[0]
        inp = _relu_of(root, src) if len(src.users) == 1 else None
        with g.inserting_before(n):
            fast = g.call_function(_pool_2x2, (src if inp is None else inp, inp is not None))
        fast.meta = dict(n.meta)
        n.replace_all_uses_with(fast)
        g.erase_node(n)
        if inp is not None:
            g.erase_node(src)
    g.lint()
    return fx.GraphModule(root, g, class_name=class_name)


def _fast_model(a: _Analysis) -> nn.Module | None:
    """The member's model with its 2x2 max-pools rewritten for the exact two-pass kernel, where it
    has one (to be checked on real data by :func:`_check_member`); None where not."""
    graph, model = a.graph, a.job.model
    if graph is None or model is None or a.example.dim() != 4:
        return None
    try:
        return _with_fast_pools(graph.root, graph.fx_graph, "FastPools")
    except Exception:  # an optimization: a graph it cannot rewrite runs as it is
        return None


def _fast_after(a: _Analysis, first: _First) -> nn.Module | None:
    """The member's model after its (wide) first layer with the two-pass max-pools, where that
    reproduces the model exactly on real data."""
    try:
        gm = _with_fast_pools(first.after, first.after.graph, "FastPoolsAfterFirstLayer")
    except Exception:
        return None
    if gm is None:
        return None
    layer = first.layer
    _, _, [exact] = _check_member(a, None, [lambda x: gm(layer(x.flatten(1) if first.flatten else x))])
    return gm if exact else None


# (layer key, widths, batch shape, threads, device type) -> measured speed-up of the wide op
_WIDE_SPEEDUP: dict[tuple[Any, ...], float] = {}


def _wide_speedup(firsts: Sequence[_First], x: torch.Tensor) -> float:
    """The wide op's speed-up over the members' own layers, forward and backward on the real batch
    (copies of the layers, the same upstream gradients), interleaved, CPU time on a CPU; cached."""
    f0 = firsts[0]
    widths = tuple(int(f.layer.weight.shape[0]) for f in firsts)
    cache_key = (f0.key, widths, tuple(x.shape), torch.get_num_threads(), x.device.type)
    if cache_key in _WIDE_SPEEDUP:
        return _WIDE_SPEEDUP[cache_key]
    layers = {i: copy.deepcopy(f.layer) for i, f in enumerate(firsts)}
    wide = _WideLayer(f0.kind, f0.flatten, layers)
    inp = x.flatten(1) if f0.flatten else x
    with torch.no_grad():
        grads = {i: torch.ones_like(m(inp)) for i, m in layers.items()}
    ids = list(layers)

    def fused() -> None:
        outs = wide(x, ids)
        torch.autograd.backward([outs[i] for i in ids], [grads[i] for i in ids])

    def own() -> None:
        for i in ids:
            layers[i](inp).backward(grads[i])

    clock = time.process_time if x.device.type == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {"fused": [], "own": []}
    for round_ in range(settings.measure_rounds + 1):
        for name, run in (("fused", fused), ("own", own)) if round_ % 2 else (("own", own), ("fused", fused)):
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            t0 = clock()
            run()
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            if round_:  # the first round warms up both
                times[name].append(clock() - t0)
    ratio = statistics.median(times["own"]) / max(statistics.median(times["fused"]), 1e-9)
    _WIDE_SPEEDUP[cache_key] = ratio
    return ratio


def _joint_member(members: list[PipelineMember], chunk: list[tuple[_Analysis, int, int]], estimate: int,
                  limit: int, cfg0: TrainConfig) -> tuple[list[PipelineMember], str, int]:
    """Replace the unit's whole-model trainer members by one :class:`JointMember` (with wide first
    layers where they pay), if the memory bound allows; returns the members, the log text and the
    unit's memory estimate."""
    if not settings.joint:
        return members, "", estimate
    by_id = {a.job.trial.id: (a, t) for a, _, t in chunk}
    whole = [m for m in members if type(m) is TrainerMember and m.inputs == (BATCH,) and not m.prefix_buffers
             and m.trainer.model is m.job.model and m.trial_id in by_id]
    if len(whole) < 2:
        return members, "", estimate
    joint: list[TrainerMember] = []
    firsts: dict[int, _First] = {}
    apart: dict[str, list[int]] = {}
    fast: dict[int, nn.Module] = {}
    fast_after: dict[int, nn.Module] = {}
    for m in whole:
        a = by_id[m.trial_id][0]
        model = _fast_model(a) if settings.fast_pools else None
        why, _, exact = _check_member(a, None, [] if model is None else [model])
        if why:
            apart.setdefault(why, []).append(m.trial_id)
            continue
        joint.append(m)
        first = _first_layer(a) if settings.wide != "off" else None
        if first is not None:
            firsts[m.trial_id] = first
        if model is not None and exact[0]:
            fast[m.trial_id] = model
    if len(joint) < 2:
        return members, "", estimate
    # memory: the joint step holds every joint member's activations at once
    transients = {a.job.trial.id: t for a, _, t in chunk}
    ids = {m.trial_id for m in joint}
    rest = [t for i, t in transients.items() if i not in ids]
    need = estimate - max(transients.values(), default=0) + sum(transients[i] for i in ids) + max(rest, default=0)
    if need > limit:
        return members, (f"members step one at a time (a joint step would need {_mib(need)}, "
                         f"over max_unit_memory {_mib(limit)})"), estimate
    # wide first layers: members with the same first-layer key, where the one op pays
    groups: dict[tuple[Any, ...], list[int]] = {}
    for trial_id, first in firsts.items():
        groups.setdefault(first.key, []).append(trial_id)
    wide: list[_WideLayer] = []
    after_first: dict[int, nn.Module] = {}
    notes: list[str] = []
    x = by_id[joint[0].trial_id][0].example
    for key, trial_ids in groups.items():
        if len(trial_ids) < 2:
            continue
        batch = x[:1].expand(cfg0.batch_size, *x.shape[1:]).contiguous().to(cfg0.device)
        if settings.wide == "auto":  # measured first (cached): the models are split only if it pays
            speedup = _wide_speedup([firsts[t] for t in trial_ids], batch)
            if speedup < settings.wide_min_speedup:
                group = _WideLayer(key[0], firsts[trial_ids[0]].flatten, {t: firsts[t].layer for t in trial_ids})
                notes.append(f"first layers of trials [{', '.join(map(str, trial_ids))}] kept apart "
                             f"({group.describe()} as one op measured {speedup:.2f}x)")
                continue
        # each member's model after its first layer, checked on real data to reproduce the model
        kept = [t for t in trial_ids if _check_member(by_id[t][0], firsts[t])[1] is not None]
        if len(kept) < 2:
            continue
        group = _WideLayer(key[0], firsts[kept[0]].flatten, {t: firsts[t].layer for t in kept})
        ids_text = ", ".join(str(t) for t in kept)
        if settings.wide == "auto":
            if kept != trial_ids:
                speedup = _wide_speedup([firsts[t] for t in kept], batch)
                if speedup < settings.wide_min_speedup:
                    notes.append(f"first layers of trials [{ids_text}] kept apart ({group.describe()} as one op "
                                 f"measured {speedup:.2f}x)")
                    continue
            notes.append(f"trials [{ids_text}] share their first layer as one {group.describe()} "
                         f"(measured {speedup:.2f}x)")
        else:
            notes.append(f"trials [{ids_text}] share their first layer as one {group.describe()}")
        wide.append(group)
        after_first.update({t: firsts[t].after for t in kept})
        if settings.fast_pools:
            for t in kept:
                after = _fast_after(by_id[t][0], firsts[t]) if t in fast else None
                if after is not None:
                    fast_after[t] = after
    member = JointMember(joint, wide=wide, after_first=after_first, trusted=ids, fast=fast,
                         fast_after=fast_after)
    if fast:
        notes.append(f"2x2 max-pools of trials [{', '.join(str(t) for t in fast)}] run by an exact "
                     f"two-pass kernel")
    out: list[PipelineMember] = []
    for m in members:
        if m in joint:
            if member not in out:
                out.append(member)
        else:
            out.append(m)
    text = f"joint step (one backward) for trials [{', '.join(str(m.trial_id) for m in joint)}]"
    if apart:
        text += "; alone: " + "; ".join(f"trials [{', '.join(map(str, t))}] ({why})" for why, t in apart.items())
    if notes:
        text += "; " + "; ".join(notes)
    return out, text, need


# ------------------------------------------------------------------------------------------------
# planning: memory
# ------------------------------------------------------------------------------------------------
def _optimizer_states(cfg: TrainConfig) -> int:
    """Tensors of optimizer state per trainable parameter."""
    if cfg.optimizer == "sgd":
        return 0 if cfg.momentum == 0 else 1
    if cfg.optimizer == "rmsprop":
        return 2 if cfg.momentum else 1
    return 2  # adam, adamw: first and second moments


def _resident(model: nn.Module, cfg: TrainConfig) -> int:
    """Bytes a member holds between steps: parameters, buffers, gradients and optimizer state."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return params + buffers + trainable * (1 + _optimizer_states(cfg))


def unit_memory(parts: Sequence[tuple[int, int]], shared: int = 0) -> int:
    """A unit's estimated bytes from its members' ``(resident, transient)`` bytes: every member's
    resident bytes (parameters, buffers, gradients, optimizer state) plus the largest transient
    (activations kept for backward at the batch size: members step one at a time) plus ``shared``
    (the shared batches, with the copy that guards them, and the shared prefixes).

    >>> unit_memory([(100, 50), (200, 80)], shared=10)
    390
    """
    return sum(r for r, _ in parts) + max((t for _, t in parts), default=0) + shared


# ------------------------------------------------------------------------------------------------
# the planner
# ------------------------------------------------------------------------------------------------
def plan_cse(jobs: Sequence[Job], evaluator: StepwiseEvaluator, *,
             max_unit_memory: int | str | None = None) -> tuple[list[ExecutionUnit], list[Job]]:
    """Group ``jobs`` whose data pipelines agree into :class:`SharedPipelineUnit`\\ s, with shared
    frozen prefixes where found; return the units and the jobs left to train separately.

    Only the declarative supervised evaluators (``Classification``, ``Regression``) are fused. A
    job alone in its pipeline is left over; the first unit's log line says why ("different batch
    size (32, not 64)", "different data seed (7, not 0)", ...). ``max_unit_memory`` (bytes or
    e.g. ``"2GiB"``) defaults to the experiment's bound (:func:`tridens.units.
    resolve_max_unit_memory`).
    """
    if not isinstance(evaluator, SupervisedEvaluator):
        return [], list(jobs)
    groups: dict[tuple[Any, ...], list[tuple[Job, TrainConfig]]] = {}
    leftover: list[Job] = []
    for job in jobs:
        if not isinstance(job.model, nn.Module):
            leftover.append(job)
            continue
        try:
            cfg = evaluator.config(job.trial.sample)
        except Exception:  # the separate unit reports it as the trial's failure
            leftover.append(job)
            continue
        groups.setdefault(_pipeline_key(cfg, job.trial.seed), []).append((job, cfg))
    shared = [(k, g) for k, g in groups.items() if len(g) > 1]
    notes: list[str] = []
    for key, group in groups.items():
        if len(group) == 1:
            job = group[0][0]
            leftover.append(job)
            if shared:
                biggest = max(shared, key=lambda kg: len(kg[1]))[0]
                notes.append(f"trial {job.trial.id} ({_difference(key, biggest)})")
            else:
                notes.append(f"trial {job.trial.id}")
    if not shared:
        if len(jobs) > 1:
            log.info("cse: no two trials share a data pipeline (%s); they train separately", ", ".join(notes))
        return [], leftover
    units: list[ExecutionUnit] = []
    for index, (_key, group) in enumerate(shared):
        extra = ("not shared: " + ", ".join(notes)) if index == 0 and notes else ""
        units.extend(_plan_group(group, evaluator, max_unit_memory, extra))
    order = {job.trial.id: i for i, job in enumerate(jobs)}
    leftover.sort(key=lambda j: order[j.trial.id])
    return units, leftover


def _plan_group(group: list[tuple[Job, TrainConfig]], evaluator: StepwiseEvaluator,
                max_unit_memory: int | str | None, extra: str) -> list[ExecutionUnit]:
    cfg0 = group[0][1]
    example = _example_batch(cfg0)
    hasher = _Hasher()
    analyses: list[_Analysis] = []
    for job, cfg in group:
        try:
            analyses.append(_analyse(job, cfg, example, hasher))
        except Exception as err:  # tracing is an optimization: a model it fails on trains whole
            a = _Analysis(job, cfg, example)
            a.why_not = f"tracing failed ({type(err).__name__})"
            analyses.append(a)
    notes: dict[int, str] = {}
    plans = _find_prefixes(analyses, notes) if any(a.eligible for a in analyses) else []
    split_of: dict[int, _PrefixPlan] = {t: plan for plan in plans for t in plan.members}
    for a in analyses:
        if a.why_not and any(b.eligible for b in analyses):
            notes.setdefault(a.job.trial.id, a.why_not)
    # memory of each member, of the shared batches and of each shared prefix
    parts: list[tuple[_Analysis, int, int]] = []
    for a in analyses:
        assert a.job.model is not None
        plan = split_of.get(a.job.trial.id)
        acts = a.activations.values() if plan is None else [
            b for n, b in a.activations.items() if a.key_of.get(n) not in plan.keys]
        parts.append((a, _resident(a.job.model, a.cfg), sum(acts)))
    batch_bytes = example[:1].numel() * example.element_size() * max(cfg0.batch_size, 256)
    prefix_bytes: dict[str, int] = {}
    for plan in plans:
        rep = plan.rep
        acts = sum(b for n, b in rep.activations.items() if rep.key_of.get(n) in plan.keys)
        state = sum(t.numel() * t.element_size() for t in plan.prefix.module.state_dict().values())
        prefix_bytes[plan.prefix.key] = 2 * acts + state
    limit = resolve_max_unit_memory(max_unit_memory, cfg0.device)

    def estimate(chunk: list[tuple[_Analysis, int, int]]) -> int:
        keys = {split_of[a.job.trial.id].prefix.key for a, _, _ in chunk if a.job.trial.id in split_of}
        return unit_memory([(r, t) for _, r, t in chunk], 3 * batch_bytes + sum(prefix_bytes[k] for k in keys))

    # fill units in order, each under the limit; members of one prefix next to each other
    rank = {plan.prefix.key: i for i, plan in enumerate(plans)}
    ordered = sorted(parts, key=lambda p: rank.get(split_of[p[0].job.trial.id].prefix.key, -1)
                     if p[0].job.trial.id in split_of else len(rank))
    chunks: list[list[tuple[_Analysis, int, int]]] = []
    over: list[int] = []
    for part in ordered:
        if chunks and estimate(chunks[-1] + [part]) <= limit:
            chunks[-1].append(part)
        else:
            chunks.append([part])
            if estimate([part]) > limit:
                over.append(part[0].job.trial.id)
    units: list[ExecutionUnit] = []
    used: set[str] = set()
    for i, chunk in enumerate(chunks):
        units.append(_make_unit(chunk, evaluator, split_of, notes, estimate(chunk), limit, len(chunks),
                                over, extra if i == 0 else "", cfg0, used))
    return units


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _make_unit(chunk: list[tuple[_Analysis, int, int]], evaluator: StepwiseEvaluator,
               split_of: dict[int, _PrefixPlan], notes: dict[int, str], estimate: int, limit: int,
               n_chunks: int, over: list[int], extra: str, cfg0: TrainConfig, used: set[str]) -> SharedPipelineUnit:
    jobs = [a.job for a, _, _ in chunk]
    members: list[PipelineMember] = []
    errors: dict[int, BaseException] = {}
    prefixes: dict[str, SharedPrefix] = {}
    whole: list[int] = []
    for a, _, _ in chunk:
        job = a.job
        trial_id = job.trial.id
        plan = split_of.get(trial_id)
        try:
            if plan is None:
                trainer = evaluator.trainer(job.model, job.trial.sample, job.trial.seed)
                members.append(TrainerMember(job, trainer))
                whole.append(trial_id)
                continue
            prefix = prefixes.get(plan.prefix.key)
            if prefix is None:
                # a prefix whose members were split over several units: each unit computes its own copy
                prefix = plan.prefix.copy() if plan.prefix.key in used else plan.prefix
                prefix.module.to(cfg0.device)
                prefixes[prefix.key] = prefix
                used.add(prefix.key)
            split = plan.members[trial_id]
            trainer = evaluator.trainer(split.suffix, job.trial.sample, job.trial.seed)
            state = prefix.module.state_dict(keep_vars=True)
            buffers = {k: state[r] for k, r in split.buffers.items() if r in state}
            members.append(TrainerMember(job, trainer, inputs=split.inputs, prefix_buffers=buffers))
        except Exception as err:  # reported as the trial's failure at its first epoch
            errors[trial_id] = err
    members, joint, estimate = _joint_member(members, chunk, estimate, limit, cfg0)
    unit = SharedPipelineUnit(jobs, evaluator, members=members, prefixes=list(prefixes.values()), memory=estimate)
    unit.errors.update(errors)
    # the log line: what is shared, what is not and why
    data = getattr(cfg0.train, "name", None) or type(cfg0.train).__name__
    pieces = [f"one data pipeline ({data}, batch size {cfg0.batch_size}, data seed "
              f"{cfg0.data_seed_of(jobs[0].trial.seed)}"
              + (", augmentation once per batch" if cfg0.transforms is not None else "") + ")"]
    for prefix in prefixes.values():
        ids = [str(m.trial_id) for m in members if isinstance(m, TrainerMember) and set(m.inputs) & set(prefix.outputs)]
        pieces.append(f"{prefix.description} computed once per batch for trials [{', '.join(ids)}]")
    if whole and (prefixes or any(t in notes for t in whole)):
        reasons: dict[str, list[str]] = {}
        for t in whole:
            reasons.setdefault(notes.get(t, "no shared prefix"), []).append(str(t))
        pieces.append("whole models: " + "; ".join(f"trials [{', '.join(ids)}] ({why})" for why, ids in reasons.items()))
    if joint:
        pieces.append(joint)
    memory = f"memory estimate {_mib(estimate)}, max_unit_memory {_mib(limit)}"
    if n_chunks > 1:
        memory += f" (the group is split into {n_chunks} units)"
    alone = [str(t) for t in over if t in unit.jobs]
    if alone:
        memory += f"; trials [{', '.join(alone)}] exceed it alone"
    pieces.append(memory)
    if extra:
        pieces.append(extra)
    unit.reason = "; ".join(pieces)
    return unit



# ------------------------------------------------------------------------------------------------
# the pass that builds mixed units
# ------------------------------------------------------------------------------------------------
def _unit_pipeline(unit: ExecutionUnit) -> tuple[Any, ...] | None:
    """The pipeline key of a batched or shared-pipeline unit (None for anything else)."""
    from ._batching import BatchedUnit

    if isinstance(unit, BatchedUnit):
        return _pipeline_key(unit.member.cfg, unit._seed)
    if isinstance(unit, SharedPipelineUnit) and unit.config is not None and not unit.errors:
        return _pipeline_key(unit.config, unit._seed)
    return None


def merge_pipelines(units: Sequence[ExecutionUnit], rest: Sequence[Job], evaluator: StepwiseEvaluator, *,
                    max_unit_memory: int | str | None = None) -> tuple[list[ExecutionUnit], list[Job]]:
    """Put batched units (:class:`~tridens.xopt._batching.BatchedUnit`) that read the same data
    pipeline as other batched or shared-pipeline units, or as leftover jobs, into ONE
    :class:`SharedPipelineUnit` (a mixed unit: each batch read and augmented once, fed to every
    fused group and trainer), as long as the sum of their memory estimates stays under
    ``max_unit_memory``. It always pays: the members do the same steps, and the pipeline's work is
    done once instead of once per unit. Returns the units and the jobs still left."""
    from ._batching import BatchedUnit

    lone = "no other trial to fuse with"
    units = list(units)
    by_key: dict[tuple[Any, ...], list[ExecutionUnit]] = {}
    for unit in units:
        key = _unit_pipeline(unit)
        if key is not None:
            by_key.setdefault(key, []).append(unit)
    if not any(isinstance(u, BatchedUnit) for group in by_key.values() for u in group):
        return units, list(rest)
    left: list[Job] = []
    for job in rest:  # a lone trial reading a batched group's pipeline joins it as a trainer
        key = None
        if isinstance(evaluator, SupervisedEvaluator) and isinstance(job.model, nn.Module):
            try:
                cfg = evaluator.config(job.trial.sample)
                key = _pipeline_key(cfg, job.trial.seed)
            except Exception:  # the separate unit reports it as the trial's failure
                key = None
        if key is None or not any(isinstance(u, BatchedUnit) for u in by_key.get(key, ())):
            left.append(job)
            continue
        single = SharedPipelineUnit([job], evaluator, memory=unit_memory([(_resident(job.model, cfg), 0)]))
        if single.errors:
            left.append(job)
            continue
        single.reason = lone
        by_key[key].append(single)
        units.append(single)
    merged: dict[int, ExecutionUnit] = {}   # id of a unit absorbed -> the unit replacing it
    for key, group in by_key.items():
        if len(group) < 2 or not any(isinstance(u, BatchedUnit) for u in group):
            continue
        cfg = group[0].member.cfg if isinstance(group[0], BatchedUnit) else group[0].config
        assert cfg is not None
        limit = resolve_max_unit_memory(max_unit_memory, cfg.device)
        chunks: list[list[ExecutionUnit]] = []
        total = 0
        for unit in group:  # fill mixed units in order, each under the bound
            size = int(getattr(unit, "memory", None) or 0)
            if chunks and total + size <= limit:
                chunks[-1].append(unit)
                total += size
            else:
                chunks.append([unit])
                total = size
        for chunk in chunks:
            if len(chunk) < 2 or not any(isinstance(u, BatchedUnit) for u in chunk):
                continue
            mixed = _mixed_unit(chunk, evaluator, sum(int(getattr(u, "memory", None) or 0) for u in chunk), limit)
            for unit in chunk:
                merged[id(unit)] = mixed
    out: list[ExecutionUnit] = []
    for unit in units:
        replacement = merged.get(id(unit), unit)
        if replacement is unit and isinstance(unit, SharedPipelineUnit) and unit.reason == lone:
            left.extend(unit.jobs.values())  # found no room in a mixed unit: back to separate training
            continue
        if not any(u is replacement for u in out):
            out.append(replacement)
    order = {job.trial.id: i for i, job in enumerate(rest)}
    left.sort(key=lambda j: order.get(j.trial.id, 0))
    return out, left


def _mixed_unit(chunk: Sequence[ExecutionUnit], evaluator: StepwiseEvaluator, memory: int,
                limit: int) -> SharedPipelineUnit:
    from ._batching import BatchedUnit

    jobs = [job for unit in chunk for job in unit.jobs.values()]
    members: list[PipelineMember] = []
    prefixes: list[SharedPrefix] = []
    parts: list[str] = []
    for unit in chunk:
        if isinstance(unit, BatchedUnit):
            members.append(unit.member)
            ids = ", ".join(str(i) for i in unit.jobs)
            parts.append(f"trials [{ids}] as one batched model ({unit.reason or 'fused'}; {unit.member.engine})")
        else:
            assert isinstance(unit, SharedPipelineUnit)
            members.extend(unit.members)
            prefixes.extend(unit.prefixes.values())
            ids = ", ".join(str(i) for i in unit.jobs)
            parts.append(f"trials [{ids}]: {unit.reason}" if unit.reason else f"trials [{ids}]")
    unit = SharedPipelineUnit(jobs, evaluator, members=members, prefixes=prefixes, memory=memory)
    unit.reason = (f"mixed unit, one data pipeline for {len(chunk)} planned units: " + " | ".join(parts)
                   + f"; memory estimate {_mib(memory)}, max_unit_memory {_mib(limit)}")
    return unit
