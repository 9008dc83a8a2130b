"""Vectorized optimizers: SGD, Adam, AdamW and RMSprop over stacked parameters, each model with its
own lr, momentum (Adam's beta1) and weight decay, bit for bit what ``torch.optim`` gives each
model alone.

Exactness: a stacked parameter ``(K, *shape)`` is updated through its K row views, each shaped
and laid out as the separate model's parameter, by the same elementwise operations, in the same
order and with the same Python-float scalars as ``torch.optim``'s update of that parameter
(``_single_tensor_*`` on CPU; the ``foreach`` form on CUDA is the same operations). The
operations are ``torch._foreach_*`` calls over every row view at once: on CPU each runs the
per-tensor kernel on each view, so each element sees the kernel, the scalar and the position in
its tensor (vectorized body or scalar tail, which may round differently where the compiler fused
a multiply-add) that separate training gives it. Scalars that differ per model are passed as
per-tensor lists, or the views are grouped by value where ``torch`` takes one scalar (``alpha=``,
``lerp``'s weight).

Why not flatter: one elementwise pass over all parameters with per-element hyperparameter vectors
(or torch's fused Adam kernel at lr 1, scaled per model after) computes the same rule with
different rounding -- ``p.add_(g, alpha=-lr)`` is one multiply-add, a product with a vector of lrs
followed by an add is two roundings. Adam and RMSprop divide by the root of a running square:
where a gradient is pure rounding noise (a bias before BatchNorm, whose true gradient is zero),
that noise becomes a step of about ``lr`` in its sign, so a one-ulp difference turns into an
lr-sized one within a step and training diverges from the separate run.

Stacked where that is the same arithmetic: an elementwise kernel computes each element alone,
so an operation on the whole ``(K, *shape)`` tensor gives each row what it gives the row view,
provided its vectorized body and its scalar tail round alike (then an element's result does not
depend on where in its tensor it lies). Where that holds on this build and device
(:func:`stacked_update_is_exact` checks it once per dtype and device, on rows of odd lengths
that put every element in the body in one form and in the tail in the other), an operation whose
scalar is the same for every model runs once on the stacked tensor, and one whose scalar differs
per model takes the K scalars as a ``(K, 1, ...)`` column where the kernel does the same single
rounding with a tensor operand: ``p.addcmul_(d, column)`` for ``p.add_(d, alpha=s)`` (both one
multiply-add), ``p.mul_(column)``, ``lerp_`` with a column of weights, and ``p.addcdiv_(a, b,
value=s)`` as ``p.add_(a * column / b)`` (the kernel computes ``p + s * a / b``: the division
keeps the product out of a multiply-add, so three roundings either way). Everything else, and
everything where the check fails, goes through the row views.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Sequence

import torch

from ..evaluators import TrainConfig

_ADAPTIVE = ("adam", "adamw", "rmsprop")
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _columns(values: Sequence[float], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The K per-model ``values`` as a ``(K, 1, ...)`` column expanded to each stacked tensor of
    ``like`` (its dtype and device: the value converted as torch converts a Python scalar)."""
    base = torch.tensor(values, dtype=like[0].dtype, device=like[0].device)
    return [base.view(-1, *[1] * (t.dim() - 1)).expand_as(t) for t in like]


def _addcdiv_by_columns(ps: list[torch.Tensor], a: list[torch.Tensor] | tuple[torch.Tensor, ...],
                        b: list[torch.Tensor] | tuple[torch.Tensor, ...],
                        columns: list[torch.Tensor]) -> None:
    """``p.addcdiv_(a, b, value=s)`` with a scalar per row: ``p + (s * a) / b``, the kernel's
    order, as three operations."""
    update = torch._foreach_mul(a, columns)
    torch._foreach_div_(update, b)
    torch._foreach_add_(ps, update)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(_BITS[a.element_size()]),
                                              b.contiguous().view(_BITS[b.element_size()]))


# Each stacked form the update uses beside the per-row form it stands for (the row views' form,
# as torch.optim runs it on a separate model's tensor): ``(name, stacked(t), per_row(rows))`` where
# ``t`` are the operands stacked ``(K, n)`` and ``rows`` their K row views, ``s`` a scalar per row,
# ``w`` a lerp weight per row (either side of 0.5).
_StackedForm = Callable[[list[torch.Tensor], list[float], list[float]], object]
_PerRowForm = Callable[[list[list[torch.Tensor]], list[float], list[float]], object]
_STACKED_FORMS: list[tuple[str, _StackedForm, _PerRowForm]] = [
    ("mul", lambda t, s, w: torch._foreach_mul_(t[:1], 0.999),
     lambda r, s, w: torch._foreach_mul_(r[0], 0.999)),
    ("mul by a column", lambda t, s, w: torch._foreach_mul_(t[:1], _columns(s, t[:1])),
     lambda r, s, w: torch._foreach_mul_(r[0], s)),
    ("addcmul", lambda t, s, w: torch._foreach_addcmul_(t[:1], t[1:2], t[1:2], value=1 - 0.999),
     lambda r, s, w: torch._foreach_addcmul_(r[0], r[1], r[1], value=1 - 0.999)),
    ("sqrt", lambda t, s, w: t[0].copy_(torch._foreach_sqrt(t[2:3])[0]),
     lambda r, s, w: [a.copy_(b) for a, b in zip(r[0], torch._foreach_sqrt(r[2]))]),
    ("div", lambda t, s, w: torch._foreach_div_(t[:1], [(1 - 0.999 ** 7.0) ** 0.5]),
     lambda r, s, w: torch._foreach_div_(r[0], [(1 - 0.999 ** 7.0) ** 0.5] * len(r[0]))),
    ("add a scalar", lambda t, s, w: torch._foreach_add_(t[:1], 1e-8),
     lambda r, s, w: torch._foreach_add_(r[0], 1e-8)),
    ("add", lambda t, s, w: torch._foreach_add_(t[:1], t[1:2]),
     lambda r, s, w: torch._foreach_add_(r[0], r[1])),
    ("add with alpha", lambda t, s, w: torch._foreach_add_(t[:1], t[1:2], alpha=-0.003),
     lambda r, s, w: torch._foreach_add_(r[0], r[1], alpha=-0.003)),
    ("addcmul by a column for add with alpha", lambda t, s, w: torch._foreach_addcmul_(t[:1], t[1:2], _columns(s, t[:1])),
     lambda r, s, w: [torch._foreach_add_([a], [b], alpha=v) for a, b, v in zip(r[0], r[1], s)]),
    ("lerp", lambda t, s, w: torch._foreach_lerp_(t[:1], t[1:2], 1 - 0.9),
     lambda r, s, w: torch._foreach_lerp_(r[0], r[1], 1 - 0.9)),
    ("lerp past 0.5", lambda t, s, w: torch._foreach_lerp_(t[:1], t[1:2], 1 - 0.3),
     lambda r, s, w: torch._foreach_lerp_(r[0], r[1], 1 - 0.3)),
    ("lerp by a column", lambda t, s, w: torch._foreach_lerp_(t[:1], t[1:2], _columns(w, t[:1])),
     lambda r, s, w: [torch._foreach_lerp_([a], [b], v) for a, b, v in zip(r[0], r[1], w)]),
    ("addcdiv", lambda t, s, w: torch._foreach_addcdiv_(t[:1], t[1:2], t[2:3]),
     lambda r, s, w: torch._foreach_addcdiv_(r[0], r[1], r[2])),
    ("addcdiv by a scalar", lambda t, s, w: torch._foreach_addcdiv_(t[:1], t[1:2], t[2:3], [-0.003]),
     lambda r, s, w: torch._foreach_addcdiv_(r[0], r[1], r[2], [-0.003] * len(r[0]))),
    ("addcdiv by a column as product, quotient, sum",
     lambda t, s, w: _addcdiv_by_columns(t[:1], t[1:2], t[2:3], _columns(s, t[:1])),
     lambda r, s, w: torch._foreach_addcdiv_(r[0], r[1], r[2], s)),
]


@functools.lru_cache(maxsize=None)  # a fact of this torch build and device, not of a run
def stacked_update_is_exact(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether every stacked form of the vectorized update gives each row of a stacked tensor, bit
    for bit, what the per-row form gives that row alone, in ``dtype`` on ``device``. Checked on 32
    rows of 37 elements (a row's last elements fall in a kernel's scalar tail alone and in its
    vectorized body stacked, the rows start at every offset modulo the vector width) and on 32
    single elements (:func:`disagreeing_form`); one differing element of one form turns the
    stacked update off.

    >>> stacked_update_is_exact(torch.float64)
    True
    """
    if not dtype.is_floating_point or torch.empty((), dtype=dtype).element_size() not in _BITS:
        return False
    gen = torch.Generator().manual_seed(0)
    return all(disagreeing_form(dtype, device, 32, n, gen) is None for n in (1, 37))


def disagreeing_form(dtype: torch.dtype, device: str, rows: int, length: int,
                     generator: torch.Generator) -> str | None:
    """The first stacked form that gives some row of ``rows`` stacked rows of ``length``
    elements other bits than the per-row form gives it, or None. The operands are random, with
    magnitudes varying element by element over six decades (so that products and the values they
    are added to often meet at the same scale, where a multiply-add rounds differently from a
    product and a sum); per-row scalars of both signs over three decades, lerp weights either
    side of 0.5."""
    s = [(-1) ** i * 10 ** (-1 - 3 * i / rows) for i in range(rows)]
    w = [0.05 + 0.9 * i / max(rows - 1, 1) for i in range(rows)]

    def rand(positive: bool = False) -> torch.Tensor:
        t = torch.randn(rows, length, generator=generator, dtype=torch.float64)
        t = t.abs() if positive else t
        scale = 10 ** (-6 * torch.rand(rows, length, generator=generator, dtype=torch.float64))
        return (t * scale).to(dtype=dtype, device=device)

    operands = [rand(), rand(), rand(positive=True) + 1e-8]
    for name, stacked, per_row in _STACKED_FORMS:
        together = [t.clone() for t in operands]
        alone = [t.clone() for t in operands]
        stacked(together, s, w)
        per_row([list(t.unbind(0)) for t in alone], s, w)
        if not _same_bits(together[0], alone[0]):
            return name
    return None


def _groups(values: Sequence[float], rows: int, per: int, skip: float | None = None) -> dict[float, list[int]]:
    """Indices of the views (param-major: view ``j`` is model ``j % rows``) per distinct value of
    their model's ``values``, leaving out models whose value is ``skip``."""
    out: dict[float, list[int]] = {}
    for j in range(rows * per):
        v = values[j % rows]
        if skip is not None and v == skip:
            continue
        out.setdefault(v, []).append(j)
    return out


def _pick(tensors: Sequence[torch.Tensor], index: Sequence[int]) -> list[torch.Tensor]:
    return [tensors[j] for j in index]


class _VectorOptimizer:
    """SGD / Adam / AdamW / RMSprop over stacked parameters with per-model lr, momentum (Adam's
    beta1) and weight decay, reproducing ``torch.optim``'s update of each model bit for bit (see
    the module docstring): SGD dampening 0, no Nesterov; Adam/AdamW betas (momentum, 0.999), eps
    1e-8; RMSprop alpha 0.99, eps 1e-8, not centered. A parameter without a gradient is skipped,
    as torch.optim does, and counts its own steps.

    ``state[name][key]`` are stacked ``(K, *shape)`` tensors (``momentum_buffer``, ``exp_avg``,
    ``exp_avg_sq``, ``square_avg``); ``steps[name]`` the parameter's step count.

    >>> opt = _VectorOptimizer("adamw", momentum=[0.9, 0.9], weight_decay=[0.0, 1e-2])
    >>> w = torch.zeros(2, 3, requires_grad=True); w.grad = torch.ones(2, 3)
    >>> opt.step({"w": w}, lrs=[0.1, 0.01]); w[:, 0].tolist()
    [-0.09999998658895493, -0.009999999776482582]
    """

    BETA2, EPS, ALPHA = 0.999, 1e-8, 0.99

    def __init__(self, kind: str, momentum: list[float], weight_decay: list[float]):
        if kind not in ("sgd", *_ADAPTIVE):
            raise ValueError(f"no vectorized optimizer {kind!r}")
        self.kind = kind
        self.momentum, self.weight_decay = list(momentum), list(weight_decay)
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.steps: dict[str, int] = {}
        # row views of the stacked tensors, made once per tensor (they stay while it does)
        self._views: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def select(self, rows: list[int]) -> None:
        """Keep only the models at ``rows`` (in that order)."""
        self.momentum = [self.momentum[r] for r in rows]
        self.weight_decay = [self.weight_decay[r] for r in rows]
        self._views.clear()
        for state in self.state.values():
            for key, value in state.items():
                state[key] = value.index_select(0, torch.tensor(rows, dtype=torch.long, device=value.device))

    def _rows(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``t``'s row views, cached by the tensor's identity."""
        hit = self._views.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self._views[id(t)] = (t, t.unbind(0))
        return hit[1]

    def _state(self, names: Sequence[str], key: str, params: Mapping[str, torch.Tensor],
               init: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The stacked tensors of state ``key`` of ``names``, zeros (or a copy of ``init``'s)
        where a parameter has none yet."""
        out: list[torch.Tensor] = []
        for i, n in enumerate(names):
            state = self.state.setdefault(n, {})
            if key not in state:
                state[key] = torch.zeros_like(params[n]) if init is None else init[i].detach().clone()
            out.append(state[key])
        return out

    def _stacked(self, names: Sequence[str], key: str, params: Mapping[str, torch.Tensor],
                 init: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The row views of state ``key`` of ``names`` (param-major), zeros (or a copy of
        ``init``'s stacked tensors) where a parameter has none yet."""
        return [v for t in self._state(names, key, params, init) for v in self._rows(t)]

    @torch.no_grad()
    def step(self, params: Mapping[str, torch.Tensor], lrs: list[float]) -> None:
        names = [n for n, p in params.items() if p.grad is not None]
        if not names:
            return
        k = len(lrs)
        counts = []
        for n in names:
            self.steps[n] = self.steps.get(n, 0) + 1
            counts.append(self.steps[n])
        if self._stackable(names, params):
            self._step_stacked(names, params, lrs, counts)
            return
        ps = [v for n in names for v in self._rows(params[n])]
        stacked_grads = [params[n].grad for n in names]
        gs = [v for g in stacked_grads for v in g.unbind(0)]  # type: ignore[union-attr]
        per = len(names)
        wd = self.weight_decay
        if self.kind == "adamw":  # decoupled: p * (1 - lr * wd)
            decay = [j for j in range(k * per) if wd[j % k] != 0]
            if decay:
                torch._foreach_mul_(_pick(ps, decay), [1 - lrs[j % k] * wd[j % k] for j in decay])
        else:  # g + wd * p (torch.optim's grad.add(param, alpha=wd), a new tensor: the grads are ours)
            for value, index in _groups(wd, k, per, skip=0.0).items():
                grads = _pick(gs, index)
                torch._foreach_add_(grads, _pick(ps, index), alpha=value)
        if self.kind == "sgd":
            self._sgd(names, params, stacked_grads, ps, gs, lrs, k, per)
        elif self.kind == "rmsprop":
            self._rmsprop(names, params, ps, gs, lrs, k, per)
        else:
            self._adam(names, params, ps, gs, lrs, counts, k, per)

    # -- the stacked update (see the module docstring) -------------------------------------------
    def _stackable(self, names: Sequence[str], params: Mapping[str, torch.Tensor]) -> bool:
        """Whether this step can run on the stacked tensors: the stacked forms are exact on the
        parameters' dtype and device, and the models agree on whether each rule's optional part
        runs (SGD's and RMSprop's momentum buffer: all or none)."""
        first = params[names[0]]
        if any(params[n].dtype != first.dtype or params[n].device != first.device for n in names):
            return False
        if not stacked_update_is_exact(first.dtype, first.device.type):
            return False
        mom = self.momentum
        if self.kind == "sgd":
            return len({m != 0 for m in mom}) == 1
        if self.kind == "rmsprop":
            return len({m > 0 for m in mom}) == 1
        return True

    @staticmethod
    def _mul(ts: list[torch.Tensor], values: Sequence[float]) -> None:
        """Row r of each of ``ts`` times ``values[r]``."""
        if len(set(values)) == 1:
            torch._foreach_mul_(ts, values[0])
        else:
            torch._foreach_mul_(ts, _columns(values, ts))

    @staticmethod
    def _add_scaled(ts: list[torch.Tensor], others: list[torch.Tensor], values: Sequence[float]) -> None:
        """Row r of each of ``ts`` plus ``values[r]`` times the row of ``others``: one multiply-add,
        ``add_(alpha=)``'s."""
        if len(set(values)) == 1:
            torch._foreach_add_(ts, others, alpha=values[0])
        else:
            torch._foreach_addcmul_(ts, others, _columns(values, ts))

    def _step_stacked(self, names: list[str], params: Mapping[str, torch.Tensor], lrs: list[float],
                      counts: list[int]) -> None:
        ps = [params[n] for n in names]
        gs: list[torch.Tensor] = [params[n].grad for n in names]  # type: ignore[misc]
        wd = self.weight_decay
        if self.kind == "adamw":  # decoupled: p * (1 - lr * wd); a factor of 1 leaves a row as it is
            if any(w != 0 for w in wd):
                self._mul(ps, [1 - lr * w if w != 0 else 1.0 for lr, w in zip(lrs, wd)])
        elif all(w != 0 for w in wd) or len(set(wd)) == 1:  # g + wd * p
            if wd[0] != 0:
                self._add_scaled(gs, ps, wd)
        else:  # some models without weight decay: their gradients untouched, the others' row by row
            for value, index in _groups(wd, len(lrs), 1, skip=0.0).items():
                torch._foreach_add_([g[r] for g in gs for r in index], [p[r] for p in ps for r in index], alpha=value)
        if self.kind == "sgd":
            self._sgd_stacked(names, params, ps, gs, lrs)
        elif self.kind == "rmsprop":
            self._rmsprop_stacked(names, params, ps, gs, lrs)
        else:
            self._adam_stacked(names, params, ps, gs, lrs, counts)

    def _sgd_stacked(self, names: list[str], params: Mapping[str, torch.Tensor], ps: list[torch.Tensor],
                     gs: list[torch.Tensor], lrs: list[float]) -> None:
        mom = self.momentum
        direction = gs
        if mom[0] != 0:  # buf = g.clone() on its first step, else buf * m + g
            fresh = [n not in self.state or "momentum_buffer" not in self.state[n] for n in names]
            direction = self._state(names, "momentum_buffer", params, init=gs)
            moving = [b for b, f in zip(direction, fresh) if not f]
            if moving:
                self._mul(moving, mom)
                torch._foreach_add_(moving, [g for g, f in zip(gs, fresh) if not f])
        self._add_scaled(ps, direction, [-lr for lr in lrs])

    def _adam_stacked(self, names: list[str], params: Mapping[str, torch.Tensor], ps: list[torch.Tensor],
                      gs: list[torch.Tensor], lrs: list[float], counts: list[int]) -> None:
        mom, beta2 = self.momentum, self.BETA2
        exp_avg = self._state(names, "exp_avg", params)
        exp_avg_sq = self._state(names, "exp_avg_sq", params)
        weights = [1 - m for m in mom]
        if len(set(weights)) == 1:
            torch._foreach_lerp_(exp_avg, gs, weights[0])
        else:
            torch._foreach_lerp_(exp_avg, gs, _columns(weights, exp_avg))
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, gs, gs, value=1 - beta2)
        # torch.optim's step is a float tensor: its bias corrections use float(step)
        steps = [float(c) for c in counts]
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, [(1 - beta2 ** s) ** 0.5 for s in steps])
        torch._foreach_add_(denom, self.EPS)
        sizes = [[-(lr / (1 - m ** s)) for lr, m in zip(lrs, mom)] for s in steps]
        if all(len(set(row)) == 1 for row in sizes):
            torch._foreach_addcdiv_(ps, exp_avg, denom, [row[0] for row in sizes])
        else:
            table = torch.tensor(sizes, dtype=ps[0].dtype, device=ps[0].device)
            columns = [table[i].view(-1, *[1] * (p.dim() - 1)).expand_as(p) for i, p in enumerate(ps)]
            _addcdiv_by_columns(ps, exp_avg, denom, columns)

    def _rms_denominator(self, square_avg: list[torch.Tensor], gs: list[torch.Tensor]) -> list[torch.Tensor]:
        """RMSprop's running square updated in place (``a * alpha + (1 - alpha) * g * g``) and its
        root plus eps, the divisor of the step, on stacked tensors or row views alike."""
        torch._foreach_mul_(square_avg, self.ALPHA)
        torch._foreach_addcmul_(square_avg, gs, gs, value=1 - self.ALPHA)
        avg = torch._foreach_sqrt(square_avg)
        torch._foreach_add_(avg, self.EPS)
        return list(avg)

    def _rmsprop_stacked(self, names: list[str], params: Mapping[str, torch.Tensor], ps: list[torch.Tensor],
                         gs: list[torch.Tensor], lrs: list[float]) -> None:
        mom = self.momentum
        avg = self._rms_denominator(self._state(names, "square_avg", params), gs)
        steps = [-lr for lr in lrs]
        if not mom[0] > 0:  # p - lr * g / avg
            if len(set(steps)) == 1:
                torch._foreach_addcdiv_(ps, gs, avg, steps[0])
            else:
                _addcdiv_by_columns(ps, gs, avg, _columns(steps, ps))
        else:  # buf * m + g / avg, then p - lr * buf
            bufs = self._state(names, "momentum_buffer", params)
            self._mul(bufs, mom)
            torch._foreach_addcdiv_(bufs, gs, avg)
            self._add_scaled(ps, bufs, steps)

    # -- the row views' update -----------------------------------------------------------------------
    def _sgd(self, names: list[str], params: Mapping[str, torch.Tensor], stacked_grads: list[torch.Tensor | None],
             ps: list[torch.Tensor], gs: list[torch.Tensor], lrs: list[float], k: int, per: int) -> None:
        mom = self.momentum
        direction = list(gs)
        if any(m != 0 for m in mom):
            fresh = [n not in self.state or "momentum_buffer" not in self.state[n] for n in names]
            # buf = g.clone() on its first step, else buf * m + g
            bufs = self._stacked(names, "momentum_buffer", params, init=[g for g in stacked_grads])  # type: ignore[misc]
            moving = [j for j in range(k * per) if mom[j % k] != 0 and not fresh[j // k]]
            if moving:
                torch._foreach_mul_(_pick(bufs, moving), [mom[j % k] for j in moving])
                torch._foreach_add_(_pick(bufs, moving), _pick(gs, moving))
            for j in range(k * per):
                if mom[j % k] != 0:
                    direction[j] = bufs[j]
        for lr, index in _groups(lrs, k, per).items():  # p - lr * d: one multiply-add, as torch's
            torch._foreach_add_(_pick(ps, index), _pick(direction, index), alpha=-lr)

    def _adam(self, names: list[str], params: Mapping[str, torch.Tensor], ps: list[torch.Tensor],
              gs: list[torch.Tensor], lrs: list[float], counts: list[int], k: int, per: int) -> None:
        mom, beta2 = self.momentum, self.BETA2
        exp_avg = self._stacked(names, "exp_avg", params)
        exp_avg_sq = self._stacked(names, "exp_avg_sq", params)
        for beta1, index in _groups(mom, k, per).items():
            torch._foreach_lerp_(_pick(exp_avg, index), _pick(gs, index), 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, gs, gs, value=1 - beta2)
        # torch.optim's step is a float tensor: its bias corrections use float(step)
        steps = [float(counts[j // k]) for j in range(k * per)]
        bias2_sqrt = [(1 - beta2 ** s) ** 0.5 for s in steps]
        step_size = [-(lrs[j % k] / (1 - mom[j % k] ** s)) for j, s in enumerate(steps)]
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, self.EPS)
        torch._foreach_addcdiv_(ps, exp_avg, denom, step_size)

    def _rmsprop(self, names: list[str], params: Mapping[str, torch.Tensor], ps: list[torch.Tensor],
                 gs: list[torch.Tensor], lrs: list[float], k: int, per: int) -> None:
        mom = self.momentum
        avg = self._rms_denominator(self._stacked(names, "square_avg", params), gs)
        plain = [j for j in range(k * per) if not mom[j % k] > 0]
        if plain:  # p - lr * g / avg
            torch._foreach_addcdiv_(_pick(ps, plain), _pick(gs, plain), _pick(avg, plain),
                                    [-lrs[j % k] for j in plain])
        moving = [j for j in range(k * per) if mom[j % k] > 0]
        if moving:  # buf * m + g / avg, then p - lr * buf
            bufs = self._stacked(names, "momentum_buffer", params)
            torch._foreach_mul_(_pick(bufs, moving), [mom[j % k] for j in moving])
            torch._foreach_addcdiv_(_pick(bufs, moving), _pick(gs, moving), _pick(avg, moving))
            for lr, index in _groups(lrs, k, per).items():
                chosen = [j for j in index if mom[j % k] > 0]
                if chosen:
                    torch._foreach_add_(_pick(ps, chosen), _pick(bufs, chosen), alpha=-lr)

def _resolved_momentum(cfg: TrainConfig) -> float:
    if cfg.momentum is not None:
        return cfg.momentum
    return 0.0 if cfg.optimizer == "rmsprop" else 0.9
