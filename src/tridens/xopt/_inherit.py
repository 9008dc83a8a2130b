"""Weight inheritance: a child starts from its parent's trained weights for the layers they share.

Layers are matched through the graph IR with the ModelKeeper alignment of :mod:`tridens.warmup`;
a matched pair is *shared* when both nodes have the same type and identical state shapes, and a
shared layer's tensors are copied exactly. The engine calls :func:`inherit_from_trial` while it
materializes a child; what was inherited is recorded in ``trial.info["inherit"]``.
"""

from __future__ import annotations


import logging
import time
import warnings
from typing import Any, Mapping

import torch
import torch.nn as nn

from ..units import Decisions

log = logging.getLogger("tridens")


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


def _parent_description(space: Any, parent: Any) -> dict[str, Any]:
    """The parent's IR description, from its structure built on the meta device (no weights
    initialised)."""
    structure = space.freeze(space.restrict(parent.sample), check=False, device="meta")
    return _describe(structure, space.example_inputs)


def inherit_from_trial(store: Any, space: Any, trial: Any, model: nn.Module, decisions: Decisions | None = None
                       ) -> dict[str, Any]:
    """Load the trained weights of ``trial.parent`` (its checkpoint in ``store``) into ``model``
    for the layers they share; returns the record kept in ``trial.info["inherit"]``. Never raises:
    a parent without a checkpoint, or a model that cannot be matched, leaves ``model`` as
    initialised and the record says why (``reason``). ``seconds`` is the time it took. The torch
    random state is left untouched. ``decisions``: the run's, which keep parents' descriptions."""
    info: dict[str, Any] = {"parent": trial.parent}
    rng = torch.get_rng_state()
    t0 = time.perf_counter()
    try:
        parent = store.trial(trial.parent)
        info["parent_number"] = parent.label
        if parent.checkpoint is None:
            info["reason"] = f"parent trial {parent.label} has no checkpoint ({parent.status.value})"
            return info
        parent_state = store.load_checkpoint(parent.checkpoint)
        parent_desc = (decisions or Decisions()).description(
            (str(store.path), parent.id), lambda: _parent_description(space, parent))  # kept per run
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
