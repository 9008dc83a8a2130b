"""Graph alignment (ModelKeeper): a DP over (parent prefix, child prefix) of the topologically
ordered IR nodes.

MATCH(c, p) scores the fraction of the child node's weight elements that can be inherited:
sum over its parameters of prod(min(dc, dp)) / sum of prod(dc) -- partial overlaps count in
proportion (no integer division), a type or rank mismatch scores 0 (no match); parameterless nodes
of the same type score 1. SKIP a child node costs 0 (it keeps its init), SKIP a parent node -1.
Score = DP total / child nodes, clamped to [0, 1]. Identical graphs score 1.

Matching a child against many parents is batched: every zoo entry is a padded array (types and
parameter dims), the score matrices of all entries are computed in one broadcast and the DP runs
row by row (child nodes) over all entries and parent columns at once; the SKIP-parent chain inside
a row is a running maximum (``max.accumulate(A + j) - j``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["Encoded", "encode", "node_score", "score", "scores", "align"]

P_MAX, R_MAX = 4, 5  # parameters per node and dims per parameter kept for scoring
_VOCAB: dict[str, int] = {}


def _type_id(name: str) -> int:
    return _VOCAB.setdefault(name, len(_VOCAB))


class _Signatures:
    """Every distinct node signature (type, parameter shapes) seen in this process gets an id. A zoo
    holds few distinct signatures (a ResNet has ~20, a search space a few hundred), so the
    (entries, child nodes, parent nodes) match matrix is a gather from a small (child signatures x
    zoo signatures) table instead of shape arithmetic on every node pair. Only the signatures are
    kept (linear in their number), not a table of all pairs."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.types = np.zeros(0, dtype=np.int64)
        self.dims = np.zeros((0, P_MAX, R_MAX))
        self.ranks = np.zeros((0, P_MAX), dtype=np.int64)

    def id(self, type_id: int, dims: np.ndarray, ranks: np.ndarray) -> int:
        key = (type_id, dims.tobytes(), ranks.tobytes())
        sid = self.ids.get(key)
        if sid is None:
            sid = self.ids[key] = len(self.ids)
            self.types = np.append(self.types, type_id)
            self.dims = np.concatenate([self.dims, dims[None]])
            self.ranks = np.concatenate([self.ranks, ranks[None]])
        return sid

    def table(self, child: np.ndarray, parent: np.ndarray) -> np.ndarray:
        """(len(child) + 1, len(parent) + 1) MATCH scores of signature ids; the last row and column
        (index -1, padding) are 0."""
        out = np.zeros((len(child) + 1, len(parent) + 1))
        if len(child) and len(parent):
            c, p = np.repeat(child, len(parent)), np.tile(parent, len(child))
            out[:-1, :-1] = _pair_scores(c, p, self).reshape(len(child), len(parent))
        return out


def _pair_scores(c: np.ndarray, p: np.ndarray, sig: "_Signatures") -> np.ndarray:
    """MATCH score of signature c[k] (child) against p[k] (parent), vectorized."""
    same = sig.types[c] == sig.types[p]
    cd, pd = sig.dims[c], sig.dims[p]                                            # (K, P, R)
    total = cd.prod(axis=-1).sum(axis=-1)
    inter = np.minimum(cd, pd).prod(axis=-1)
    inter = np.where(sig.ranks[c] == sig.ranks[p], inter, 0.0).sum(axis=-1)
    frac = np.where(total > 0, inter / np.where(total > 0, total, 1.0), 1.0)  # parameterless: 1
    return np.where(same, frac, 0.0)


_SIGS = _Signatures()


class Encoded:
    """A description as arrays: ``types`` (m,), ``dims`` (m, P, R) (0 for an absent parameter,
    1 for an absent dim), ``ranks`` (m, P), ``has_params`` (m,)."""

    __slots__ = ("types", "dims", "ranks", "n", "sig", "order", "_branched")

    def __init__(self, desc: dict[str, Any]):
        nodes = desc["nodes"]
        m = len(nodes)
        self.n = m
        self.types = np.array([_type_id(nd["t"]) for nd in nodes], dtype=np.int64)
        self.dims = np.ones((m, P_MAX, R_MAX), dtype=np.float64)
        self.ranks = np.full((m, P_MAX), -1, dtype=np.int64)
        for i, nd in enumerate(nodes):
            params = nd.get("p") or []
            for j in range(P_MAX):
                if j < len(params):
                    shape = params[j][:R_MAX]
                    self.dims[i, j, :len(shape)] = shape
                    self.ranks[i, j] = len(params[j])
                else:
                    self.dims[i, j, :] = 0
        self.sig = np.array([_SIGS.id(int(self.types[i]), self.dims[i], self.ranks[i]) for i in range(m)], dtype=np.int64)
        self.order = _branch_order(nodes, self.dims)
        self._branched: Encoded | None = None

    def branched(self) -> "Encoded":
        """The same nodes in the branch-canonical topological order (:func:`_branch_order`)."""
        if self._branched is None:
            if np.array_equal(self.order, np.arange(self.n)):
                self._branched = self
            else:
                e = Encoded.__new__(Encoded)
                e.n, e.order, e._branched = self.n, np.arange(self.n), None
                e.types, e.dims, e.ranks, e.sig = (self.types[self.order], self.dims[self.order],
                                                   self.ranks[self.order], self.sig[self.order])
                e._branched = e
                self._branched = e
        return self._branched


def _branch_order(nodes: list[dict[str, Any]], dims: np.ndarray) -> np.ndarray:
    """A topological order in which the branches leaving a node come one after the other, the
    heaviest first (parameter elements along the branch's chain, then its length), whatever order
    the model's code ran them in. Two models whose code computes a residual block's shortcut
    before or after its main path get the same order, so a monotone alignment can match both
    branches (the source order would let it match only one)."""
    n = len(nodes)
    preds = [sorted({i for i in (nd.get("i") or []) if 0 <= i < n}) for nd in nodes]
    succs: list[list[int]] = [[] for _ in range(n)]
    for j, ps in enumerate(preds):
        for q in ps:
            succs[q].append(j)
    mass = np.where(dims.prod(axis=-1) > 0, dims.prod(axis=-1), 0).sum(axis=-1)

    def key(start: int) -> tuple[float, int, int]:
        weight, length, u = 0.0, 0, start
        while True:  # along the chain: one successor that has one input
            weight += float(mass[u])
            length += 1
            if len(succs[u]) != 1 or len(preds[succs[u][0]]) != 1:
                break
            u = succs[u][0]
        return (-weight, -length, start)

    indeg = [len(ps) for ps in preds]
    stack = sorted((j for j in range(n) if indeg[j] == 0), key=lambda j: -j)  # sources in source order
    out: list[int] = []
    while stack:
        u = stack.pop()
        out.append(u)
        ready = []
        for v in succs[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
        stack.extend(sorted(ready, key=key, reverse=True))  # the heaviest branch is popped first
    if len(out) != n:  # not a DAG (cannot happen for a traced graph): keep the source order
        return np.arange(n)
    return np.array(out, dtype=np.int64)


def encode(desc: dict[str, Any]) -> Encoded:
    return Encoded(desc)


def _match_matrix(child: Encoded, types: np.ndarray, dims: np.ndarray, ranks: np.ndarray,
                  tie_break: bool = False) -> np.ndarray:
    """(E, n, M) MATCH scores of each child node against each parent node of each entry. Only the
    same-type pairs of child nodes with parameters get the (P, R) shape arithmetic."""
    same = child.types[None, :, None] == types[:, None, :]                       # (E, n, M)
    out = same.astype(np.float64)                                                # parameterless: 1
    total = child.dims.prod(axis=-1).sum(axis=-1)                                 # (n,)
    with_params = np.flatnonzero(total > 0)
    if len(with_params) == 0:
        return out
    e, r, j = np.nonzero(same[:, with_params, :])
    i = with_params[r]
    cd, pd = child.dims[i], dims[e, j]                                           # (K, P, R)
    inter = np.minimum(cd, pd).prod(axis=-1)                                      # (K, P)
    inter = np.where(child.ranks[i] == ranks[e, j], inter, 0.0).sum(axis=-1)
    frac = inter / total[i]
    if tie_break:  # equal dims break ties between equally inheritable matches (align only)
        eq = (cd == pd) & (cd > 0)
        frac = np.where(frac > 0, frac + 1e-3 * (eq.all(axis=-1).mean(axis=-1) + eq.mean(axis=(-1, -2))), frac)
    out[e, i, j] = frac
    return out


def node_score(child_node: dict[str, Any], parent_node: dict[str, Any]) -> float:
    """MATCH score of one child node against one parent node."""
    c, p = Encoded({"nodes": [child_node]}), Encoded({"nodes": [parent_node]})
    return float(_match_matrix(c, p.types[None], p.dims[None], p.ranks[None])[0, 0, 0])


def _dp(S: np.ndarray) -> np.ndarray:
    """Full DP tables (E, n+1, M+1) for match matrices S (E, n, M)."""
    E, n, M = S.shape
    D = np.empty((E, n + 1, M + 1))
    idx = np.arange(M + 1, dtype=np.float64)
    D[:, 0, :] = -idx
    for i in range(1, n + 1):
        prev = D[:, i - 1, :]
        A = prev.copy()
        diag = np.where(S[:, i - 1, :] > 0, prev[:, :-1] + S[:, i - 1, :], -np.inf)
        A[:, 1:] = np.maximum(A[:, 1:], diag)
        D[:, i, :] = np.maximum.accumulate(A + idx, axis=1) - idx
    return D


def _dp_last(S: np.ndarray) -> np.ndarray:
    """Last DP row (E, M+1) only (no table kept)."""
    E, n, M = S.shape
    idx = np.arange(M + 1, dtype=np.float64)
    row = np.broadcast_to(-idx, (E, M + 1)).copy()
    for i in range(n):
        A = row.copy()
        np.maximum(A[:, 1:], np.where(S[:, i, :] > 0, row[:, :-1] + S[:, i, :], -np.inf), out=A[:, 1:])
        row = np.maximum.accumulate(A + idx, axis=1) - idx
    return row


class Batch:
    """Padded arrays of many encoded parents, for :func:`scores`."""

    def __init__(self, encoded: Sequence[Encoded]):
        M = max((e.n for e in encoded), default=1)
        E = len(encoded)
        self.lengths = np.array([e.n for e in encoded], dtype=np.int64)
        self.types = np.full((E, M), -1, dtype=np.int64)
        self.dims = np.zeros((E, M, P_MAX, R_MAX))
        self.ranks = np.full((E, M, P_MAX), -2, dtype=np.int64)
        self.sig = np.full((E, M), -1, dtype=np.int64)  # -1: padding (scores 0 against anything)
        self.sig_branched = np.full((E, M), -1, dtype=np.int64)
        for k, e in enumerate(encoded):
            self.types[k, :e.n] = e.types
            self.dims[k, :e.n] = e.dims
            self.ranks[k, :e.n] = e.ranks
            self.sig[k, :e.n] = e.sig
            self.sig_branched[k, :e.n] = e.branched().sig
        self.any_branched = any(e.branched() is not e for e in encoded)
        # the distinct signatures of the batch, and each node as an index into them (-1: padding)
        self.uniq = np.unique(self.sig[self.sig >= 0])
        self.inv = np.where(self.sig >= 0, np.searchsorted(self.uniq, self.sig), -1)
        self.inv_branched = np.where(self.sig_branched >= 0, np.searchsorted(self.uniq, self.sig_branched), -1)


def scores(child: Encoded, batch: Batch, budget: int = 4_000_000, branches: bool = True) -> np.ndarray:
    """Alignment score of ``child`` against every parent of ``batch`` (E,); entries are scored in
    chunks of about ``budget`` elements of the (entries, child, parent) match matrices.
    ``branches``: also align both graphs in their branch-canonical order and keep the better score
    (the branches of a node are aligned with each other whatever order the code ran them in)."""
    if child.n == 0 or len(batch.lengths) == 0:
        return np.zeros(len(batch.lengths))
    cu = np.unique(child.sig)
    table = _SIGS.table(cu, batch.uniq)
    out = _scores(np.searchsorted(cu, child.sig), child.n, batch.inv, batch, table, budget)
    if branches and (batch.any_branched or child.branched() is not child):
        out = np.maximum(out, _scores(np.searchsorted(cu, child.branched().sig), child.n, batch.inv_branched,
                                      batch, table, budget))
    return out


def _scores(child_idx: np.ndarray, n: int, parent_idx: np.ndarray, batch: Batch, table: np.ndarray,
            budget: int) -> np.ndarray:
    out = np.zeros(len(batch.lengths))
    child_n = n
    if child_n == 0:
        return out
    width = max(int(batch.lengths.max()) if len(out) else 1, 1)
    chunk = max(1, budget // (child_n * width))
    for a in range(0, len(out), chunk):
        b = min(a + chunk, len(out))
        M = int(batch.lengths[a:b].max())
        S = table[child_idx[None, :, None], parent_idx[a:b, None, :M]]          # (E, n, M) gather
        last = _dp_last(S)
        out[a:b] = last[np.arange(b - a), batch.lengths[a:b]] / child_n
    return np.clip(out, 0.0, 1.0)


def score(child: dict[str, Any] | Encoded, parent: dict[str, Any] | Encoded, *, branches: bool = True) -> float:
    """Alignment score of one child description against one parent description."""
    c = child if isinstance(child, Encoded) else Encoded(child)
    p = parent if isinstance(parent, Encoded) else Encoded(parent)
    return float(scores(c, Batch([p]), branches=branches)[0])


def align(child: dict[str, Any] | Encoded, parent: dict[str, Any] | Encoded, *,
          branches: bool = True) -> tuple[float, list[tuple[int, int]]]:
    """(score, matched (child index, parent index) pairs) by DP traceback. ``branches``: also align
    the branch-canonical orders and keep the better alignment (pairs are in the descriptions'
    node indices either way)."""
    c = child if isinstance(child, Encoded) else Encoded(child)
    p = parent if isinstance(parent, Encoded) else Encoded(parent)
    if c.n == 0:
        return 0.0, []
    best = _align(c, p)
    if branches and (c.branched() is not c or p.branched() is not p):
        s, pairs = _align(c.branched(), p.branched())
        if s > best[0] + 1e-12:
            best = s, sorted((int(c.order[a]), int(p.order[b])) for a, b in pairs)
    return best


def _align(c: Encoded, p: Encoded) -> tuple[float, list[tuple[int, int]]]:
    S0 = _match_matrix(c, p.types[None], p.dims[None], p.ranks[None])[0]
    S = _match_matrix(c, p.types[None], p.dims[None], p.ranks[None], tie_break=True)
    D = _dp(S)[0]
    S = S[0]
    i, j = c.n, p.n
    pairs: list[tuple[int, int]] = []
    while i > 0 and j > 0:
        if S[i - 1, j - 1] > 0 and np.isclose(D[i, j], D[i - 1, j - 1] + S[i - 1, j - 1]):
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif np.isclose(D[i, j], D[i - 1, j]):
            i -= 1
        else:
            j -= 1
    pairs.reverse()
    total = sum(S0[a, b] for a, b in pairs) - (p.n - len(pairs))
    return float(np.clip(total / c.n, 0.0, 1.0)), pairs
