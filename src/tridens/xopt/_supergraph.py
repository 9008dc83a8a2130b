"""Weight inheritance and the super-graph (Retiarii's third cross-model optimization, issue 5).

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

**Super-graph.** Children of one parent in one TrialGroup share, with each other, the layers they
inherited from the same parent layer. Instead of training them as independent copies, the planner
(:func:`plan_supergraph`, tried before the other optimizations) merges them into a
:class:`SuperGraphUnit`: every tensor that two or more children inherited from the same parent
tensor is stored ONCE (the children's modules hold the same ``nn.Parameter``/buffer object) and
trained jointly -- weight sharing as in Retiarii's super-graph and in ENAS/SPOS, where each
model's step trains the shared weights. The children read one data pipeline (the unit is a
:class:`~tridens.xopt._cse.SharedPipelineUnit`); per batch each child, in trial order, takes its own
optimizer step (its own optimizer, learning-rate schedule and random stream) on the shared batch,
so the next child sees the shared weights just updated. This is exactly what passing the shared
weights from model to model through checkpoints after every batch would compute, without the
checkpoints.

One child per architecture joins a super-graph: siblings of the same architecture (a learning-rate
mutation) would share every inherited layer, so the later ones train apart from the parent's weights.

Per-trial guarantees: metrics are reported for every child every epoch; a child whose loss turns
NaN/inf fails before its step (the trainer checks the loss before ``backward``), so that step
never reaches the shared tensors (a diverging child's earlier finite steps do); a child that is stopped or fails leaves the unit at the end of an
epoch -- the others keep their optimizer states, data order and shared tensors, and their results
up to that epoch are exactly those of the run in which nobody left (later, the shared layers are
trained by the remaining children only: that is what joint training means). Each child's
checkpoint is its whole model's ``state_dict`` (the shared tensors' values at that moment).

Measured (BENCHMARKS.md, "Weight inheritance"): on a 2-core CPU with small CNNs the merged unit is
not faster per child than children inherited through the checkpoint and trained apart (the
per-child inheritance, ~3% of a child's time, is still paid: the engine materializes children
before planning; sequential steps on shared tensors share no computation), and joint training
lowers the children's mean accuracy. The tying itself is hand-written (module attribute
replacement): no library offers weight tying across separately built models. Not yet: a memory
estimate for ``max_unit_memory``.

>>> td.Experiment(space, evaluator, td.strategy.RegularizedEvolution(inherit_weights=True))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn

from ..engine._execution import Job
from ..engine._units import ExecutionUnit
from ..evaluators._base import StepwiseEvaluator
from ..evaluators._supervised import _Supervised
from ._cse import SharedPipelineUnit, _pipeline_key

__all__ = ["ENABLED", "shared_tensors", "inherit", "inherit_from_trial", "SuperGraphUnit", "plan_supergraph"]

log = logging.getLogger("tridens")

#: Whether the planner merges children of one parent into a super-graph (the benchmark turns it
#: off to compare with children trained apart, each from the parent's checkpoint).
ENABLED = True

_DESCRIPTIONS: "OrderedDict[tuple[str, int], dict[str, Any]]" = OrderedDict()  # parents' IR descriptions
_CACHE_SIZE = 64


def _join(prefix: str | None, rel: str) -> str:
    return f"{prefix}.{rel}" if prefix else rel


def shared_tensors(child_desc: Mapping[str, Any], parent_desc: Mapping[str, Any]) -> dict[str, str]:
    """``{child state_dict key: parent state_dict key}`` for every tensor of the layers the child
    shares exactly with the parent: nodes paired by :func:`tridens.warmup.align` with the same
    type and identical state shapes (descriptions from :func:`tridens.warmup.describe`).

    >>> from tridens.warmup import describe
    >>> shared_tensors(describe(child, x), describe(parent, x))     # doctest: +SKIP
    {'conv.weight': 'conv.weight', 'conv.bias': 'conv.bias', ...}
    """
    from ..warmup import align

    cn, pn = child_desc["nodes"], parent_desc["nodes"]
    if not cn or not pn:
        return {}
    _score, pairs = align(dict(child_desc), dict(parent_desc))
    out: dict[str, str] = {}
    for ci, pi in pairs:
        c, p = cn[ci], pn[pi]
        if c.get("t") != p.get("t"):
            continue
        if c.get("k") is not None and p.get("k") is not None and c.get("s") and c["s"] == p.get("s"):
            for rel in c["s"]:
                out.setdefault(_join(c["k"], rel), _join(p["k"], rel))
        elif c.get("a") is not None and p.get("a") is not None and c.get("p") and c.get("p") == p.get("p"):
            out.setdefault(c["a"], p["a"])
    return out


def inherit(model: nn.Module, parent_state: Mapping[str, torch.Tensor], child_desc: Mapping[str, Any],
            parent_desc: Mapping[str, Any]) -> dict[str, Any]:
    """Copy the parent's tensors of the shared layers into ``model`` (in place, exact) and say what
    was inherited: ``tensors``, ``elements`` (floating-point elements copied), ``fraction`` (of the
    child's floating-point elements) and ``shared`` (child key -> parent key)."""
    state = model.state_dict(keep_vars=True)
    copied: dict[str, str] = {}
    with torch.no_grad():
        for ck, pk in shared_tensors(child_desc, parent_desc).items():
            target, source = state.get(ck), parent_state.get(pk)
            if target is None or source is None or tuple(target.shape) != tuple(source.shape):
                continue
            if target.dtype != source.dtype and not (target.is_floating_point() and source.is_floating_point()):
                continue
            target.copy_(source.to(device=target.device, dtype=target.dtype))
            copied[ck] = pk
    total = sum(int(t.numel()) for t in state.values() if t.is_floating_point())
    elements = sum(int(state[k].numel()) for k in copied if state[k].is_floating_point())
    return {"tensors": len(copied), "elements": elements, "fraction": (elements / total) if total else 0.0,
            "shared": copied}


def _describe(model: nn.Module, inputs: Any) -> dict[str, Any]:
    from ..warmup import describe

    on_meta = any(p.is_meta for p in model.parameters())
    if inputs is not None and on_meta:
        inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return describe(model, inputs)


def _parent_description(store_path: str, space: Any, parent: Any) -> dict[str, Any]:
    """The parent's IR description, from its structure built on the meta device (no weights
    initialised); cached per (store, trial)."""
    key = (store_path, parent.id)
    if key in _DESCRIPTIONS:
        _DESCRIPTIONS.move_to_end(key)
        return _DESCRIPTIONS[key]
    structure = space.freeze(space.restrict(parent.sample), check=False, device="meta")
    desc = _describe(structure, space.example_inputs)
    _DESCRIPTIONS[key] = desc
    while len(_DESCRIPTIONS) > _CACHE_SIZE:
        _DESCRIPTIONS.popitem(last=False)
    return desc


def inherit_from_trial(store: Any, space: Any, trial: Any, model: nn.Module) -> dict[str, Any]:
    """Load the trained weights of ``trial.parent`` (its checkpoint in ``store``) into ``model``
    for the layers they share; returns the record kept in ``trial.info["inherit"]``. Never raises:
    a parent without a checkpoint, or a model that cannot be matched, leaves ``model`` as
    initialised and the record says why (``reason``). ``seconds`` is the time it took. The torch
    random state is left untouched."""
    info: dict[str, Any] = {"parent": trial.parent}
    rng = torch.get_rng_state()
    t0 = time.perf_counter()
    try:
        parent = store.trial(trial.parent)
        if parent.checkpoint is None:
            info["reason"] = f"parent trial {parent.id} has no checkpoint ({parent.status.value})"
            return info
        parent_state = store.load_checkpoint(parent.checkpoint)
        parent_desc = _parent_description(str(store.path), space, parent)
        child_desc = _describe(model, space.example_inputs)
        if child_desc.get("opaque") or parent_desc.get("opaque"):
            # an opaque node is matched whole: still exact, usually all or nothing
            info["opaque"] = child_desc.get("opaque") or parent_desc.get("opaque")
        info.update(inherit(model, parent_state, child_desc, parent_desc))
    except Exception as err:  # inheritance is a head start: the child's own init is always valid
        info["reason"] = f"{type(err).__name__}: {err}"
    finally:
        torch.set_rng_state(rng)
        info["seconds"] = time.perf_counter() - t0  # checkpoint read + matching + copy
    if "reason" in info:
        log.info("trial %s: nothing inherited from trial %s (%s)", trial.id, trial.parent, info["reason"])
    return info


# ------------------------------------------------------------------------------------------------
# the super-graph unit
# ------------------------------------------------------------------------------------------------
def _slot(model: nn.Module, key: str) -> tuple[nn.Module, str, str] | None:
    """(owning module, attribute name, 'param'|'buffer') of a state_dict key, or None."""
    prefix, _, name = key.rpartition(".")
    try:
        module = model.get_submodule(prefix) if prefix else model
    except AttributeError:
        return None
    if name in module._parameters and module._parameters[name] is not None:
        return module, name, "param"
    if name in module._buffers and module._buffers[name] is not None:
        return module, name, "buffer"
    return None


def _tensor(slot: tuple[nn.Module, str, str]) -> torch.Tensor:
    module, name, kind = slot
    return module._parameters[name] if kind == "param" else module._buffers[name]  # type: ignore[return-value]


def _tie(jobs: Sequence[Job]) -> dict[str, list[int]]:
    """Make every parent tensor that several jobs inherited ONE tensor held by all their models.
    Returns {parent key: ids of the trials sharing it}. A tensor is tied only where the copies
    are still equal (they all came from the parent) and of the same kind and shape."""
    owners: dict[str, tuple[torch.Tensor, str]] = {}
    users: dict[str, list[int]] = {}
    for job in jobs:
        model = job.model
        assert isinstance(model, nn.Module)
        seen: set[str] = set()  # one child key per parent key: never tie two layers of one child
        for ck, pk in (job.trial.info.get("inherit") or {}).get("shared", {}).items():
            if pk in seen:
                continue
            slot = _slot(model, ck)
            if slot is None:
                continue
            seen.add(pk)
            tensor = _tensor(slot)
            if pk not in owners:
                owners[pk] = (tensor, slot[2])
                users[pk] = [job.trial.id]
                continue
            owner, kind = owners[pk]
            if kind != slot[2] or owner.shape != tensor.shape or owner.dtype != tensor.dtype or \
                    owner.device != tensor.device or not torch.equal(owner.detach(), tensor.detach()):
                continue
            module, name, _ = slot
            if kind == "param":
                module._parameters[name] = owner  # type: ignore[assignment]
            else:
                module._buffers[name] = owner
            users[pk].append(job.trial.id)
    return {pk: ids for pk, ids in users.items() if len(ids) > 1}


class SuperGraphUnit(SharedPipelineUnit):
    """Children of one parent trained merged: the tensors they inherited from the same parent
    tensor are stored once and trained jointly; one data pipeline; per-trial metrics, stops and
    failures as in any unit (see the module docstring).

    >>> unit = SuperGraphUnit(jobs, evaluator)          # doctest: +SKIP
    >>> unit.jobs[a].model.conv.weight is unit.jobs[b].model.conv.weight      # doctest: +SKIP
    True
    """

    kind = "supergraph"

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, *, reason: str = ""):
        # Tie before the trainers exist: each child's optimizer must hold the shared objects.
        self.shared = _tie(jobs)
        parents = {(job.trial.info.get("inherit") or {}).get("parent") for job in jobs}
        self.parent = next(iter(parents)) if len(parents) == 1 else None
        stored_once = 0
        for pk, ids in self.shared.items():
            job = next(j for j in jobs if j.trial.id == ids[0])
            ck = next(c for c, p in job.trial.info["inherit"]["shared"].items() if p == pk)
            stored_once += int(_tensor(_slot(job.model, ck)).numel()) * (len(ids) - 1)  # type: ignore[arg-type]
        self.saved_elements = stored_once
        for job in jobs:
            mine = [pk for pk, ids in self.shared.items() if job.trial.id in ids]
            job.trial.info.setdefault("inherit", {})["merged"] = {
                "unit": [j.trial.id for j in jobs], "tensors": len(mine)}
        if not reason:
            reason = (f"children of trial {self.parent}: {len(self.shared)} inherited tensor(s) stored once "
                      f"({stored_once} elements not duplicated), trained jointly on one pipeline")
        super().__init__(jobs, evaluator, reason=reason)


def plan_supergraph(jobs: Sequence[Job], evaluator: StepwiseEvaluator) -> tuple[list[ExecutionUnit], list[Job]]:
    """Merge the children of one parent (``trial.info["inherit"]``) that read the same data
    pipeline and share inherited tensors with each other into :class:`SuperGraphUnit` s; return
    the units and the jobs left for the other optimizations. One child per architecture (graph
    fingerprint) joins a super-graph: siblings of the same architecture -- a mutation of the
    learning rate only -- would share all their inherited layers and hide the hyperparameter's
    effect, so the others train apart (each still from the parent's weights). Only the
    declarative supervised evaluators are merged (the engine owns their training loop)."""
    if not ENABLED or not isinstance(evaluator, _Supervised):
        return [], list(jobs)
    groups: dict[tuple[Any, ...], list[Job]] = {}
    for job in jobs:
        record = job.trial.info.get("inherit") or {}
        if not isinstance(job.model, nn.Module) or not record.get("shared"):
            continue
        try:
            cfg = evaluator.config(job.trial.sample)
        except Exception:  # the separate unit reports it as the trial's failure
            continue
        groups.setdefault((record.get("parent"), _pipeline_key(cfg, job.trial.seed)), []).append(job)
    units: list[ExecutionUnit] = []
    taken: set[int] = set()
    for (parent, _key), candidates in groups.items():
        group: list[Job] = []
        architectures: dict[str, int] = {}
        for job in candidates:
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
            group.append(job)
        if len(group) < 2:
            continue
        counts: dict[str, int] = {}
        for job in group:
            for pk in set(job.trial.info["inherit"]["shared"].values()):
                counts[pk] = counts.get(pk, 0) + 1
        if not any(n > 1 for n in counts.values()):
            log.info("supergraph: the children %s of trial %s share no inherited layer with each other",
                     [j.trial.id for j in group], parent)
            continue
        units.append(SuperGraphUnit(group, evaluator))
        taken.update(j.trial.id for j in group)
    return units, [job for job in jobs if job.trial.id not in taken]
