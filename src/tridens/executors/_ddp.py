"""Data-parallel training of one declarative trial over several worker processes (torch DDP).

Fluid (:mod:`._fluid`) gives a trial a share above 1 by running it as ``world`` ranks, one per
worker. Every rank builds the same :class:`~tridens.evaluators.SupervisedTrainer` (same model,
sample and seed), walks the same batches in the same order, and takes its own contiguous slice of
each global batch; :class:`torch.nn.parallel.DistributedDataParallel` averages the gradients.
Each rank scales its slice's mean loss by ``world * slice / batch`` so that the averaged gradient
is exactly the gradient of the global batch's mean loss: with the same global batch the trial
trains as it would in one process, up to float summation order. Differences that remain by
design: dropout draws different masks (each rank draws for its own slice), and BatchNorm
normalizes with per-rank batch statistics (``SyncBatchNorm`` needs GPUs). Validation is split over
the ranks (:func:`validate`); rank 0 talks to the driver, and decisions reach the other ranks by a
broadcast.

>>> group = init_group(rank=0, world=2, port=29512)            # doctest: +SKIP
>>> metrics = train_epoch(trainer, rank=0, world=2)             # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import math
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..evaluators import NonFiniteLoss

__all__ = ["free_port", "init_group", "close_group", "train_epoch", "validate", "broadcast"]


def free_port() -> int:
    """A TCP port free on this machine right now (for a rendezvous on 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_group(rank: int, world: int, port: int, timeout: float = 120.0) -> None:
    """Join a gloo process group of ``world`` ranks meeting at 127.0.0.1:``port``.

    Rank 0 serves the rendezvous (a ``TCPStore``) from a socket it binds to 127.0.0.1 itself:
    given only the address, ``TCPStore`` listens on every interface, so other machines could
    reach it."""
    delta = datetime.timedelta(seconds=timeout)
    listen_fd = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(max(world, 16))
        listen_fd = listener.detach()  # the store owns the descriptor from here
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, delta, master_listen_fd=listen_fd)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=delta)


def close_group() -> None:
    """Leave the group: a barrier first (every rank's gloo work is done and no rank is still
    inside a collective), then ``destroy_process_group``. Destroying while a peer still waited in
    a collective is what made ProcessGroupGloo's destructor block (it joins gloo's threads, and a
    thread in an unmatched collective returns only at the group's timeout); with a barrier first
    the pool's workers are torn down cleanly and can serve the next placement."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def broadcast(value: Any, rank: int) -> Any:
    """``value`` of rank 0, on every rank."""
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _slice(n: int, rank: int, world: int) -> tuple[int, int]:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def train_epoch(trainer: Any, rank: int, world: int, ddp: DistributedDataParallel | None = None, *,
                step_times: list[float] | None = None, max_timed: int = 6) -> dict[str, float]:
    """One epoch of ``trainer`` (a SupervisedTrainer) as rank ``rank`` of ``world``; returns
    ``{"train_loss": ...}`` over the whole epoch, the same number on every rank. With a
    ``step_times`` list, the seconds of the first ``max_timed`` steps (batch and step) go there."""
    cfg = trainer.config
    ddp = ddp if ddp is not None else DistributedDataParallel(trainer.model)
    trainer.begin_epoch()
    total = torch.zeros(1, dtype=torch.float64)
    t0 = time.perf_counter()
    for batch, x, y in trainer.epoch_batches():
        n = len(y)
        lo, hi = _slice(n, rank, world)
        lr = cfg.lr_at(trainer.step)
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        with trainer._random_stream():
            trainer.optimizer.zero_grad(set_to_none=True)
            out = ddp(x[lo:hi])
            if hi > lo:
                local = cfg.loss(out, y[lo:hi])
                scaled = local * (world * (hi - lo) / n)
            else:  # a batch smaller than the world: this rank still joins the gradient all-reduce
                local = out.sum() * 0.0
                scaled = local
            # One small all-reduce tells every rank the batch's loss, so a non-finite loss stops
            # all ranks at the same batch (a rank raising alone would leave the others waiting).
            part = torch.tensor([float(local.detach()) * (hi - lo)], dtype=torch.float64)
            dist.all_reduce(part)
            value = float(part) / n
            if not math.isfinite(value):
                raise NonFiniteLoss.at(trainer.owner, value, epoch=trainer.epoch, batch=batch, step=trainer.step, lr=lr)
            scaled.backward()
            trainer.optimizer.step()
        trainer.step += 1
        total += value * n
        if step_times is not None and len(step_times) < max_timed:
            t1 = time.perf_counter()
            step_times.append(t1 - t0)
            t0 = t1
    return trainer.end_epoch(float(total) / len(trainer._train))


def validate(trainer: Any, rank: int, world: int) -> dict[str, float]:
    """``trainer.validate()`` split over the ranks: rank ``r`` scores validation batches ``r``,
    ``r + world``, ... and the sums are all-reduced, so every rank returns the metrics of the whole
    validation set (those of one process up to float summation order) in about 1/world the time."""
    sums = trainer.validation_sums(rank, world)
    names = list(sums.sums)
    total = torch.tensor([float(sums.n), float(sums.elements), *(sums.sums[k] for k in names)], dtype=torch.float64)
    dist.all_reduce(total)
    sums.n, sums.elements = int(total[0]), int(total[1])
    sums.sums = dict(zip(names, total[2:].tolist()))
    return sums.result()
