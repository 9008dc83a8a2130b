"""Common sub-expression elimination across the trials of a group: the planner.

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
run's, one bound for every optimization: :meth:`tridens.units.PlanContext.memory_bound`; or
the ``max_unit_memory=`` argument of :func:`plan_cse`); a group
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

**The members' own steps, shared** (:mod:`._joint`, planned by :mod:`._wide`). Sharing the pipeline saves its work P once
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
where it measured it faster than the members' own layers (:class:`~tridens.xopt.CSESettings`). A joint step holds
every member's activations at once, so it is used only within ``max_unit_memory``. Members that
modify their input in place step alone. Per-epoch metrics stay bit-identical to separate training
(tested; see ``BENCHMARKS.md`` for what it gains).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch.nn as nn

from ..units import Decisions, ExecutionUnit, Job, PlanContext, default_max_unit_memory, resolve_max_unit_memory
from ..evaluators import StepwiseEvaluator
from ..evaluators import TrainConfig, SupervisedEvaluator
from ._joint import JointMember
from ._pipeline import (BATCH, PipelineMember, SharedPipelineUnit, SharedPrefix, TrainerMember, _difference, _mib,
                        _pipeline_key, supervised_trainer)
from ._prefix import (MIN_PREFIX_SHARE, _Analysis, _Hasher, _PrefixPlan, _analyse, _example_batch, _find_prefixes,
                      example_bytes)
from ._settings import CSESettings, Settings
from ._wide import _check_member, _fast_model, _joint_member

__all__ = [
    "MIN_PREFIX_SHARE", "BATCH", "CSESettings",
    "PipelineMember", "TrainerMember", "JointMember", "SharedPrefix", "SharedPipelineUnit",
    "plan_cse", "plan_frozen_prefixes", "default_max_unit_memory", "unit_memory",
]

log = logging.getLogger("tridens")

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
def plan_cse(jobs: Sequence[Job], evaluator: StepwiseEvaluator, *, settings: Settings | None = None,
             max_unit_memory: int | str | None = None, prefix_only: bool = False,
             context: PlanContext | None = None) -> tuple[list[ExecutionUnit], list[Job]]:
    """Group ``jobs`` whose data pipelines agree into :class:`SharedPipelineUnit`\\ s, with shared
    frozen prefixes where found; return the units and the jobs left to train separately.

    Only the declarative supervised evaluators (``Classification``, ``Regression``) are fused. A
    job alone in its pipeline is left over; the first unit's log line says why ("different batch
    size (32, not 64)", "different data seed (7, not 0)", ...). ``max_unit_memory`` (bytes or
    e.g. ``"2GiB"``) defaults to the run's bound (:meth:`tridens.units.PlanContext.memory_bound`
    of ``context``, the run's plan context). ``settings.cse`` (None: the context's, else
    :meth:`Settings.from_env`) holds the joint step's knobs. ``prefix_only``: only the trials that share a frozen prefix are fused, the others
    are left over (:func:`plan_frozen_prefixes`).
    """
    if not isinstance(evaluator, SupervisedEvaluator):
        return [], list(jobs)
    context = context if context is not None else PlanContext()
    knobs = (settings if settings is not None else context.settings if context.settings is not None else
             Settings.from_env()).cse
    groups: dict[tuple[Any, ...], list[tuple[Job, TrainConfig]]] = {}
    leftover: list[Job] = []
    for job in jobs:
        if not isinstance(job.model, nn.Module):
            leftover.append(job)
            continue
        try:
            cfg = job.config(evaluator)
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
        if len(jobs) > 1 and not prefix_only:
            log.info("cse: no two trials share a data pipeline (%s); they train separately", ", ".join(notes))
        return [], leftover
    units: list[ExecutionUnit] = []
    for index, (_key, group) in enumerate(shared):
        extra = ("not shared: " + ", ".join(notes)) if index == 0 and notes and not prefix_only else ""
        made, rest = _plan_group(group, evaluator, max_unit_memory, extra, knobs, prefix_only=prefix_only,
                                 context=context)
        units.extend(made)
        leftover.extend(rest)
    order = {job.trial.id: i for i, job in enumerate(jobs)}
    leftover.sort(key=lambda j: order[j.trial.id])
    return units, leftover


def plan_frozen_prefixes(jobs: Sequence[Job], evaluator: StepwiseEvaluator, *, settings: Settings | None = None,
                         max_unit_memory: int | str | None = None, context: PlanContext | None = None
                         ) -> tuple[list[ExecutionUnit], list[Job]]:
    """The trials of ``jobs`` whose models start with a frozen prefix shared with another trial
    (a pretrained backbone in a fine-tuning space), in :class:`SharedPipelineUnit` units that compute
    each prefix once per batch; the other jobs are returned untouched for the next optimization.

    Asked before operator batching: fused same-shaped models would each run the prefix (K times
    per batch), where here it runs once for every trial of the group. Models without a frozen
    parameter are passed on without tracing.

    >>> units, rest = plan_frozen_prefixes(jobs, evaluator)   # doctest: +SKIP
    """
    frozen = [j for j in jobs if isinstance(j.model, nn.Module)
              and any(not p.requires_grad for p in j.model.parameters())]
    if len(frozen) < 2:
        return [], list(jobs)
    units, rest = plan_cse(frozen, evaluator, settings=settings, max_unit_memory=max_unit_memory, prefix_only=True,
                           context=context)
    taken = {job.trial.id for unit in units for job in unit.jobs.values()}
    return units, [j for j in jobs if j.trial.id not in taken]


def _plan_group(group: list[tuple[Job, TrainConfig]], evaluator: StepwiseEvaluator,
                max_unit_memory: int | str | None, extra: str, settings: CSESettings,
                prefix_only: bool = False, context: PlanContext | None = None
                ) -> tuple[list[ExecutionUnit], list[Job]]:
    context = context if context is not None else PlanContext()
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
    rest: list[Job] = []
    if prefix_only:
        rest = [a.job for a in analyses if a.job.trial.id not in split_of]
        analyses = [a for a in analyses if a.job.trial.id in split_of]
        if not analyses:
            return [], rest
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
    batch_bytes = example_bytes(example) * max(cfg0.batch_size, 256)
    prefix_bytes: dict[str, int] = {}
    for plan in plans:
        rep = plan.rep
        prefix_acts = sum(b for n, b in rep.activations.items() if rep.key_of.get(n) in plan.keys)
        state = sum(t.numel() * t.element_size() for t in plan.prefix.module.state_dict().values())
        prefix_bytes[plan.prefix.key] = 2 * prefix_acts + state
    limit = context.memory_bound(cfg0.device, max_unit_memory)

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
                                over, extra if i == 0 else "", cfg0, used, settings, context.decisions))
    return units, rest


def _analysed(members: Sequence[TrainerMember]) -> tuple[list[tuple[_Analysis, int, int]], TrainConfig, int]:
    """The planner's view of whole-model trainers of one data pipeline: each member's analysis,
    resident and transient bytes; the first member's config; the memory estimate of training them
    together."""
    cfg0 = members[0].trainer.config
    example = _example_batch(cfg0)
    hasher = _Hasher()
    chunk: list[tuple[_Analysis, int, int]] = []
    for m in members:
        cfg = m.trainer.config
        try:
            a = _analyse(m.job, cfg, example, hasher)
        except Exception as err:  # tracing is an optimization: a model it fails on steps as it is
            a = _Analysis(m.job, cfg, example)
            a.why_not = f"tracing failed ({type(err).__name__})"
        assert m.job.model is not None
        chunk.append((a, _resident(m.job.model, cfg), sum(a.activations.values())))
    batch_bytes = example_bytes(example) * max(cfg0.batch_size, 256)
    return chunk, cfg0, unit_memory([(r, t) for _, r, t in chunk], 3 * batch_bytes)


def joint_trainers(members: Sequence[TrainerMember], settings: CSESettings, *, max_unit_memory: int | None = None,
                   decisions: Decisions | None = None) -> tuple[list[PipelineMember], str]:
    """Whole-model trainers of one data pipeline stepped as the planner's shared-pipeline units step
    them: one :class:`~tridens.xopt._joint.JointMember` (one backward; first layers as one wide op
    and 2x2 max-pools by the exact kernel where they pay and the checks on real data pass), or as
    given where they cannot join; with the planner's log text ('' if nothing joined). A batched
    group that measured that fusion does not pay trains its trials this way, within its run's
    ``max_unit_memory`` and recording into its run's ``decisions``.

    >>> steppers, text = joint_trainers([TrainerMember(job, evaluator.trainer(job.model, {}, 0))  # doctest: +SKIP
    ...                                  for job in jobs], CSESettings())
    """
    if len(members) < 2 or not settings.joint:
        return list(members), ""
    chunk, cfg0, estimate = _analysed(members)
    limit = resolve_max_unit_memory(max_unit_memory, cfg0.device)
    out, text, _ = _joint_member(list(members), chunk, estimate, limit, cfg0, settings, decisions)
    return out, text


def with_fast_kernels(member: TrainerMember, settings: CSESettings) -> PipelineMember:
    """One whole-model trainer stepped with the exact faster kernels :func:`joint_trainers` would
    give it (2x2 max-pools), as a one-member :class:`~tridens.xopt._joint.JointMember`; the member
    itself where its model has none or they do not reproduce it bit for bit."""
    if not settings.fast_pools or member.inputs != (BATCH,) or member.trainer.model is not member.job.model:
        return member
    a = _analysed([member])[0][0][0]
    model = _fast_model(a)
    if model is None:
        return member
    why, _, exact = _check_member(a, None, [model])
    if why or not exact[0]:
        return member
    return JointMember([member], trusted=[member.trial_id], fast={member.trial_id: model},
                       foreach_step=settings.foreach_step)


def _make_unit(chunk: list[tuple[_Analysis, int, int]], evaluator: StepwiseEvaluator,
               split_of: dict[int, _PrefixPlan], notes: dict[int, str], estimate: int, limit: int,
               n_chunks: int, over: list[int], extra: str, cfg0: TrainConfig, used: set[str],
               settings: CSESettings, decisions: Decisions) -> SharedPipelineUnit:
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
                trainer = supervised_trainer(evaluator, job.model, job.sample, job.trial.seed)
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
            trainer = supervised_trainer(evaluator, split.suffix, job.sample, job.trial.seed)
            state = prefix.module.state_dict(keep_vars=True)
            buffers = {k: state[r] for k, r in split.buffers.items() if r in state}
            members.append(TrainerMember(job, trainer, inputs=split.inputs, prefix_buffers=buffers))
        except Exception as err:  # reported as the trial's failure at its first epoch
            errors[trial_id] = err
    members, joint, estimate = _joint_member(members, chunk, estimate, limit, cfg0, settings, decisions)
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
                    settings: Settings | None = None, max_unit_memory: int | str | None = None,
                    context: PlanContext | None = None) -> tuple[list[ExecutionUnit], list[Job]]:
    """Put batched units (:class:`~tridens.xopt._batching.BatchedUnit`) that read the same data
    pipeline as other batched or shared-pipeline units, or as leftover jobs, into ONE
    :class:`SharedPipelineUnit` (a mixed unit: each batch read and augmented once, fed to every
    fused group and trainer), as long as the sum of their memory estimates stays under
    ``max_unit_memory``. It always pays: the members do the same steps, and the pipeline's work is
    done once instead of once per unit. Returns the units and the jobs still left. (No knob of
    ``settings`` changes this pass.)"""
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
                cfg = job.config(evaluator)
                key = _pipeline_key(cfg, job.trial.seed)
            except Exception:  # the separate unit reports it as the trial's failure
                key = None
        if key is None or not any(isinstance(u, BatchedUnit) for u in by_key.get(key, ())):
            left.append(job)
            continue
        single = SharedPipelineUnit([job], evaluator, memory=unit_memory([(_resident(job.concrete_model, cfg), 0)]))
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
        first = group[0]
        cfg = first.member.cfg if isinstance(first, BatchedUnit) else \
            first.config if isinstance(first, SharedPipelineUnit) else None
        assert cfg is not None
        limit = (context or PlanContext()).memory_bound(cfg.device, max_unit_memory)
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
