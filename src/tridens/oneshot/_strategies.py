"""One-shot strategies: how the supernet is trained, step by step.

Every strategy trains one supernet (built from the space by :func:`~._supernet.build_supernet`)
with the declarative evaluator's data, optimizer, learning rate, batch size and epochs, then the
run searches its subnets with inherited weights (:mod:`._search`). They differ in what runs in a
training step:

* :class:`RandomOneShot` (SPOS, Guo et al. 2020): one uniformly random path per step.
* :class:`DARTS` (Liu et al. 2019): every candidate, mixed by ``softmax(alpha)``; ``alpha`` is
  learned on held-out training data by its own Adam (first order; ``second_order=True`` for the
  unrolled gradient with the finite-difference Hessian-vector product of the paper), after a
  weights-only warm-up over the first ``warmup`` share of the steps (default half).
* :class:`GumbelDARTS` (GDAS/SNAS): mixing weights drawn by Gumbel-softmax with a temperature
  annealed from ``tau_max`` to ``tau_min``, so training moves from mixtures towards single paths.
* :class:`ENAS` (Pham et al. 2018): an LSTM controller samples a path per step; the controller is
  trained by REINFORCE on the sampled path's accuracy on held-out training data, with a moving
  average baseline.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import random
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..evaluators import TrainConfig, ValidationSums
from ._search import complete
from ._supernet import Supernet

__all__ = ["OneShotStrategy", "RandomOneShot", "fair_paths", "DARTS", "GumbelDARTS", "ENAS", "Controller"]

Batch = tuple[torch.Tensor, torch.Tensor]
_SEARCHES = ("evolution", "random")


def _param_error(owner: str, name: str, expected: str, got: Any) -> ValueError:
    return ValueError(f"The {name!r} parameter of {owner} must be {expected}. Got {got!r} instead.")


class OneShotStrategy:
    """Base of the one-shot strategies (pass one to ``td.Experiment`` as its strategy).

    Parameters shared by all:

    * ``epochs``: supernet training epochs (``None``: the evaluator's ``epochs``);
    * ``search``: ``"evolution"`` (regularized evolution) or ``"random"`` over subnets evaluated
      with the supernet's weights; ``samples`` subnets are evaluated (each one becomes a trial;
      under an evaluator's ``fast_dev_run``, one: the strategy's export, DARTS' argmax);
      ``population`` and ``tournament`` size the evolution;
    * ``bn_batches``: training batches that recalibrate BatchNorm statistics before each subnet
      is scored;
    * ``retrain``: train the best architecture (``True``) or the ``k`` best (an int) from scratch
      with the evaluator, each as a normal trial (subnets rank by the objective, ties broken by
      the lower validation loss);
    * ``grad_clip``: clip the norm of the supernet weights' gradient to this value before each
      weight step (``None``: no clipping).

    Subclasses implement :meth:`begin`, :meth:`step` and may add :meth:`proposals`.
    """

    one_shot = True           # read by td.Experiment to run the one-shot path
    arch_fraction = 0.0       # share of the training set held out for architecture updates

    def __init__(self, *, epochs: int | None = None, search: str = "evolution", samples: int = 64,
                 population: int = 16, tournament: int = 4, bn_batches: int = 4, retrain: bool | int = False,
                 grad_clip: float | None = None) -> None:
        self.epochs = epochs
        self.search = search
        self.samples = samples
        self.population = population
        self.tournament = tournament
        self.bn_batches = bn_batches
        self.retrain = retrain
        self.grad_clip = grad_clip

    # -- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the parameters (called when the experiment starts)."""
        owner = type(self).__name__
        if self.epochs is not None and (not isinstance(self.epochs, int) or isinstance(self.epochs, bool) or self.epochs < 1):
            raise _param_error(owner, "epochs", "None or an int in the range [1, inf)", self.epochs)
        if self.search not in _SEARCHES:
            raise _param_error(owner, "search", f"one of {list(_SEARCHES)}", self.search)
        for name, low in (("samples", 1), ("population", 2), ("tournament", 1), ("bn_batches", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise _param_error(owner, name, f"an int in the range [{low}, inf)", value)
        if not isinstance(self.retrain, (bool, int)) or self.retrain < 0:
            raise _param_error(owner, "retrain", "a bool or an int in the range [0, inf)", self.retrain)
        clip = self.grad_clip
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise _param_error(owner, "grad_clip", "None or a number in the range (0, inf)", clip)

    def params(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params().items())})"

    # -- training -----------------------------------------------------------------------------
    def begin(self, net: Supernet, cfg: TrainConfig, total_steps: int, rng: random.Random) -> None:
        """Start training ``net``: the weight optimizer comes from the evaluator's config."""
        self.cfg = cfg
        self.optimizer: torch.optim.Optimizer | None = cfg.make_optimizer(net.model.parameters())
        self.begin_architecture(net, total_steps, rng)
        self.steps_per_epoch = int(cfg.steps_per_epoch)

    def begin_architecture(self, net: Supernet, total_steps: int, rng: random.Random) -> None:
        """Start the architecture side of training ``net`` only (paths, architecture parameters and
        their optimizer), for a trainer that makes the weight steps itself (a user's Lightning
        module: :meth:`before_weight_step` is called before each of them)."""
        self.net, self.total_steps, self.rng = net, total_steps, rng
        self.steps_per_epoch = 0   # set by the trainer once it knows its batches
        self.__dict__.setdefault("optimizer", None)

    def step(self, x: torch.Tensor, y: torch.Tensor, arch_batch: Callable[[], Batch], step: int) -> float:
        """One training step on ``(x, y)``; returns the training loss."""
        raise NotImplementedError

    def external_weights(self) -> str | None:
        """Why this strategy cannot leave its weight steps to another trainer (a Lightning module),
        or ``None`` when it can (it implements :meth:`before_weight_step`)."""
        return f"{type(self).__name__} trains the supernet's weights with its own steps"

    def before_weight_step(self, step: int, arch_loss: Callable[[], torch.Tensor]) -> None:
        """Prepare weight step ``step`` made by another trainer: put the path or the mixing weights
        in place, after an architecture update where the strategy makes one (``arch_loss()``: the
        loss of a held-out batch through the supernet as it is set now, differentiable)."""
        raise NotImplementedError(self.external_weights())

    def uses_arch_data(self) -> bool:
        """Whether the training steps read held-out batches (DARTS' architecture steps)."""
        return self.arch_fraction > 0

    def _weight_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        assert self.optimizer is not None
        lr = self.cfg.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.cfg.loss(self.net.model(x), y)
        loss.backward()
        self._clip()
        self.optimizer.step()
        return float(loss.item())

    def _clip(self) -> None:
        """Clip the norm of the weight optimizer's gradients to ``grad_clip`` (architecture parameters apart)."""
        if self.grad_clip is not None and self.optimizer is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, float(self.grad_clip))

    def proposals(self) -> list[dict[str, Any]]:
        """Architectures the strategy itself proposes for the search (e.g. DARTS' argmax)."""
        return []

    def summary(self) -> dict[str, Any]:
        """What the strategy learned, for the supernet trial's info (JSON)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The strategy's training state (weight optimizer, architecture parameters)."""
        return {"optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])


class RandomOneShot(OneShotStrategy):
    """SPOS: one uniformly random path of the supernet trained per step.

    ``fair=True`` samples FairNAS-style (Chu et al. 2021): each step runs ``m`` paths on the
    batch (``m``: the most values of any label), built from one random permutation per label so
    that every value of every label is trained in every step, and makes one optimizer step on
    their mean gradient. A step then costs ``m`` forward/backward passes.

    >>> import tridens as td
    >>> strategy = td.oneshot.RandomOneShot(samples=64, retrain=True)
    >>> exp = td.Experiment(space, evaluator, strategy, store="tridens.db")   # doctest: +SKIP
    >>> exp.run().top(5)                                                       # doctest: +SKIP
    """

    def __init__(self, *, fair: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fair = fair

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.fair, bool):
            raise _param_error(type(self).__name__, "fair", "a bool", self.fair)

    def external_weights(self) -> str | None:
        return ("RandomOneShot(fair=True) makes one weight step on the mean gradient of several paths"
                if self.fair else None)

    def before_weight_step(self, step: int, arch_loss: Callable[[], torch.Tensor]) -> None:
        self.net.set_path(self.net.search_space.random_sample(self.rng))

    def step(self, x: torch.Tensor, y: torch.Tensor, arch_batch: Callable[[], Batch], step: int) -> float:
        if not self.fair:
            self.before_weight_step(step, lambda: torch.zeros(()))
            return self._weight_step(x, y, step)
        assert self.optimizer is not None
        paths = fair_paths(self.net.search_space, self.rng)
        lr = self.cfg.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for path in paths:
            self.net.set_path(path)
            loss = self.cfg.loss(self.net.model(x), y) / len(paths)
            loss.backward()
            total += float(loss.item())
        self._clip()
        self.optimizer.step()
        return total


def fair_paths(search_space: Any, rng: random.Random) -> list[dict[str, Any]]:
    """FairNAS' strict fairness: ``m`` paths (``m``: the largest finite domain) in which every
    value of every finite label occurs (labels with fewer values repeat theirs, a random
    permutation each time round). Labels a path leaves inactive are dropped, other labels drawn.

    >>> paths = fair_paths(space.search_space(), random.Random(0))   # doctest: +SKIP
    """
    finite = {label: list(spec.domain.values()) for label, spec in search_space.items()
              if spec.domain.finite and spec.domain.size() > 0}
    m = max((len(v) for v in finite.values()), default=1)
    columns: dict[str, list[Any]] = {}
    for label, values in finite.items():
        column: list[Any] = []
        while len(column) < m:
            column += rng.sample(values, len(values))
        columns[label] = column[:m]
    return [complete(search_space, {label: column[j] for label, column in columns.items()}, rng) for j in range(m)]


# ---------------------------------------------------------------------------------------------
class DARTS(OneShotStrategy):
    """DARTS: softmax-mixed candidates, architecture weights learned by gradient.

    ``arch_lr``, ``arch_betas``, ``arch_weight_decay`` configure the architecture Adam (DARTS'
    defaults: 3e-4, (0.5, 0.999), 1e-3); ``arch_fraction`` of the training set is held out for
    architecture steps (DARTS: half). ``second_order=True`` uses the unrolled gradient.
    After training, the argmax architecture is evaluated first, then the search runs.

    ``warmup`` (default 0.5): the share of the training steps, at the start, that train the
    weights only, mixed by the initial (near-uniform) ``alpha``; the architecture steps start
    after it. Architecture gradients taken on barely trained weights mostly favour the ops that
    learn fastest (pooling, identity), so DARTS implementations warm the weights up first
    (PC-DARTS freezes ``alpha`` for 15 of its 50 epochs on CIFAR-10). It also makes the search
    cheaper: a warm-up step is one forward/backward instead of two, and the architecture step
    costs about as much as the weight step (its backward to ``alpha`` goes through every layer
    and, through the soft kernel masks, needs the masked convolutions' weight gradients too), so
    ``warmup=0.5`` trains the supernet in less CPU time than ``warmup=0`` (BENCHMARKS.md,
    "One-shot"). ``warmup=0`` is the paper's schedule.

    >>> strategy = td.oneshot.DARTS(arch_lr=3e-4, retrain=True)   # doctest: +SKIP
    """

    def __init__(self, *, arch_lr: float = 3e-4, arch_betas: tuple[float, float] = (0.5, 0.999),
                 arch_weight_decay: float = 1e-3, arch_fraction: float = 0.5, second_order: bool = False,
                 warmup: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.arch_lr = arch_lr
        self.arch_betas = arch_betas
        self.arch_weight_decay = arch_weight_decay
        self.arch_fraction = arch_fraction
        self.second_order = second_order
        self.warmup = warmup

    def validate(self) -> None:
        super().validate()
        owner = type(self).__name__
        if not isinstance(self.arch_lr, (int, float)) or not self.arch_lr > 0:
            raise _param_error(owner, "arch_lr", "a float in the range (0, inf)", self.arch_lr)
        if not isinstance(self.arch_fraction, (int, float)) or not 0 < self.arch_fraction < 1:
            raise _param_error(owner, "arch_fraction", "a float in the range (0, 1)", self.arch_fraction)
        if not isinstance(self.second_order, bool):
            raise _param_error(owner, "second_order", "a bool", self.second_order)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, (int, float)) or not 0 <= self.warmup < 1:
            raise _param_error(owner, "warmup", "a float in the range [0, 1)", self.warmup)

    def warmup_steps(self) -> int:
        """Steps at the start of training that update the weights only (``warmup`` of all steps)."""
        return int(self.warmup * self.total_steps)

    def begin_architecture(self, net: Supernet, total_steps: int, rng: random.Random) -> None:
        super().begin_architecture(net, total_steps, rng)
        g = torch.Generator().manual_seed(rng.getrandbits(31))
        self.alpha = {label: nn.Parameter(1e-3 * torch.randn(len(values), generator=g))
                      for label, values in net.state.values.items()}
        self.arch_optimizer = torch.optim.Adam(list(self.alpha.values()), lr=self.arch_lr,
                                               betas=(self.arch_betas[0], self.arch_betas[1]), weight_decay=self.arch_weight_decay)

    def mixing(self, step: int) -> dict[str, torch.Tensor]:
        """The mixing weight of every candidate of every label at ``step``."""
        return {label: F.softmax(a, dim=-1) for label, a in self.alpha.items()}

    def probabilities(self) -> dict[str, list[float]]:
        """``softmax(alpha)`` per label, as lists (what the search has learned)."""
        return {label: F.softmax(a.detach(), dim=-1).tolist() for label, a in self.alpha.items()}

    def external_weights(self) -> str | None:
        return ("second_order=True unrolls the weights' own SGD step, which the strategy does not make "
                "when another trainer makes the weight steps" if self.second_order else None)

    def before_weight_step(self, step: int, arch_loss: Callable[[], torch.Tensor]) -> None:
        if step >= self.warmup_steps():  # after the warm-up (alpha stays put while the shared weights learn)
            self.net.set_weights(self.mixing(step))
            grads = torch.autograd.grad(arch_loss(), list(self.alpha.values()), allow_unused=True)
            self._apply_arch(grads)
        self.net.set_weights({k: v.detach() for k, v in self.mixing(step).items()})

    def step(self, x: torch.Tensor, y: torch.Tensor, arch_batch: Callable[[], Batch], step: int) -> float:
        if self.second_order and step >= self.warmup_steps():
            xa, ya = arch_batch()
            self._unrolled_arch_step(x, y, xa, ya, step)
            self.net.set_weights({k: v.detach() for k, v in self.mixing(step).items()})
        else:
            def arch_loss() -> torch.Tensor:
                xa, ya = arch_batch()
                return self.cfg.loss(self.net.model(xa), ya)
            self.before_weight_step(step, arch_loss)
        return self._weight_step(x, y, step)

    def _apply_arch(self, grads: Any) -> None:
        self.arch_optimizer.zero_grad(set_to_none=True)
        for a, g in zip(self.alpha.values(), grads):
            a.grad = None if g is None else g.detach()
        self.arch_optimizer.step()

    def _unrolled_arch_step(self, x: torch.Tensor, y: torch.Tensor, xa: torch.Tensor, ya: torch.Tensor,
                            step: int) -> None:
        """DARTS eq. 7-8: grad_a L_val(w - xi grad_w L_train(w, a), a), with the second-order term
        approximated by finite differences around w (xi = the weights' current lr)."""
        params = [p for p in self.net.model.parameters() if p.requires_grad]
        alphas = list(self.alpha.values())
        xi = self.cfg.lr_at(step)
        backup = [p.detach().clone() for p in params]
        self.net.set_weights(self.mixing(step))
        g_train = torch.autograd.grad(self.cfg.loss(self.net.model(x), y), params, allow_unused=True)
        with torch.no_grad():
            for p, g in zip(params, g_train):
                if g is not None:
                    p.sub_(xi * g)
        self.net.set_weights(self.mixing(step))
        loss = self.cfg.loss(self.net.model(xa), ya)
        grads = torch.autograd.grad(loss, alphas + params, allow_unused=True)
        d_alpha, d_w = list(grads[: len(alphas)]), grads[len(alphas):]
        with torch.no_grad():
            for p, b in zip(params, backup):
                p.copy_(b)
        norm = torch.sqrt(functools.reduce(operator.add, [(g * g).sum() for g in d_w if g is not None]))
        eps = 0.01 / (float(norm) + 1e-12)

        def alpha_grad(sign: float) -> tuple[Any, ...]:
            with torch.no_grad():
                for p, b, g in zip(params, backup, d_w):
                    if g is not None:
                        p.copy_(b + sign * eps * g)
            self.net.set_weights(self.mixing(step))
            return torch.autograd.grad(self.cfg.loss(self.net.model(x), y), alphas, allow_unused=True)

        plus, minus = alpha_grad(1.0), alpha_grad(-1.0)
        with torch.no_grad():
            for p, b in zip(params, backup):
                p.copy_(b)
        for i, (gp, gm) in enumerate(zip(plus, minus)):
            if d_alpha[i] is not None and gp is not None and gm is not None:
                d_alpha[i] = d_alpha[i] - xi * (gp - gm) / (2 * eps)
        self._apply_arch(d_alpha)

    def proposals(self) -> list[dict[str, Any]]:
        return [self.argmax()]

    def argmax(self) -> dict[str, Any]:
        """The most probable value of every active label."""
        ss, values = self.net.search_space, self.net.state.values
        best = {label: values[label][int(a.argmax())] for label, a in self.alpha.items()}
        sample: dict[str, Any] = {}
        for label, spec in ss.items():
            if spec.active(sample):
                sample[label] = best[label]
        return sample

    def summary(self) -> dict[str, Any]:
        return {"probabilities": self.probabilities(), "argmax": self.argmax()}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "alpha": {k: v.detach().clone() for k, v in self.alpha.items()},
                "arch_optimizer": self.arch_optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            for k, v in state["alpha"].items():
                self.alpha[k].copy_(v)
        self.arch_optimizer.load_state_dict(state["arch_optimizer"])


class GumbelDARTS(DARTS):
    """GDAS/SNAS: candidates mixed by Gumbel-softmax samples of ``alpha``; the temperature goes
    from ``tau_max`` to ``tau_min`` (exponentially over training), so the mixtures harden into
    single paths. Otherwise as :class:`DARTS`.

    >>> strategy = td.oneshot.GumbelDARTS(tau_max=5.0, tau_min=0.1)   # doctest: +SKIP
    """

    def __init__(self, *, tau_max: float = 5.0, tau_min: float = 0.1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tau_max = tau_max
        self.tau_min = tau_min

    def validate(self) -> None:
        super().validate()
        if not (isinstance(self.tau_min, (int, float)) and isinstance(self.tau_max, (int, float))
                and 0 < self.tau_min <= self.tau_max):
            raise ValueError(f"The 'tau_min' and 'tau_max' parameters of GumbelDARTS must satisfy "
                             f"0 < tau_min <= tau_max. Got tau_min={self.tau_min!r}, tau_max={self.tau_max!r} instead.")

    def begin_architecture(self, net: Supernet, total_steps: int, rng: random.Random) -> None:
        super().begin_architecture(net, total_steps, rng)
        self._gen = torch.Generator().manual_seed(rng.getrandbits(31))

    def temperature(self, step: int) -> float:
        """``tau_max * (tau_min / tau_max) ** (step / total_steps)``."""
        frac = min(max(step / max(self.total_steps - 1, 1), 0.0), 1.0)
        return self.tau_max * (self.tau_min / self.tau_max) ** frac

    def mixing(self, step: int) -> dict[str, torch.Tensor]:
        tau = self.temperature(step)
        return {label: gumbel_softmax(a, tau, self._gen) for label, a in self.alpha.items()}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "gumbel_rng": self._gen.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._gen.set_state(state["gumbel_rng"])


def gumbel_softmax(logits: torch.Tensor, tau: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``softmax((logits + g) / tau)`` with standard Gumbel noise ``g`` drawn from ``generator``
    (``torch.nn.functional.gumbel_softmax`` takes no generator, and a resumed run must redraw the
    same noise)."""
    u = torch.rand(logits.shape, generator=generator).clamp_(1e-10, 1 - 1e-10)
    g = -torch.log(-torch.log(u))
    return F.softmax((logits + g.to(logits.device)) / tau, dim=-1)


# ---------------------------------------------------------------------------------------------
class Controller(nn.Module):
    """ENAS' controller: an LSTM that emits one categorical decision per active label, in the
    search space's order (parents first), each fed the embedding of the previous decision.

    >>> ctrl = Controller(space.search_space(), hidden=32)      # doctest: +SKIP
    >>> sample, log_prob, entropy = ctrl.sample(torch.Generator())   # doctest: +SKIP
    """

    def __init__(self, search_space: Any, hidden: int = 32, tanh_constant: float = 2.5):
        super().__init__()
        self.search_space = search_space
        self.labels = [label for label, spec in search_space.items() if spec.domain.finite]
        self.values = {label: search_space[label].domain.values() for label in self.labels}
        self.tanh_constant = tanh_constant
        self.start = nn.Parameter(torch.zeros(1, hidden))
        self.lstm = nn.LSTMCell(hidden, hidden)
        self.heads = nn.ModuleDict({str(i): nn.Linear(hidden, len(self.values[lb])) for i, lb in enumerate(self.labels)})
        self.embeds = nn.ModuleDict({str(i): nn.Embedding(len(self.values[lb]), hidden) for i, lb in enumerate(self.labels)})

    def sample(self, generator: torch.Generator | None = None, greedy: bool = False
               ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
        """A sample, its log-probability and its entropy (both differentiable)."""
        inp = self.start
        state = None
        sample: dict[str, Any] = {}
        log_prob = torch.zeros(())
        entropy = torch.zeros(())
        for i, label in enumerate(self.labels):
            if not self.search_space[label].active(sample):
                continue
            h, c = self.lstm(inp, state)
            state = (h, c)
            logits = self.heads[str(i)](h)[0]
            if self.tanh_constant:
                logits = self.tanh_constant * torch.tanh(logits / 5.0)  # ENAS: bounded logits
            logp = F.log_softmax(logits, dim=-1)
            if greedy:
                idx = int(logp.argmax())
            else:
                idx = int(torch.multinomial(logp.exp().detach(), 1, generator=generator))
            sample[label] = self.values[label][idx]
            log_prob = log_prob + logp[idx]
            entropy = entropy - (logp.exp() * logp).sum()
            inp = self.embeds[str(i)](torch.tensor([idx]))
        return sample, log_prob, entropy

    def probability(self, label: str, value: Any, prefix: Mapping[str, Any] | None = None) -> float:
        """The probability of ``label = value`` given the decisions in ``prefix`` before it."""
        inp, state = self.start, None
        prefix = dict(prefix or {})
        with torch.no_grad():
            for i, lb in enumerate(self.labels):
                if not self.search_space[lb].active(prefix) and lb != label:
                    continue
                h, c = self.lstm(inp, state)
                state = (h, c)
                logits = self.heads[str(i)](h)[0]
                if self.tanh_constant:
                    logits = self.tanh_constant * torch.tanh(logits / 5.0)
                probs = F.softmax(logits, dim=-1)
                if lb == label:
                    return float(probs[self.values[lb].index(value)])
                idx = self.values[lb].index(prefix[lb]) if lb in prefix else int(probs.argmax())
                inp = self.embeds[str(i)](torch.tensor([idx]))
        raise KeyError(label)


class ENAS(OneShotStrategy):
    """ENAS: an LSTM controller samples the path trained at each step; every ``controller_every``
    steps it samples ``controller_samples`` paths, scores them on a held-out training batch and is
    updated by REINFORCE with a moving-average baseline (``baseline_decay``) and an entropy bonus
    (``entropy_weight``). The reward is ``reward_metric`` on that batch: ``"val_acc"``,
    ``"val_loss"``, ``"val_mse"`` or ``"val_mae"`` (a loss or an error is negated: the controller
    maximizes its reward); ``None``: accuracy for classification, minus the loss for regression.
    The controller's greedy architecture is evaluated first in the search.

    >>> strategy = td.oneshot.ENAS(controller_lr=1e-3, reward_metric="val_loss")   # doctest: +SKIP
    """

    REWARD_METRICS = {"classification": ("val_acc", "val_loss"), "regression": ("val_mse", "val_mae", "val_loss")}

    def __init__(self, *, controller_lr: float = 1e-3, controller_hidden: int = 32, controller_every: int = 1,
                 controller_samples: int = 1, baseline_decay: float = 0.95, entropy_weight: float = 1e-4,
                 arch_fraction: float = 0.2, reward_metric: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reward_metric = reward_metric
        self.controller_lr = controller_lr
        self.controller_hidden = controller_hidden
        self.controller_every = controller_every
        self.controller_samples = controller_samples
        self.baseline_decay = baseline_decay
        self.entropy_weight = entropy_weight
        self.arch_fraction = arch_fraction

    def validate(self) -> None:
        super().validate()
        owner = type(self).__name__
        if not isinstance(self.controller_lr, (int, float)) or not self.controller_lr > 0:
            raise _param_error(owner, "controller_lr", "a float in the range (0, inf)", self.controller_lr)
        for name in ("controller_hidden", "controller_every", "controller_samples"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _param_error(owner, name, "an int in the range [1, inf)", v)
        if not isinstance(self.baseline_decay, (int, float)) or not 0 <= self.baseline_decay < 1:
            raise _param_error(owner, "baseline_decay", "a float in the range [0, 1)", self.baseline_decay)
        if not isinstance(self.arch_fraction, (int, float)) or not 0 < self.arch_fraction < 1:
            raise _param_error(owner, "arch_fraction", "a float in the range (0, 1)", self.arch_fraction)
        known = sorted({m for names in self.REWARD_METRICS.values() for m in names})
        if self.reward_metric is not None and self.reward_metric not in known:
            raise _param_error(owner, "reward_metric", f"None or one of {known}", self.reward_metric)

    def external_weights(self) -> str | None:
        return "ENAS rewards its controller with tridens' own metrics of each sampled path on held-out batches"

    def begin(self, net: Supernet, cfg: TrainConfig, total_steps: int, rng: random.Random) -> None:
        allowed = self.REWARD_METRICS.get(cfg.task, ())
        if self.reward_metric is not None and self.reward_metric not in allowed:
            raise _param_error(type(self).__name__, "reward_metric", f"one of {list(allowed)} for {cfg.task}",
                               self.reward_metric)
        super().begin(net, cfg, total_steps, rng)
        seed = rng.getrandbits(31)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.controller = Controller(net.search_space, hidden=self.controller_hidden)
        self.controller_optimizer = torch.optim.Adam(self.controller.parameters(), lr=self.controller_lr)
        self._gen = torch.Generator().manual_seed(seed + 1)
        self.baseline: float | None = None

    def reinforce(self, reward_of: Callable[[dict[str, Any]], float]) -> float:
        """One REINFORCE update: sample paths, reward them with ``reward_of``; returns the mean reward."""
        losses, rewards = [], []
        for _ in range(self.controller_samples):
            sample, log_prob, entropy = self.controller.sample(self._gen)
            reward = float(reward_of(sample))
            rewards.append(reward)
            if self.baseline is None:
                self.baseline = reward
            advantage = reward - self.baseline
            self.baseline = self.baseline_decay * self.baseline + (1 - self.baseline_decay) * reward
            losses.append(-advantage * log_prob - self.entropy_weight * entropy)
        self.controller_optimizer.zero_grad(set_to_none=True)
        torch.stack(losses).mean().backward()
        self.controller_optimizer.step()
        return sum(rewards) / len(rewards)

    def step(self, x: torch.Tensor, y: torch.Tensor, arch_batch: Callable[[], Batch], step: int) -> float:
        with torch.no_grad():
            sample, _, _ = self.controller.sample(self._gen)
        self.net.set_path(sample)
        loss = self._weight_step(x, y, step)
        if step % self.controller_every == 0:
            xa, ya = arch_batch()

            def reward(s: dict[str, Any]) -> float:
                self.net.set_path(s)
                with torch.no_grad():
                    out = self.net.model(xa)
                return self.reward_of(out, ya)
            self.reinforce(reward)
        return loss

    def reward_of(self, out: torch.Tensor, y: torch.Tensor) -> float:
        """The reward of a path whose output on the held-out batch is ``out``: ``reward_metric``
        (negated unless it is accuracy)."""
        metric = self.reward_metric or ("val_acc" if self.cfg.task == "classification" else "val_loss")
        sums = ValidationSums(dataclasses.replace(self.cfg, metrics=(metric,)))
        sums.add(out, y)
        value = sums.result()[metric]
        return value if metric == "val_acc" else -value

    def proposals(self) -> list[dict[str, Any]]:
        with torch.no_grad():
            sample, _, _ = self.controller.sample(greedy=True)
        return [sample]

    def summary(self) -> dict[str, Any]:
        return {"greedy": self.proposals()[0], "baseline": self.baseline}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "controller": self.controller.state_dict(),
                "controller_optimizer": self.controller_optimizer.state_dict(), "controller_rng": self._gen.get_state(),
                "baseline": self.baseline}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.controller.load_state_dict(state["controller"])
        self.controller_optimizer.load_state_dict(state["controller_optimizer"])
        self._gen.set_state(state["controller_rng"])
        self.baseline = state["baseline"]
