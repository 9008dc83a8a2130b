"""Several trainers stepped together: their forwards, ONE backward over their losses, one
multi-model optimizer step, and compatible first layers run as one wide op (:class:`JointMember`).

The members' parameters are disjoint, so each gets exactly its own gradient; per-epoch metrics
stay bit-identical to the members' own steps on CPU. The knobs are a
:class:`~tridens.xopt.CSESettings`, given to the planner that builds a joint member.
"""

from __future__ import annotations


import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..units import Job
from ..evaluators import StepwiseEvaluator
from ..evaluators import NonFiniteLoss
from ._pipeline import BATCH, PipelineMember, TrainerMember

# ------------------------------------------------------------------------------------------------
# several trainers stepped together: one backward, first layers as one wide op
# ------------------------------------------------------------------------------------------------
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
                make: Callable[..., torch.optim.Optimizer] = cls   # an optimizer class (Adam, SGD, ...): takes lr, foreach
                merged = self._merged[cls] = make(params, lr=hyper[key]["lr"], foreach=True)
                merged.state = _RoutedState(self._owners)  # type: ignore[assignment]
            merged.param_groups = [{**hyper[key], "foreach": True, "params": params}]
            merged.step()

    def forget(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._owners.pop(id(p), None)


class _WideLayer:
    """First layers of several members that read the same batch (``flatten``: flattened from dim 1),
    run as ONE ``linear``/``conv2d`` on their concatenated weights. The concatenation is
    ``torch.cat`` of the members' own parameters inside autograd, so the backward of the one op
    hands every member exactly the gradient of its own rows; each member's output slice is copied
    into a tensor of its own (the layout its own layer gives, and an own version counter, so a
    member's in-place op on it cannot touch the others' saved tensors)."""

    def __init__(self, kind: str, flatten: bool, layers: Mapping[int, nn.Linear | nn.Conv2d]):
        self.kind = kind
        self.flatten = flatten
        self.layers = dict(layers)   # trial id -> its first layer (the model's own module)

    def describe(self, ids: Sequence[int] | None = None) -> str:
        mods = [self.layers[t] for t in (self.layers if ids is None else ids)]
        width = sum(int(m.weight.shape[0]) for m in mods)
        m0 = mods[0]
        if isinstance(m0, nn.Linear):   # (kind "linear")
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
        # (a group's layers all have a bias or none has: it is part of their key)
        bias = torch.cat([m.bias for m in mods if m.bias is not None]).detach() if mods[0].bias is not None else None
        m0 = mods[0]
        if isinstance(m0, nn.Linear):   # (kind "linear")
            out, dim = F.linear(inp, weight, bias), -1
        else:
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
                 fast: Mapping[int, nn.Module] | None = None, fast_after: Mapping[int, nn.Module] | None = None,
                 foreach_step: bool = True):
        self.members = list(members)
        self.foreach_step = foreach_step  # CSESettings.foreach_step: one foreach optimizer call (_MultiStep)
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

    def state_dict(self, trial_id: int, job: Job, evaluator: StepwiseEvaluator) -> dict[str, Any] | None:
        member = self._by.get(trial_id)
        return None if member is None else member.state_dict(trial_id, job, evaluator)

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
                    with t.config.autocast():
                        out = model(inp if after_first else t._laid_out(inp))
                    loss = t.config.loss_of(out, y)
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
        if self.foreach_step and len(stepped) > 1:
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
                    with t.config.autocast():
                        m._val.add(model(inp if after_first else t._laid_out(inp)), y)
            except Exception as err:
                m._error = err

        self._run(active, x, forward)
