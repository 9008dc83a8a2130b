"""Weight inheritance and the super-graph (Retiarii's third cross-model optimization): the planner.

**Inheritance.** A child of regularized evolution (``RegularizedEvolution(inherit_weights=True)``,
which names each child's parent in ``TrialGroup.parents``) starts from its parent's trained
weights for the layers they share. Layers are matched through the graph IR with the ModelKeeper
alignment of :mod:`tridens.warmup` (:func:`~tridens.warmup.describe` + :func:`~tridens.warmup.align`);
a matched pair is *shared* when both nodes have the same type and identical state shapes, and a
shared layer's tensors are copied exactly (parameters and buffers, e.g. BatchNorm statistics).
Layers that differ keep the child's own initialisation: no slicing or Net2Net widening here,
because only identical layers can be one tensor in a super-graph. The engine calls
:func:`inherit_from_trial` while it materializes a child (the parent's checkpoint is read from the
store); what was inherited is recorded in ``trial.info["inherit"]``.

**Super-graph.** Children of one parent in one TrialGroup (one per architecture, with the same
optimizer kind, momentum and weight decay) train merged in a :class:`SuperGraphUnit`, weight
sharing as in Retiarii's super-graph and in one-shot NAS (ENAS/SPOS):

* *Stored once.* Every parameter two or more children inherited from the same parent tensor is
  ONE ``nn.Parameter`` held by all their modules.
* *Computed once.* The children read the same batch and hold the same tensors up to their first
  mutated layer, so their graphs (``torch.fx`` through :func:`tridens.graph.trace`) are merged
  into a prefix tree: a node is computed once for the children whose nodes have the same
  structure (the IR's prefix fingerprint), the same shared tensors and the same inputs, and the
  graph branches where they differ. One ``torch.fx`` module computes every child's output per
  batch; one ``backward`` runs over the sum of the children's losses.
* *Stepped once.* A shared parameter takes ONE optimizer step per batch, from the mean of the
  gradients of the children that share it (the sum's gradient divided by their number), with one
  optimizer state, at the mean of those children's learning rates (their schedules at the
  step); each child's own tensors are stepped by its own optimizer at its own learning rate.
* *Buffers* (BatchNorm statistics) are stored once only for nodes computed once (the children
  feed them the same activations). A shared layer in a branch (same parameters, other inputs)
  keeps one copy of its statistics per child, each starting from the parent's: statistics of
  one child's activations would be wrong for another's.
* *Randomness.* Each child's nodes run in its trainer's own random stream; a node computed once
  runs in the stream of the first child (trial order) that has it. So dropout in a shared prefix
  draws ONE mask, used by every child sharing that prefix (what one forward of a super-graph
  does); dropout in a child's branch draws its own. Other random ops (``torch.rand``, RReLU, ...)
  are never shared: the graph branches there.

Per-trial guarantees: metrics for every child every epoch. A child whose loss turns NaN/inf fails
alone with :class:`~tridens.evaluators.NonFiniteLoss`: its loss is left out of that step's sum
(the others' step is what it would be had the child left just before) and it leaves the unit. An
exception in the merged forward is attributed to the children whose own model raises on that
batch. A child that is stopped (or finishes) leaves at the end of an epoch; the others keep their
optimizer states, data order and shared tensors. Each child's checkpoint is its whole model's
``state_dict`` (the shared tensors' values at that moment).

**Memory.** :func:`supergraph_memory`: the shared tensors once, each child's own, gradients and
optimizer states, the activations of every merged node (all kept until the one backward: shapes
from the graph IR at the batch size) and the shared batches. :func:`plan_supergraph` keeps each
unit under ``max_unit_memory`` (the experiment's bound, as for the other optimizations) and
splits a group that exceeds it; a child left alone trains apart (from the parent's weights).

The merge and the tying are hand-written over ``torch.fx`` (node copying into one graph, module
attribute replacement): no library merges separately built models into a prefix tree or ties
weights across them. Measured in BENCHMARKS.md ("Weight inheritance").

>>> td.Experiment(space, evaluator, td.strategy.RegularizedEvolution(inherit_weights=True))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
from itertools import chain
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from ..units import ExecutionUnit, Job, PlanContext
from ..evaluators import StepwiseEvaluator
from ..evaluators import NonFiniteLoss
from ..evaluators import SupervisedTrainer, TrainConfig, ValidationSums, SupervisedEvaluator
from ._pipeline import PipelineMember, SharedPipelineUnit, _mib, _pipeline_key
from ._prefix import _example_batch, example_to
from ._inherit import inherit, inherit_from_trial, shared_tensors
from ._settings import Settings
from ._merge import (_Child, _Sharing, _Streams, _analyse, _batch_bytes, _identities, _merge, _sharing, _slot, _tensor,
                     supergraph_memory)

__all__ = ["shared_tensors", "inherit", "inherit_from_trial", "SuperGraphUnit", "SuperGraphMember",
           "plan_supergraph", "supergraph_memory"]

log = logging.getLogger("tridens")

# ------------------------------------------------------------------------------------------------
# the member and the unit
# ------------------------------------------------------------------------------------------------
class SuperGraphMember(PipelineMember):
    """The children of a super-graph as one member of a shared pipeline: per batch one forward of
    the merged module, one backward over the sum of the children's (finite) losses, one step of
    each shared parameter (mean gradient of its users) and of each child's own parameters."""

    def __init__(self, children: Sequence[_Child], trainers: Mapping[int, SupervisedTrainer],
                 ident: Mapping[int, Mapping[str, str]], share: _Sharing):
        self.children = {c.job.trial.id: c for c in children}
        self.trainers = dict(trainers)
        self._ids = list(self.children)
        self.shared: dict[str, tuple[torch.Tensor, set[int]]] = {}
        for pk, ids in share.params.items():
            ck = next(k for k, p in ident[ids[0]].items() if p == pk)
            model = self.children[ids[0]].job.model
            assert isinstance(model, nn.Module)
            slot = _slot(model, ck)
            if slot is not None:
                self.shared[pk] = (_tensor(slot), set(ids))
        shared_ids = {id(p) for p, _ in self.shared.values()}
        self.own: dict[int, torch.optim.Optimizer | None] = {}
        for tid, trainer in self.trainers.items():
            own = [p for p in trainer.model.parameters() if id(p) not in shared_ids]
            self.own[tid] = trainer.config.make_optimizer(own) if own else None
            if self.own[tid] is not None:
                trainer.optimizer = self.own[tid]  # type: ignore[assignment]  # what its trainer steps
        self.config = next(iter(self.trainers.values())).config
        self.shared_optimizer: torch.optim.Optimizer | None = None
        self._groups: list[tuple[frozenset[int], dict[str, Any]]] = []
        self._regroup()
        self._module: fx.GraphModule | None = None
        self._module_ids: tuple[int, ...] = ()
        self.nodes = 0                       # nodes of the merged module now
        self.child_nodes = 0                 # nodes of the children's own graphs, summed
        self.forwards = 0                    # merged forward passes (training and validation)
        self.errors: dict[int, BaseException] = {}
        self._epoch_ids: list[int] = []
        self._totals: dict[int, list[float]] = {}
        self._val: dict[int, ValidationSums] = {}
        self._flags: list[tuple[nn.Module, bool]] = []

    # -- bookkeeping ----------------------------------------------------------------------------
    def _regroup(self) -> None:
        """The shared optimizer: one param group per set of users (its lr is their mean); the
        optimizer state of every parameter kept across regroupings."""
        groups: dict[frozenset[int], list[torch.Tensor]] = {}
        for p, users in self.shared.values():
            live = frozenset(users & set(self._ids))
            if live:
                groups.setdefault(live, []).append(p)
        old = self.shared_optimizer
        if not groups:
            self.shared_optimizer, self._groups = None, []
            return
        optimizer = self.config.make_optimizer([{"params": ps} for ps in groups.values()])
        if old is not None:
            for p in chain.from_iterable(groups.values()):
                if p in old.state:
                    optimizer.state[p] = old.state[p]
        self.shared_optimizer = optimizer
        self._groups = list(zip(groups, optimizer.param_groups))

    def _merged(self, ids: Sequence[int]) -> fx.GraphModule:
        if self._module is None or self._module_ids != tuple(ids):
            children = [self.children[t] for t in ids]
            self._module, self.nodes = _merge(children, [self.trainers[t] for t in ids])
            self.child_nodes = sum(1 if c.nodes is None else sum(1 for n in c.nodes if n.op not in ("placeholder", "output"))
                                   for c in children)
            self._module_ids = tuple(ids)
        return self._module

    def _forward(self, ids: Sequence[int], x: Any) -> tuple[Any, ...]:
        module = self._merged(ids)
        self.forwards += 1
        try:
            return module(x)
        finally:
            streams = module.streams
            assert isinstance(streams, _Streams)   # (set on the merged module by _merge)
            streams.close()

    def _attribute(self, err: BaseException, ids: Sequence[int], x: Any) -> None:
        """The merged forward raised: fail the children whose own model raises on this batch (all
        of them when none does alone). Buffers and random states are left as they were."""
        culprits: dict[int, BaseException] = {}
        for tid in ids:
            model = self.children[tid].job.model
            assert isinstance(model, nn.Module)
            saved = [(b, b.detach().clone()) for b in model.buffers()]
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    model(x)
            except Exception as own:
                culprits[tid] = own
            finally:
                with torch.no_grad():
                    for b, value in saved:
                        b.copy_(value)
        for tid in ids:
            if not culprits or tid in culprits:
                self.errors[tid] = culprits.get(tid, err)

    # -- the PipelineMember protocol ---------------------------------------------------------------
    def trial_ids(self) -> list[int]:
        return list(self._ids)

    def limit(self, trial_id: int) -> int:
        trainer = self.trainers[trial_id]
        steps = self.children[trial_id].job.max_steps
        return trainer.epochs if steps is None else min(trainer.epochs, steps)

    def epoch(self, trial_id: int) -> int:
        return self.trainers[trial_id].epoch

    def begin_epoch(self) -> None:
        self._epoch_ids = [t for t in self._ids if t not in self.errors and self.epoch(t) < self.limit(t)]
        self._totals = {t: [0.0, 0] for t in self._epoch_ids}
        for tid in self._epoch_ids:
            try:
                self.trainers[tid].begin_epoch()
            except Exception as err:
                self.errors[tid] = err

    def train_batch(self, x: Any, y: torch.Tensor, batch: int) -> None:
        ids = [t for t in self._epoch_ids if t not in self.errors]
        if not ids:
            return
        lrs = {t: self.trainers[t].config.lr_at(self.trainers[t].step) for t in ids}
        for t in ids:
            optimizer = self.own[t]
            if optimizer is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lrs[t]
                optimizer.zero_grad(set_to_none=True)
        for p, _users in self.shared.values():
            p.grad = None
        try:
            outputs = self._forward(ids, x)
            losses = [self.trainers[t].config.loss(out, y) for t, out in zip(ids, outputs)]
            values = torch.stack([loss.detach().float().reshape(()) for loss in losses]).tolist()
        except Exception as err:
            self._attribute(err, ids, x)
            return
        included: list[int] = []
        total: torch.Tensor | None = None
        for t, loss, value in zip(ids, losses, values):
            if math.isfinite(value):
                included.append(t)
                total = loss if total is None else total + loss
                self._totals[t][0] += value * len(y)
                self._totals[t][1] += len(y)
            else:  # this child alone fails; its loss stays out of the step
                trainer = self.trainers[t]
                self.errors[t] = NonFiniteLoss.at(trainer.owner, value, epoch=trainer.epoch, batch=batch,
                                                  step=trainer.step, lr=lrs[t])
        if total is None:
            return
        try:
            total.backward()
        except Exception as err:
            for t in included:
                self.errors[t] = err
            return
        live = set(included)
        for p, users in self.shared.values():
            n = len(users & live)
            if p.grad is not None and n != 1:
                if n == 0:
                    p.grad = None
                else:
                    p.grad.div_(n)  # the mean of the users' gradients
        for t in included:
            optimizer = self.own[t]
            if optimizer is not None:
                optimizer.step()
            self.trainers[t].step += 1
        if self.shared_optimizer is not None:
            for group_users, group in self._groups:
                present = sorted(group_users & live)
                if present:
                    group["lr"] = sum(lrs[t] for t in present) / len(present)
            self.shared_optimizer.step()

    def end_epoch(self) -> dict[int, dict[str, float] | BaseException]:
        out: dict[int, dict[str, float] | BaseException] = {}
        for t in self._epoch_ids:
            if t in self.errors:
                out[t] = self.errors[t]
                continue
            total, count = self._totals[t]
            try:
                out[t] = self.trainers[t].end_epoch(total / count)
            except Exception as err:
                self.errors[t] = out[t] = err
        return out

    def begin_validation(self) -> None:
        ids = [t for t in self._epoch_ids if t not in self.errors]
        self._flags = [(m, m.training) for t in ids for m in self.trainers[t].model.modules()]
        for t in ids:
            self.trainers[t].model.eval()
        self._val = {t: ValidationSums(self.trainers[t].config) for t in ids}

    @torch.no_grad()
    def validate_batch(self, x: Any, y: torch.Tensor) -> None:
        ids = [t for t in self._val if t not in self.errors]
        if not ids:
            return
        try:
            outputs = self._forward(ids, x)
        except Exception as err:
            self._attribute(err, ids, x)
            return
        for t, out in zip(ids, outputs):
            try:
                self._val[t].add(out, y)
            except Exception as err:
                self.errors[t] = err

    def end_validation(self) -> dict[int, dict[str, float] | BaseException]:
        for m, flag in self._flags:
            m.training = flag
        self._flags = []
        out: dict[int, dict[str, float] | BaseException] = {}
        for t in self._epoch_ids:
            if t in self.errors:
                out[t] = self.errors[t]
            elif t in self._val:
                out[t] = self._val[t].result()
        self._val = {}
        return out

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        model = self.children[trial_id].job.model
        assert isinstance(model, nn.Module)
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}

    def leave(self, trial_id: int) -> None:
        if trial_id not in self.children:
            return
        self._ids.remove(trial_id)
        del self.children[trial_id], self.trainers[trial_id], self.own[trial_id]
        self.errors.pop(trial_id, None)
        for _p, users in self.shared.values():
            users.discard(trial_id)
        self.shared = {pk: (p, users) for pk, (p, users) in self.shared.items() if users}
        self._regroup()
        self._module, self._module_ids = None, ()


def _tie(children: Sequence[_Child], ident: Mapping[int, Mapping[str, str]], share: _Sharing) -> int:
    """Make every shared parameter and buffer ONE tensor held by all the children sharing it (the
    first child's object). Returns the number of elements no longer duplicated."""
    by_id = {c.job.trial.id: c for c in children}
    saved = 0
    for tied, kind in ((share.params, "param"), (share.buffers, "buffer")):
        for pk, ids in tied.items():
            owner: torch.Tensor | None = None
            for tid in ids:
                model = by_id[tid].job.model
                assert isinstance(model, nn.Module)
                ck = next(k for k, p in ident[tid].items() if p == pk)
                slot = _slot(model, ck)
                if slot is None or slot[2] != kind:
                    continue
                if owner is None:
                    owner = _tensor(slot)
                    continue
                module, name, _ = slot
                if kind == "param":
                    module._parameters[name] = owner  # type: ignore[assignment]
                else:
                    module._buffers[name] = owner
                saved += int(owner.numel())
    return saved


class SuperGraphUnit(SharedPipelineUnit):
    """Children of one parent trained merged (see the module docstring): the tensors they
    inherited from the same parent tensor stored once, the nodes they compute alike computed once
    per batch, one backward, one step per shared tensor; one data pipeline; per-trial metrics,
    stops and failures as in any unit. ``memory`` is :func:`supergraph_memory`'s estimate.

    >>> unit = SuperGraphUnit(jobs, evaluator)          # doctest: +SKIP
    >>> unit.jobs[a].model.stem.weight is unit.jobs[b].model.stem.weight      # doctest: +SKIP
    True
    """

    kind = "supergraph"
    splittable = False  # its children are tied already

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, *, reason: str = "",
                 memory: int | None = None, _children: Sequence[_Child] | None = None):
        assert isinstance(evaluator, SupervisedEvaluator), "the super-graph trains the declarative supervised evaluators"
        trainers: dict[int, SupervisedTrainer] = {}
        errors: dict[int, BaseException] = {}
        for job in jobs:
            try:  # built first: moving a model to its device may replace its buffers
                trainers[job.trial.id] = evaluator.trainer(job.model, job.sample, job.trial.seed)
            except Exception as err:  # reported as the trial's failure at its first epoch
                errors[job.trial.id] = err
        ok = [job for job in jobs if job.trial.id in trainers]
        ident = _identities(ok)
        known = {c.job.trial.id: c for c in (_children or ())}
        example: Any = None
        children: list[_Child] = []
        for job in ok:
            child = known.get(job.trial.id)
            if child is None:
                cfg = trainers[job.trial.id].config
                if example is None:
                    example = example_to(_example_batch(cfg), cfg.device)
                child = _analyse(job, cfg, example, ident[job.trial.id])
            children.append(child)
        share = _sharing(children, ident)
        self.saved_elements = _tie(children, ident, share)
        self.inherited_tensors = {pk: list(ids) for pk, ids in {**share.buffers, **share.params}.items()}
        parents = {(job.trial.info.get("inherit") or {}).get("parent") for job in jobs}
        self.parent = next(iter(parents)) if len(parents) == 1 else None
        numbers = {(job.trial.info.get("inherit") or {}).get("parent_number") for job in jobs}
        parent_number = next(iter(numbers)) if len(numbers) == 1 and None not in numbers else None
        member = SuperGraphMember(children, trainers, ident, share)
        if children:
            member._merged(member.trial_ids())
        for job in ok:
            mine = [pk for pk, ids in self.inherited_tensors.items() if job.trial.id in ids]
            job.trial.info.setdefault("inherit", {})["merged"] = {
                "unit": [j.trial.id for j in jobs], "tensors": len(mine), "nodes": [member.nodes, member.child_nodes]}
        if memory is None and children:
            memory = supergraph_memory(children, ident, _batch_bytes(children[0].cfg, _example_batch(children[0].cfg)))
        if not reason:
            parent_name = f"#{parent_number}" if parent_number is not None else f"the trial of store id {self.parent}"
            reason = (f"children of {parent_name}: {len(self.inherited_tensors)} inherited tensor(s) stored once "
                      f"({self.saved_elements} elements not duplicated); {member.nodes} nodes per batch for the "
                      f"children's {member.child_nodes} (shared prefixes computed once); one backward, one step "
                      f"per shared tensor")
            if memory is not None:
                reason += f"; memory estimate {_mib(memory)}"
        super().__init__(jobs, evaluator, members=[member] if children else [], reason=reason, memory=memory)
        self.errors.update(errors)
        self.member = member

    def shared(self) -> list[str]:
        return super().shared() + [f"{len(self.inherited_tensors)} inherited tensor(s) stored once"]


# ------------------------------------------------------------------------------------------------
# the planner
# ------------------------------------------------------------------------------------------------
def plan_supergraph(jobs: Sequence[Job], evaluator: StepwiseEvaluator, *, settings: Settings | None = None,
                    max_unit_memory: int | str | None = None, context: PlanContext | None = None
                    ) -> tuple[list[ExecutionUnit], list[Job]]:
    """Merge the children of one parent (``trial.info["inherit"]``) that read the same data
    pipeline, use the same optimizer kind, momentum and weight decay (their shared tensors take
    one optimizer's steps) and share inherited tensors with each other into
    :class:`SuperGraphUnit` s, each under ``max_unit_memory`` (bytes or e.g. ``"2GiB"``; default:
    the run's bound, :meth:`tridens.units.PlanContext.memory_bound` of ``context``): a group
    over it is split, in trial order. Return the units and the jobs left for the other
    optimizations. One child per architecture (graph fingerprint) joins a super-graph: siblings
    of the same architecture -- a mutation of the learning rate only -- would share all their
    inherited layers and hide the hyperparameter's effect, so the others train apart (each still
    from the parent's weights). Only the declarative supervised evaluators are merged (the engine
    owns their training loop). ``settings.supergraph=False`` merges none."""
    context = context if context is not None else PlanContext()
    settings = settings if settings is not None else context.settings
    if (settings is not None and not settings.supergraph) or not isinstance(evaluator, SupervisedEvaluator):
        return [], list(jobs)
    groups: dict[tuple[Any, ...], list[tuple[Job, TrainConfig]]] = {}
    for job in jobs:
        record = job.trial.info.get("inherit") or {}
        if not isinstance(job.model, nn.Module) or not record.get("shared"):
            continue
        try:
            cfg = job.config(evaluator)
        except Exception:  # the separate unit reports it as the trial's failure
            continue
        key = (record.get("parent"), _pipeline_key(cfg, job.trial.seed), cfg.optimizer, cfg.momentum, cfg.weight_decay)
        groups.setdefault(key, []).append((job, cfg))
    units: list[ExecutionUnit] = []
    taken: set[int] = set()
    for (parent, *_rest), candidates in groups.items():
        group: list[tuple[Job, TrainConfig]] = []
        architectures: dict[str, int] = {}
        for job, cfg in candidates:
            fingerprint = job.trial.fingerprint
            if fingerprint is not None and fingerprint in architectures:
                # Tied to a sibling of the same architecture it would train the same inherited
                # tensors: its own hyperparameters could no longer be told apart. It trains apart.
                log.info("supergraph: trial %d has the architecture of trial %d: trained apart from the "
                         "super-graph (it still starts from trial %s's weights)",
                         job.trial.id, architectures[fingerprint], parent)
                continue
            if fingerprint is not None:
                architectures[fingerprint] = job.trial.id
            group.append((job, cfg))
        if len(group) < 2:
            continue
        ident = _identities([job for job, _ in group])
        counts: dict[str, int] = {}
        for mapping in ident.values():
            for pk in mapping.values():
                counts[pk] = counts.get(pk, 0) + 1
        if not any(n > 1 for n in counts.values()):
            log.info("supergraph: the children %s of trial %s share no inherited layer with each other",
                     [job.trial.id for job, _ in group], parent)
            continue
        cfg0 = group[0][1]
        example = _example_batch(cfg0)
        batch = _batch_bytes(cfg0, example)
        children = [_analyse(job, cfg, example, ident[job.trial.id]) for job, cfg in group]
        limit = context.memory_bound(cfg0.device, max_unit_memory)
        chunks: list[list[_Child]] = []
        for child in children:  # fill units in trial order, each under the bound
            if chunks and supergraph_memory(chunks[-1] + [child], ident, batch) <= limit:
                chunks[-1].append(child)
            else:
                chunks.append([child])
        for chunk in chunks:
            ids = [c.job.trial.id for c in chunk]
            share = _sharing(chunk, ident) if len(chunk) > 1 else None
            if share is None or not (share.params or share.buffers):
                if len(chunks) > 1:
                    log.info("supergraph: trials %s of trial %s's children train apart: with the next child the "
                             "super-graph would exceed max_unit_memory (%s)", ids, parent, _mib(limit))
                continue
            memory = supergraph_memory(chunk, ident, batch)
            unit = SuperGraphUnit([c.job for c in chunk], evaluator, memory=memory, _children=chunk)
            unit.reason += f", max_unit_memory {_mib(limit)}" + (
                f" (the group of {len(children)} children is split into {len(chunks)} parts)" if len(chunks) > 1 else "")
            units.append(unit)
            taken.update(ids)
    return units, [job for job in jobs if job.trial.id not in taken]
