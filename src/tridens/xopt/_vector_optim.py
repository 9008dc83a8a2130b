"""Vectorized optimizers: SGD, Adam, AdamW and RMSprop with ``torch.optim``'s semantics over
stacked parameters, per-model hyperparameters broadcast over the model dimension.
"""

from __future__ import annotations


from typing import Any, Callable, Mapping, Sequence

import torch
from torch.optim.adam import adam as functional_adam

from ..evaluators import TrainConfig

# -- the vectorized optimizers ----------------------------------------------------------------------
def _per_model(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-model scalars as a tensor broadcast over a stacked tensor shaped like ``like``."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).view(-1, *([1] * (like.dim() - 1)))


class _FlatLayout:
    """The parameters one step updates, laid end to end: each stacked parameter ``(K, *shape)``
    flattened (row-major, so model k's elements are one block), then all of them concatenated.
    Elementwise updates then run as one operation over every parameter at once."""

    def __init__(self, names: tuple[str, ...], params: list[torch.Tensor]):
        self.names = names
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        self.rows = params[0].shape[0]
        self.like = params[0]
        # each element's model (row): per-model values become a vector with one gather
        self.model_index = torch.cat([torch.arange(self.rows, device=self.like.device).repeat_interleave(size // self.rows)
                                      for size in self.sizes])
        # an update is written here and added to the parameters through these views (made once)
        self.update = torch.empty(sum(self.sizes), dtype=self.like.dtype, device=self.like.device)
        self.update_views = self.views(self.update)
        self.grad = torch.empty_like(self.update)  # the gradients, concatenated
        self.grad_views = self.views(self.grad)

    def flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [part.view(shape) for part, shape in zip(flat.split(self.sizes), self.shapes)]

    def per_model(self, values: Sequence[float]) -> torch.Tensor:
        """Per-model scalars repeated over each model's elements of every parameter."""
        return torch.tensor(values, dtype=self.like.dtype, device=self.like.device).index_select(0, self.model_index)

    def columns(self, values: Sequence[float]) -> list[torch.Tensor]:
        """Per-model scalars as one ``(K, 1, ...)`` view per parameter, broadcast over its rows."""
        vector = torch.tensor(values, dtype=self.like.dtype, device=self.like.device)
        return [vector.view(-1, *([1] * (len(shape) - 1))) for shape in self.shapes]

    def per_parameter(self, values: Sequence[float]) -> torch.Tensor:
        """Per-parameter scalars repeated over each parameter's elements."""
        return torch.cat([torch.full((size,), v, dtype=self.like.dtype, device=self.like.device)
                          for v, size in zip(values, self.sizes)])


class _VectorOptimizer:
    """SGD / Adam / AdamW / RMSprop over stacked parameters, per-model lr, momentum (Adam's beta1)
    and weight decay, with ``torch.optim``'s single-tensor (CPU) update rules: SGD with dampening 0,
    no Nesterov; Adam/AdamW betas (momentum, 0.999), eps 1e-8; RMSprop alpha 0.99, eps 1e-8, not
    centered. A parameter without a gradient is skipped, as torch.optim does.

    Every parameter of a step is updated at once: gradients concatenated into one vector, the
    optimizer state kept as one vector per quantity (``state[name][key]`` are views into it), the
    per-model hyperparameters as vectors of the same length. The operations are the single-tensor
    rule's, elementwise, so the result is the same as updating the parameters one by one; a tiny
    model's update is then a dozen operations instead of a dozen per parameter. Adam and AdamW
    models that share beta1 take one pass of torch's fused Adam kernel instead (the same rule, to
    rounding, in fewer passes over memory)."""

    BETA2, EPS, ALPHA = 0.999, 1e-8, 0.99

    def __init__(self, kind: str, momentum: list[float], weight_decay: list[float]):
        self.kind = kind
        self.momentum, self.weight_decay = list(momentum), list(weight_decay)
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.steps: dict[str, int] = {}
        self._layout: _FlatLayout | None = None
        self._flat: dict[str, torch.Tensor] = {}  # state key -> the vector ``state[name][key]`` view
        # per-model hyperparameters as vectors, rebuilt only when their values change (a schedule's
        # lrs, models leaving)
        self._row_cache: dict[tuple[str, Any], tuple[tuple[float, ...], Any]] = {}
        self._step_count = torch.zeros(())  # fused Adam's step, as the kernel reads it

    def select(self, rows: list[int]) -> None:
        """Keep only the models at ``rows`` (in that order)."""
        self.momentum = [self.momentum[r] for r in rows]
        self.weight_decay = [self.weight_decay[r] for r in rows]
        self._row_cache.clear()
        self._layout, self._flat = None, {}
        for name, state in self.state.items():
            for key, value in state.items():
                index = torch.tensor(rows, dtype=torch.long, device=value.device)
                state[key] = value.index_select(0, index)

    def _rows(self, what: str, values: Sequence[float], views: bool = False) -> Any:
        """The per-model ``values`` as a vector over the layout (or its views shaped as the
        parameters), cached while the values stay."""
        def build(layout: _FlatLayout) -> Any:
            vector = layout.per_model(values)
            return layout.views(vector) if views else vector

        return self._cached((what, views), values, build)

    def _columns(self, what: str, values: Sequence[float]) -> list[torch.Tensor]:
        """The per-model ``values`` as one ``(K, 1, ...)`` column per parameter, cached while they stay."""
        return self._cached((what, "columns"), values, lambda layout: layout.columns(values))

    def _cached(self, key: tuple[str, Any], values: Sequence[float], build: Callable[[_FlatLayout], Any]) -> Any:
        """``build(layout)`` for these per-model values, rebuilt only when they change."""
        values = tuple(values)
        hit = self._row_cache.get(key)
        if hit is None or hit[0] != values:
            assert self._layout is not None
            hit = self._row_cache[key] = (values, build(self._layout))
        return hit[1]

    def _use(self, names: tuple[str, ...], ps: list[torch.Tensor]) -> _FlatLayout:
        """The layout of these parameters, the state vectors gathered into it when it changes."""
        layout = self._layout
        if layout is not None and layout.names == names:
            return layout
        layout = self._layout = _FlatLayout(names, ps)
        self._row_cache.clear()
        self._flat = {}
        keys = {k for n in names for k in self.state.get(n, {})}
        for key in keys:  # a quantity some parameter lacks starts at zero there, as torch.optim's does
            flat = self._flat[key] = layout.flat([self.state.get(n, {}).get(key, torch.zeros_like(p))
                                                  for n, p in zip(names, ps)])
            for n, view in zip(names, layout.views(flat)):
                self.state.setdefault(n, {})[key] = view
        return layout

    def _state(self, key: str, layout: _FlatLayout, init: torch.Tensor | None = None) -> torch.Tensor:
        """The state vector ``key`` (zeros, or a copy of ``init``, the first time)."""
        flat = self._flat.get(key)
        if flat is None:
            flat = self._flat[key] = (torch.zeros(sum(layout.sizes), dtype=layout.like.dtype,
                                                  device=layout.like.device) if init is None else init.clone())
            for n, view in zip(layout.names, layout.views(flat)):
                self.state.setdefault(n, {})[key] = view
        return flat

    @torch.no_grad()
    def step(self, params: Mapping[str, torch.Tensor], lrs: list[float]) -> None:
        names = tuple(n for n, p in params.items() if p.grad is not None)
        if not names:
            return
        ps = [params[n] for n in names]
        layout = self._use(names, ps)
        counts = []
        for n in names:
            counts.append(self.steps.get(n, 0) + 1)
            self.steps[n] = counts[-1]
        kind = self.kind
        g = torch.cat([p.grad.reshape(-1) for p in ps], out=layout.grad)
        g_views = layout.grad_views
        if any(w != 0 for w in self.weight_decay):
            if kind == "adamw":
                torch._foreach_mul_(ps, self._rows("decay", [1 - a * w for a, w in zip(lrs, self.weight_decay)],
                                                   views=True))
            else:  # g + wd * p
                g.addcmul_(self._rows("wd", self.weight_decay), layout.flat(ps))
        if kind == "sgd":
            if any(m != 0 for m in self.momentum):
                if "momentum_buffer" in self._flat:  # buf * momentum + g
                    buf = self._flat["momentum_buffer"]
                    torch.addcmul(g, buf, self._rows("momentum", self.momentum), out=buf)
                else:
                    self._state("momentum_buffer", layout, init=g)
                g_views = [self.state[n]["momentum_buffer"] for n in names]
            torch._foreach_addcmul_(ps, g_views, self._rows("-lr", [-a for a in lrs], views=True))  # p - lr * g
        elif kind in ("adam", "adamw"):
            exp_avg, exp_avg_sq = self._state("exp_avg", layout), self._state("exp_avg_sq", layout)
            if (len(set(counts)) == 1 and len(set(self.momentum)) == 1 and g.device.type in _FUSED_ADAM_DEVICES
                    and g.is_floating_point()):
                # torch's fused Adam kernel in one pass with lr 1 writes -m_hat / (sqrt(v_hat) + eps)
                # into the zeroed update; each model's rows are then added scaled by its own lr
                layout.update.zero_()
                if self._step_count.device != g.device:
                    self._step_count = torch.zeros((), device=g.device)
                self._step_count.fill_(counts[0] - 1)  # adam() adds this step
                functional_adam([layout.update], [g], [exp_avg], [exp_avg_sq], [], [self._step_count],
                                fused=True, amsgrad=False, beta1=self.momentum[0], beta2=self.BETA2, lr=1.0,
                                weight_decay=0.0, eps=self.EPS, maximize=False)
                torch._foreach_addcmul_(ps, layout.update_views, self._columns("lr", lrs))
                return
            exp_avg.lerp_(g, self._rows("1-beta1", [1 - m for m in self.momentum]))
            exp_avg_sq.mul_(self.BETA2).addcmul_(g, g, value=1 - self.BETA2)
            if len(set(counts)) == 1:
                count = counts[0]
                denom = (exp_avg_sq.sqrt() / (1 - self.BETA2 ** count) ** 0.5).add_(self.EPS)
                # the step size changes every step (bias correction): scale each parameter's rows by
                # their model's value in place of gathering a vector as long as the parameters
                layout.update.copy_(exp_avg)
                torch._foreach_mul_(layout.update_views, layout.columns(
                    [-a / (1 - m ** count) for a, m in zip(lrs, self.momentum)]))
                layout.update.div_(denom)
            else:  # a parameter skipped on some steps (no gradient) counts its own steps
                denom = (exp_avg_sq.sqrt() / layout.per_parameter([(1 - self.BETA2 ** c) ** 0.5 for c in counts])
                         ).add_(self.EPS)
                step_size = torch.cat([
                    layout.per_model([-a / (1 - m ** c) for a, m in zip(lrs, self.momentum)])[start:start + size]
                    for c, start, size in zip(counts, _starts(layout.sizes), layout.sizes)])
                torch.mul(step_size, exp_avg, out=layout.update).div_(denom)
            torch._foreach_add_(ps, layout.update_views)
        elif kind == "rmsprop":
            square_avg = self._state("square_avg", layout)
            square_avg.mul_(self.ALPHA).addcmul_(g, g, value=1 - self.ALPHA)
            avg = square_avg.sqrt().add_(self.EPS)
            lr = self._rows("lr", lrs)
            if any(m > 0 for m in self.momentum):
                buf = self._state("momentum_buffer", layout)
                buf.mul_(self._rows("momentum", self.momentum)).addcdiv_(g, avg)
                torch.mul(lr, buf, out=layout.update)
                torch._foreach_sub_(ps, layout.update_views)
            else:
                torch.mul(-lr, g, out=layout.update).div_(avg)
                torch._foreach_add_(ps, layout.update_views)
        else:  # pragma: no cover - planner checks the kind
            raise ValueError(f"no vectorized optimizer {self.kind!r}")


# devices with torch's fused Adam kernel: one pass over the parameters where the elementwise rule
# takes a dozen
_FUSED_ADAM_DEVICES = frozenset({"cpu", "cuda"})


def _starts(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out


def _resolved_momentum(cfg: TrainConfig) -> float:
    if cfg.momentum is not None:
        return cfg.momentum
    return 0.0 if cfg.optimizer == "rmsprop" else 0.9
