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
"""

from __future__ import annotations


from typing import Mapping, Sequence

import torch

from ..evaluators import TrainConfig

_ADAPTIVE = ("adam", "adamw", "rmsprop")


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
    [-0.10000000149011612, -0.009999999776482582]
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

    def _stacked(self, names: Sequence[str], key: str, params: Mapping[str, torch.Tensor],
                 init: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The row views of state ``key`` of ``names`` (param-major), zeros (or a copy of
        ``init``'s stacked tensors) where a parameter has none yet."""
        out: list[torch.Tensor] = []
        for i, n in enumerate(names):
            state = self.state.setdefault(n, {})
            if key not in state:
                state[key] = torch.zeros_like(params[n]) if init is None else init[i].detach().clone()
            out.extend(self._rows(state[key]))
        return out

    @torch.no_grad()
    def step(self, params: Mapping[str, torch.Tensor], lrs: list[float]) -> None:
        names = [n for n, p in params.items() if p.grad is not None]
        if not names:
            return
        k = len(lrs)
        ps = [v for n in names for v in self._rows(params[n])]
        stacked_grads = [params[n].grad for n in names]
        gs = [v for g in stacked_grads for v in g.unbind(0)]  # type: ignore[union-attr]
        counts = []
        for n in names:
            self.steps[n] = self.steps.get(n, 0) + 1
            counts.append(self.steps[n])
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
        mom, alpha = self.momentum, self.ALPHA
        square_avg = self._stacked(names, "square_avg", params)
        torch._foreach_mul_(square_avg, alpha)
        torch._foreach_addcmul_(square_avg, gs, gs, value=1 - alpha)
        avg = torch._foreach_sqrt(square_avg)
        torch._foreach_add_(avg, self.EPS)
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
