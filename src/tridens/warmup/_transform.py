"""Weight transformation from a parent to an aligned child (Net2Net style).

* equal shapes are copied;
* a wider output dimension of a Linear/Conv replicates parent units (Net2WiderNet: unit j copies
  unit g(j)), and every consumer's incoming weights for a replicated unit are divided by its count,
  so the function is preserved; BatchNorm parameters and running statistics follow the same map;
  narrower layers take the first units;
* kernels of another size are centred (zero-padded around or cropped from the centre);
* an unmatched Linear/Conv whose input and output widths agree starts as the identity
  (Net2DeeperNet: identity matrix / Dirac kernel, zero bias); it preserves the function after a
  ReLU (and with 'same' padding for convs);
* anything else overlapping is copied slice-wise; what has no counterpart keeps its init.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["transfer", "replication_map"]


def replication_map(parent: int, child: int) -> torch.Tensor:
    """Index g (child,) into the parent's units: identity on the overlap, then random replicas
    (seeded by the sizes, so two layers widened alike -- residual branches -- get the same map)."""
    if child <= parent:
        return torch.arange(child)
    g = torch.Generator().manual_seed(parent * 100003 + child)
    return torch.cat([torch.arange(parent), torch.randint(0, parent, (child - parent,), generator=g)])


class _Map:
    """A channel map of a node's output: child unit j <- parent unit g[j] (-1: a new unit that keeps
    its init, whose consumers get zero incoming weights); ``counts`` per parent unit."""

    def __init__(self, g: torch.Tensor, parent_size: int):
        self.g, self.parent_size = g, parent_size
        self.counts = torch.bincount(g[g >= 0], minlength=parent_size).clamp(min=1)


def _default_index(dc: int, dp: int) -> torch.Tensor:
    idx = torch.arange(dc)
    idx[idx >= dp] = -1
    return idx


def _apply(parent_t: torch.Tensor, child_t: torch.Tensor, index: list[torch.Tensor | None],
           scale: list[torch.Tensor | None], centred: set[int]) -> torch.Tensor:
    """Child-shaped tensor: per dim an index into the parent (-1: keep the child's value; -2: zero,
    unless another dim keeps the child's value), an optional per-child-index scale, or centring
    (kernel dims)."""
    t = parent_t.detach().to(child_t.dtype)
    if t.dim() != child_t.dim():
        return child_t
    for d in sorted(centred):
        dp, dc = t.shape[d], child_t.shape[d]
        if dc >= dp:
            lo = (dc - dp) // 2
            shape = list(t.shape)
            shape[d] = dc
            z = t.new_zeros(shape)
            z.narrow(d, lo, dp).copy_(t)
            t = z
        else:
            t = t.narrow(d, (dp - dc) // 2, dc)
    mask = torch.ones(child_t.shape, dtype=torch.bool)
    zero = torch.zeros(child_t.shape, dtype=torch.bool)
    for d in range(child_t.dim()):
        if d in centred:
            continue
        idx = index[d]
        if idx is None:
            idx = _default_index(child_t.shape[d], t.shape[d])
        valid = idx.ge(0)
        t = t.index_select(d, idx.clamp(min=0))
        view = [1] * child_t.dim()
        view[d] = -1
        mask = mask & valid.view(view)
        zero = zero | idx.eq(-2).view(view)
        factor = scale[d]
        if factor is not None:
            t = t * factor.to(t.dtype).view(view)
    keep = ~mask & ~zero
    for d in range(child_t.dim()):  # an element some dim keeps is kept (a new unit's own weights)
        if d in centred:
            continue
        idx = index[d]
        if idx is None:
            idx = _default_index(child_t.shape[d], t.shape[d])
        view = [1] * child_t.dim()
        view[d] = -1
        keep = keep | idx.eq(-1).view(view)
    return torch.where(mask, t, torch.where(keep, child_t, torch.zeros_like(child_t)))


def _input_map(desc: list[dict[str, Any]], maps: dict[int, _Map | None], i: int) -> _Map | None:
    ins = desc[i].get("i") or []
    return maps.get(ins[0]) if ins else None


def _expand(m: _Map, size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(index, scale) over an incoming dim of ``size`` from a channel map (flatten: blocks)."""
    n = len(m.g)
    new = m.g < 0
    g = torch.where(new, -2, m.g)  # a new unit's outgoing weights start at zero
    scale = torch.where(new, 1.0, 1.0 / m.counts[m.g.clamp(min=0)].to(torch.float64))
    if size == n:
        return g, scale
    if n and size % n == 0:
        f = size // n
        j = torch.arange(size)
        c, s = j // f, j % f
        return torch.where(new[c], -2, g[c] * f + s), scale[c]
    return None


def transfer(child_desc: dict[str, Any], parent_desc: dict[str, Any], pairs: list[tuple[int, int]],
             parent_state: dict[str, torch.Tensor], child_state: dict[str, torch.Tensor],
             deepen: bool = True, widen: str = "replicate",
             noise: float = 0.01) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A new child state dict from the parent's, and a summary (tensors copied, widened, identity).

    ``widen`` -- how the extra units of a wider layer start; every choice keeps the parent's function:
    ``"replicate"`` (Net2WiderNet: copies of parent units, the consumers' incoming weights divided
    among the copies; exactly the same function, but under Adam copies of one unit stay copies, so
    the extra width is never used); ``"noise"`` (replicas whose incoming weights get Gaussian noise of
    ``noise`` times the layer's weight std, the function kept approximately); ``"zero"`` (the extra
    units keep their random init and their consumers' incoming weights start at zero: exactly the
    same function, and the new units learn independently)."""
    if widen not in ("replicate", "noise", "zero"):
        raise ValueError(f"The 'widen' parameter of transfer must be 'replicate', 'noise' or 'zero'. Got {widen!r} instead.")
    cn, pn = child_desc["nodes"], parent_desc["nodes"]
    match = dict(pairs)
    maps: dict[int, _Map | None] = {}
    new = dict(child_state)
    stats = {"copied": 0, "transformed": 0, "identity": 0, "inherited_elements": 0,
             "elements": sum(int(v.numel()) for v in child_state.values() if v.is_floating_point())}
    for ci, c in enumerate(cn):
        kind, key = c.get("kind"), c.get("k")
        in_map = _input_map(cn, maps, ci)
        pi = match.get(ci)
        attr = c.get("a")
        if attr is not None and pi is not None and pn[pi].get("a") in parent_state and attr in child_state:
            ct, pt = child_state[attr], parent_state[pn[pi]["a"]]
            if ct.is_floating_point() and pt.dim() == ct.dim():  # a bare parameter: overlap copy
                new[attr] = _apply(pt, ct, [None] * ct.dim(), [None] * ct.dim(), set())
                stats["transformed"] += 1
        if key is None or not c.get("s"):
            maps[ci] = in_map  # parameterless: channels pass through
            continue
        if pi is None:
            maps[ci] = in_map if kind == "bn" else None
            if deepen and kind in ("linear", "conv") and _identity(c, key, new):
                stats["identity"] += 1
                maps[ci] = in_map
            continue
        p = pn[pi]
        pkey = p.get("k")
        out_map: _Map | None = None
        for rel, shape in c["s"].items():
            ck, pk = f"{key}.{rel}", f"{pkey}.{rel}"
            if ck not in child_state or pk not in parent_state:
                continue
            ct, pt = child_state[ck], parent_state[pk]
            if pt.dim() != ct.dim():
                continue
            if not ct.is_floating_point() or ct.dim() == 0:
                new[ck] = pt.clone().to(ct.dtype) if pt.shape == ct.shape else ct
                continue
            index: list[torch.Tensor | None] = [None] * ct.dim()
            scale: list[torch.Tensor | None] = [None] * ct.dim()
            centred: set[int] = set()
            if kind in ("linear", "conv") and c.get("g", 1) == 1:
                g = replication_map(pt.shape[0], ct.shape[0])
                if widen == "zero" and ct.shape[0] > pt.shape[0]:
                    g = torch.cat([g[:pt.shape[0]], torch.full((ct.shape[0] - pt.shape[0],), -1)])
                out_map = _Map(g, pt.shape[0])
                index[0] = g
                if rel.endswith("weight") and ct.dim() >= 2 and in_map is not None:
                    ex = _expand(in_map, ct.shape[1])
                    if ex is not None and int(ex[0].max()) < pt.shape[1]:
                        index[1], scale[1] = ex
                if kind == "conv":
                    centred = set(range(2, ct.dim()))
            elif kind == "bn" and in_map is not None and ct.shape[0] == len(in_map.g) and pt.shape[0] == in_map.parent_size:
                index[0] = in_map.g
            if pt.shape == ct.shape and all(i is None for i in index) and not centred:
                new[ck] = pt.detach().clone().to(ct.dtype)
                stats["copied"] += 1
                stats["inherited_elements"] += int(ct.numel())
            else:
                new[ck] = _apply(pt, ct, index, scale, centred)
                if widen == "noise" and index[0] is not None and rel.endswith("weight") and ct.shape[0] > pt.shape[0] \
                        and kind in ("linear", "conv"):
                    gen = torch.Generator().manual_seed(pt.shape[0] * 100003 + ct.shape[0])
                    extra = new[ck][pt.shape[0]:]
                    std = float(pt.float().std()) if pt.numel() > 1 else 0.0
                    new[ck][pt.shape[0]:] = extra + noise * std * torch.randn(extra.shape, generator=gen, dtype=extra.dtype)
                stats["transformed"] += 1
                overlap = 1
                for a, b in zip(ct.shape, pt.shape):
                    overlap *= min(a, b)
                stats["inherited_elements"] += overlap
        maps[ci] = out_map if kind in ("linear", "conv") and c.get("g", 1) == 1 else in_map
    return new, stats


def _identity(c: dict[str, Any], key: str, state: dict[str, torch.Tensor]) -> bool:
    w = state.get(f"{key}.weight")
    if w is None or w.dim() < 2 or w.shape[0] != w.shape[1] or c.get("g", 1) != 1:
        return False
    if w.dim() > 2 and any(k % 2 == 0 for k in w.shape[2:]):
        return False
    eye = torch.zeros_like(w)
    if w.dim() == 2:
        eye = torch.eye(w.shape[0], dtype=w.dtype)
    else:
        torch.nn.init.dirac_(eye)
    state[f"{key}.weight"] = eye
    b = state.get(f"{key}.bias")
    if b is not None:
        state[f"{key}.bias"] = torch.zeros_like(b)
    return True
