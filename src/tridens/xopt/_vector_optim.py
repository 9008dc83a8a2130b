"""Vectorized optimizers: SGD, Adam, AdamW and RMSprop with ``torch.optim``'s semantics over
stacked parameters, per-model hyperparameters broadcast over the model dimension.
"""

from __future__ import annotations


from typing import Any, Mapping, Sequence

import torch

from ..evaluators._supervised import TrainConfig

# -- the vectorized optimizers ----------------------------------------------------------------------
def _per_model(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """Per-model scalars as a tensor broadcast over a stacked tensor shaped like ``like``."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).view(-1, *([1] * (like.dim() - 1)))


class _VectorOptimizer:
    """SGD / Adam / AdamW / RMSprop over stacked parameters, per-model lr, momentum (Adam's beta1)
    and weight decay, with ``torch.optim``'s single-tensor (CPU) update rules: SGD with dampening 0,
    no Nesterov; Adam/AdamW betas (momentum, 0.999), eps 1e-8; RMSprop alpha 0.99, eps 1e-8, not
    centered. A parameter without a gradient is skipped, as torch.optim does."""

    BETA2, EPS, ALPHA = 0.999, 1e-8, 0.99

    def __init__(self, kind: str, momentum: list[float], weight_decay: list[float]):
        self.kind = kind
        self.momentum, self.weight_decay = list(momentum), list(weight_decay)
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.steps: dict[str, int] = {}
        # per-model hyperparameters as broadcastable tensors, rebuilt only when their values change
        # (a schedule's lrs, models leaving): building them took a third of a fused MLP step's update
        self._rows: dict[tuple[Any, ...], tuple[tuple[float, ...], torch.Tensor]] = {}

    def select(self, rows: list[int]) -> None:
        """Keep only the models at ``rows`` (in that order)."""
        self.momentum = [self.momentum[r] for r in rows]
        self.weight_decay = [self.weight_decay[r] for r in rows]
        self._rows.clear()
        for name, state in self.state.items():
            for key, value in state.items():
                index = torch.tensor(rows, dtype=torch.long, device=value.device)
                state[key] = value.index_select(0, index)

    def _row(self, what: str, values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
        """``_per_model(values, like)``, cached per quantity and tensor rank while ``values`` stay."""
        key, values = (what, like.dim(), like.dtype, like.device), tuple(values)
        hit = self._rows.get(key)
        if hit is None or hit[0] != values:
            hit = self._rows[key] = (values, _per_model(values, like))
        return hit[1]

    @torch.no_grad()
    def step(self, params: Mapping[str, torch.Tensor], lrs: list[float]) -> None:
        wd_any = any(w != 0 for w in self.weight_decay)
        for name, p in params.items():
            g = p.grad
            if g is None:
                continue
            state = self.state.setdefault(name, {})
            count = self.steps[name] = self.steps.get(name, 0) + 1
            lr = self._row("lr", lrs, p)
            if self.kind == "adamw":
                if wd_any:
                    p.mul_(self._row("decay", [1 - a * w for a, w in zip(lrs, self.weight_decay)], p))
            elif wd_any:
                g = torch.addcmul(g, self._row("wd", self.weight_decay, p), p)  # g + wd * p
            if self.kind == "sgd":
                if any(m != 0 for m in self.momentum):
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = g.clone()
                    else:  # buf * momentum + g
                        torch.addcmul(g, buf, self._row("momentum", self.momentum, p), out=buf)
                    g = buf
                p.addcmul_(lr, g, value=-1)  # p - lr * g
            elif self.kind in ("adam", "adamw"):
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(g, self._row("1-beta1", [1 - m for m in self.momentum], p))
                exp_avg_sq.mul_(self.BETA2).addcmul_(g, g, value=1 - self.BETA2)
                bias_correction2 = 1 - self.BETA2 ** count
                step_size = [a / (1 - m ** count) for a, m in zip(lrs, self.momentum)]
                denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(self.EPS)
                p.add_((self._row("-step size", [-s for s in step_size], p) * exp_avg).div_(denom))
            elif self.kind == "rmsprop":
                if not state:
                    state["square_avg"] = torch.zeros_like(p)
                square_avg = state["square_avg"]
                square_avg.mul_(self.ALPHA).addcmul_(g, g, value=1 - self.ALPHA)
                avg = square_avg.sqrt().add_(self.EPS)
                if any(m > 0 for m in self.momentum):
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(self._row("momentum", self.momentum, p)).addcdiv_(g, avg)
                    p.sub_(lr * buf)
                else:
                    p.add_((-lr * g).div_(avg))
            else:  # pragma: no cover - planner checks the kind
                raise ValueError(f"no vectorized optimizer {self.kind!r}")


def _resolved_momentum(cfg: TrainConfig) -> float:
    if cfg.momentum is not None:
        return cfg.momentum
    return 0.0 if cfg.optimizer == "rmsprop" else 0.9
