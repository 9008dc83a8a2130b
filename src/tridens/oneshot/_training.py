"""The supernet's training loop, wherever it runs: in the driver (the in-process executor) or as
one trial on an executor's worker (a pool worker, a Ray task: :class:`SupernetTraining`).

:class:`SupernetLoop` trains epoch by epoch and gives each epoch's checkpoint state (weights, the
strategy's optimizers and architecture parameters, the random states, the epoch's metrics), from
which a resumed loop continues exactly. :class:`SupernetTraining` is that loop as the evaluator of
one trial: the executor runs it where its trials run, it writes each epoch's state to a location
the driver reads back (the run's checkpoint storage) before it reports the epoch, and the driver
copies that state into the store with the epoch's metrics.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Any, Callable, Mapping

import torch
from torch.utils.data import Subset

from ..errors import TridensError
from ..evaluators import BatchSource, Evaluator, NullReporter
from ..trial import Decision, Objective
from ._strategies import OneShotStrategy
from ._supernet import Supernet, build_supernet

__all__ = ["SupernetLoop", "SupernetTraining", "CHECKPOINT_FORMAT", "data_inputs", "jsonable"]

CHECKPOINT_FORMAT = 1


def data_inputs(cfg: Any) -> tuple[torch.Tensor, ...] | None:
    """A few validation inputs, for a supernet that needs inputs the space does not give."""
    if cfg.val is None or len(cfg.val) == 0:
        return None
    x, _ = next(BatchSource(cfg.val, torch.device("cpu")).batches(None, 4))
    return (x,)


def jsonable(obj: Any) -> Any:
    """``obj`` with only JSON values (anything else as its repr)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return repr(obj)


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _as_rng_state(state: Any) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (int(version), tuple(int(v) for v in internal), gauss)


class SupernetLoop:
    """The training of ``net`` by ``strategy`` with the evaluator's config ``cfg`` and ``seed``:
    :meth:`load` a checkpoint state, then :meth:`train_epoch` for each epoch from
    :attr:`start_epoch` to :attr:`epochs` and :meth:`state` after each."""

    def __init__(self, net: Supernet, strategy: OneShotStrategy, cfg: Any, seed: int):
        self.net, self.strategy, self.seed = net, strategy, int(seed)
        self.epochs = int(strategy.epochs or cfg.epochs)
        weights_data, arch_data = self._split(cfg.train)
        self.source = BatchSource(weights_data, cfg.device)
        # The lr schedule spans the supernet's own steps (its epochs over the weights' share of the data).
        self.cfg = dataclasses.replace(cfg, epochs=self.epochs, train=weights_data)
        net.model.to(cfg.device)
        self.rng = random.Random(self.seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            strategy.begin(net, self.cfg, self.cfg.total_steps, self.rng)
        self.start_epoch, self.step = 0, 0
        self.torch_rng = torch.Generator().manual_seed(self.seed).get_state()
        self.arch_of = self._arch_batcher(arch_data) if arch_data is not None else None
        self.current = 0
        self.cpu_s = self.wall_s = 0.0

    def _split(self, train: Any) -> tuple[Any, Any | None]:
        """The training examples for weights and (for DARTS/ENAS) the held-out ones for architecture steps."""
        fraction = float(getattr(self.strategy, "arch_fraction", 0.0) or 0.0)
        if fraction <= 0:
            return train, None
        g = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(len(train), generator=g).tolist()
        n_arch = max(1, int(round(len(train) * fraction)))
        return Subset(train, order[n_arch:]), Subset(train, order[:n_arch])

    def _arch_batcher(self, arch: Any) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """The held-out batch of optimizer step ``step``: a pure function of the step, so a resumed
        run reads the batches an uninterrupted one would."""
        source = BatchSource(arch, self.cfg.device)
        bs = min(self.cfg.batch_size, len(source))
        per_round = len(source) // bs
        cache: dict[int, torch.Tensor] = {}

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            rnd, pos = divmod(step, per_round)
            if rnd not in cache:
                cache.clear()
                g = torch.Generator().manual_seed(self.seed * 7919 + rnd)
                cache[rnd] = torch.randperm(len(source), generator=g)
            return next(iter(source.batches(cache[rnd][pos * bs:(pos + 1) * bs], bs)))
        return batch

    def _arch_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.arch_of is None:
            raise TridensError(f"{type(self.strategy).__name__} asked for architecture data but has no arch_fraction")
        return self.arch_of(self.current)

    def load(self, state: Mapping[str, Any], where: Any) -> None:
        """Continue from a checkpoint ``state`` (read from ``where``, named in the error of a state
        that is not a supernet checkpoint)."""
        if state.get("format") != CHECKPOINT_FORMAT:
            raise TridensError(f"{where} is not a tridens supernet checkpoint")
        self.net.model.load_state_dict(state["model"])
        self.strategy.load_state_dict(state["strategy"])
        self.start_epoch, self.step = int(state["epoch"]), int(state["step"])
        self.rng.setstate(_as_rng_state(state["py_rng"]))
        self.torch_rng = state["torch_rng"]

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """Train epoch ``epoch``; returns its metrics (``train_loss``). A loss that is not finite
        raises :class:`TridensError`."""
        cfg, strategy, net = self.cfg, self.strategy, self.net
        cpu0, wall0 = time.process_time(), time.perf_counter()
        net.model.train()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.source), generator=g)
        total_loss, count = 0.0, 0
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.torch_rng)
            for b, (x, y) in enumerate(self.source.batches(order, cfg.batch_size, cfg.loader_seed(self.seed, epoch))):
                x = cfg.augment(x, self.seed, epoch, b)
                self.current = self.step
                loss = strategy.step(x, y, self._arch_batch, self.step)
                if not math.isfinite(loss):
                    raise TridensError(f"the supernet's training loss became {loss} at epoch {epoch}, batch {b} "
                                       f"({type(strategy).__name__}); a lower 'lr' usually helps")
                self.step += 1
                total_loss += loss * len(y)
                count += len(y)
            self.torch_rng = torch.get_rng_state()
        self.cpu_s += time.process_time() - cpu0
        self.wall_s += time.perf_counter() - wall0
        return {"train_loss": total_loss / max(count, 1)}

    def state(self, epochs_done: int, metrics: Mapping[str, float]) -> dict[str, Any]:
        """The checkpoint after ``epochs_done`` epochs, the last of which reported ``metrics``."""
        return {"format": CHECKPOINT_FORMAT, "model": self.net.model.state_dict(), "strategy": self.strategy.state_dict(),
                "epoch": epochs_done, "step": self.step, "py_rng": _rng_state(self.rng), "torch_rng": self.torch_rng,
                "metrics": {k: float(v) for k, v in metrics.items()}}

    def info(self) -> dict[str, Any]:
        """What the supernet trial's ``info["oneshot"]`` gains from the training since the last call."""
        out = {"epochs": self.epochs, "steps": self.step, **jsonable(self.strategy.summary()),
               "train_cpu_s": self.cpu_s, "train_wall_s": self.wall_s,
               "params": sum(p.numel() for p in self.net.model.parameters())}
        self.cpu_s = self.wall_s = 0.0
        return out


class SupernetTraining(Evaluator):
    """The supernet's training as the evaluator of one trial, for an executor that trains its
    trials in other processes (``td.executors.Process``, ``Ray``). The worker builds the supernet
    of ``space`` (as the driver did, from ``seed``), continues from ``start`` (the store's last
    checkpoint, or None), trains ``strategy`` with ``evaluator``'s config for ``hparams``, and
    after each epoch writes the checkpoint state (with ``info``: what the supernet trial's info
    gains) to ``location`` in ``storage`` (a :class:`~tridens.executors.CheckpointStorage`), then
    reports the epoch's ``train_loss``. A task started again after its worker died (Ray's
    ``max_retries``) continues from ``location``.

    >>> training = SupernetTraining(space, evaluator, td.oneshot.DARTS(), 0, {}, None, storage, "s.pt")  # doctest: +SKIP
    """

    needs_model = False

    def __init__(self, space: Any, evaluator: Any, strategy: OneShotStrategy, seed: int, hparams: Mapping[str, Any],
                 start: Mapping[str, Any] | None, storage: Any, location: str):
        self.space, self.evaluator, self.strategy, self.seed = space, evaluator, strategy, int(seed)
        self.hparams, self.start, self.storage, self.location = dict(hparams), start, storage, location

    def params(self) -> dict[str, Any]:
        return {}

    @property
    def objective(self) -> Objective:
        return Objective("train_loss", "min")

    def evaluate(self, model: Any, sample: Mapping[str, Any], seed: int, reporter: Any = None, *,
                 max_steps: int | None = None) -> float | None:
        if reporter is None:
            reporter = NullReporter()
        cfg = self.evaluator.config(self.hparams)
        net = build_supernet(self.space, seed=self.seed, example_inputs=data_inputs(cfg), verify=False)
        loop = SupernetLoop(net, self.strategy, cfg, self.seed)
        try:
            state, restarted = self.storage.load(self.location), True   # a task started again: its own last epoch
        except FileNotFoundError:
            state, restarted = self.start, False
        if state is not None:
            loop.load(state, self.location if restarted else "the supernet's stored checkpoint")
            if restarted and loop.start_epoch > 0:  # said again: a step the driver has is not recorded twice
                reporter.report(loop.start_epoch - 1, state["metrics"])
        for epoch in range(loop.start_epoch, loop.epochs):
            metrics = loop.train_epoch(epoch)
            self.storage.save(self.location, {**loop.state(epoch + 1, metrics), "info": loop.info()})
            if reporter.report(epoch, metrics) is Decision.STOP:
                break
        return None
