"""Search over a trained supernet's subnets, scored with inherited weights.

Each subnet's BatchNorm statistics are recalibrated first (the supernet's running statistics
mix every path): reset, then ``bn_batches`` training batches in training mode with a cumulative
average, then the validation set in evaluation mode.
"""

from __future__ import annotations

import collections
import json
import random
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from ..evaluators import TrainConfig, ValidationSums, BatchSource
from ..space import SearchSpace
from ._supernet import Supernet

__all__ = ["evaluate_path", "recalibrate", "evolution", "random_search", "sample_key"]


def sample_key(sample: Mapping[str, Any]) -> str:
    return json.dumps(dict(sorted(sample.items())), sort_keys=True, default=str)


@torch.no_grad()
def recalibrate(net: Supernet, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Reset every BatchNorm's running statistics and re-estimate them on ``batches`` under the
    current path (cumulative average)."""
    norms = [m for m in net.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    was_training = net.model.training
    net.model.train()
    try:
        for x, _ in batches:
            net.model(x)
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        net.model.train(was_training)


@torch.no_grad()
def evaluate_path(net: Supernet, sample: Mapping[str, Any], cfg: TrainConfig, val: BatchSource,
                  calibration: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """The validation metrics of ``sample``'s path with the supernet's weights."""
    net.set_path(sample)
    if calibration:
        recalibrate(net, calibration)
    was_training = net.model.training
    net.model.eval()
    sums = ValidationSums(cfg)
    try:
        for x, y in val.validation_batches(cfg, 0):
            sums.add(net.model(x), y)
    finally:
        net.model.train(was_training)
    return sums.result()


def complete(search_space: SearchSpace, partial: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    """A valid sample keeping ``partial``'s values where active, drawing the others."""
    out: dict[str, Any] = {}
    for label, spec in search_space.items():
        if not spec.active(out):
            continue
        value = partial.get(label, None)
        out[label] = value if label in partial and spec.domain.contains(value) else spec.domain.sample(rng)
    return out


def mutate(search_space: SearchSpace, parent: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
    """``parent`` with one active label changed to another of its values."""
    labels = [lb for lb in parent if search_space[lb].domain.finite and search_space[lb].domain.size() > 1]
    if not labels:
        return dict(parent)
    label = rng.choice(labels)
    others = [v for v in search_space[label].domain.values() if sample_key({"v": v}) != sample_key({"v": parent[label]})]
    child = dict(parent)
    child[label] = rng.choice(others)
    return complete(search_space, child, rng)


def random_search(search_space: SearchSpace, score: Callable[[dict[str, Any]], Any], n: int, rng: random.Random,
                  seen: set[str]) -> None:
    """Score ``n`` distinct random samples (fewer when the space is smaller)."""
    misses = 0
    while len(seen) < n and misses < 200:
        sample = search_space.random_sample(rng)
        key = sample_key(sample)
        if key in seen:
            misses += 1
            continue
        misses = 0
        seen.add(key)
        score(sample)


def evolution(search_space: SearchSpace, score: Callable[[dict[str, Any]], Any], n: int, rng: random.Random,
              seen: set[str], population: int, tournament: int, start: list[tuple[dict[str, Any], Any]]) -> None:
    """Regularized evolution (aging) over samples until ``n`` distinct ones are scored: a random
    population, then tournaments whose winner's one-label mutation replaces the oldest member."""
    pop: collections.deque[tuple[dict[str, Any], Any]] = collections.deque(start[-population:], maxlen=population)
    misses = 0
    while len(seen) < n and misses < 200:
        if len(pop) < population:
            child = search_space.random_sample(rng)
        else:
            contenders = rng.sample(list(pop), min(tournament, len(pop)))
            parent = max(contenders, key=lambda e: e[1])[0]
            child = mutate(search_space, parent, rng)
        key = sample_key(child)
        if key in seen:
            misses += 1
            continue
        misses = 0
        seen.add(key)
        pop.append((child, score(child)))
