"""Stage trees: trials that share a training prefix train it once, then fork (Hippo).

A trial's training is a sequence of epochs, and what an epoch does depends only on the state it
starts from and on :meth:`~tridens.evaluators.TrainConfig.stage_key` (the learning rates of its
steps, batch size, optimizer, data order, ...). Trials with the same model, seed and initial
weights whose keys agree up to epoch ``e`` are the same computation up to ``e``: a **stage tree**
trains that prefix once. A grid over step-schedule milestones, decay factors and epoch budgets is
mostly shared prefix.

The unit walks the tree in lockstep with the group, one epoch per call, as every unit does: each
live **node** is one trainer holding the trials still identical; before an epoch a node whose
trials' keys disagree forks -- each new branch continues from a copy of the node's complete
trainer state (weights, optimizer state, step counter, random state), so a trial trained through
the tree reports the same per-epoch metrics as trained alone with the same seed. A trial stopped
by the strategy leaves its node; a node with no trial left is freed with what it would have
trained. The tree a trial took is in ``trial.info["stages"]``: ``[node, parent, first epoch]`` per
stage.

>>> from tridens.xopt import plan_stage_trees
>>> units, rest = plan_stage_trees(jobs, evaluator)      # doctest: +SKIP
"""

from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch
from torch import nn

from ..evaluators import StepwiseEvaluator, SupervisedTrainer, TrainConfig
from ..units import ExecutionUnit, Job, UnitResult

__all__ = ["StageTreeUnit", "plan_stage_trees", "MIN_SAVED_FRACTION"]

MIN_SAVED_FRACTION = 0.2
"""A group trains as a stage tree when the tree skips at least this fraction of its trial-epochs."""


@dataclass
class _Node:
    """One stage being trained: a trainer and the trials that are still identical to it."""

    id: int
    parent: int | None
    trainer: SupervisedTrainer
    members: list[int] = field(default_factory=list)


def _weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha1()
    for name, value in model.state_dict().items():
        digest.update(name.encode())
        tensor = value.detach().cpu().contiguous().reshape(-1)
        digest.update(str((tensor.dtype, tuple(value.shape))).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _root_key(job: Job) -> tuple[Any, ...] | None:
    """Trials with equal keys start from the same state: same seed, module structure and weights."""
    if job.model is None or any(p.is_meta for p in job.model.parameters()):
        return None
    return (job.trial.seed, repr(job.model), _weights_digest(job.model))


def tree_size(configs: Sequence[TrainConfig], limits: Sequence[int]) -> int:
    """The epochs a stage tree trains for trials with ``configs`` run for ``limits`` epochs (the
    number of distinct key prefixes), against ``sum(limits)`` trained one by one."""
    prefixes: set[tuple[Hashable, ...]] = set()
    for cfg, limit in zip(configs, limits):
        path: tuple[Hashable, ...] = ()
        for epoch in range(limit):
            path = path + (cfg.stage_key(epoch),)
            prefixes.add(path)
    return len(prefixes)


class StageTreeUnit(ExecutionUnit):
    """Trials of one model, seed and initial weights, trained as a tree of shared stages."""

    kind = "stage tree"

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, reason: str = ""):
        super().__init__(jobs, evaluator)
        self.reason = reason
        self.configs: dict[int, TrainConfig] = {job.trial.id: evaluator.config(job.trial.sample)  # type: ignore[attr-defined]
                                                for job in jobs}
        first = jobs[0]
        root = evaluator.trainer(first.model, first.trial.sample, first.trial.seed)  # type: ignore[arg-type]
        self.nodes: list[_Node] = [_Node(0, None, root, [job.trial.id for job in jobs])]
        self.node_of: dict[int, _Node] = {job.trial.id: self.nodes[0] for job in jobs}
        self.final: dict[int, tuple[int, dict[str, Any]]] = {}  # a finished trial's epochs and weights
        self.next_id = 1
        self.trained_epochs = 0
        for job in jobs:
            job.trial.info["stages"] = [[0, None, 0]]

    def limit(self, trial_id: int) -> int:
        return self._limit_of(self.jobs[trial_id], self.configs[trial_id].epochs)

    def epoch(self, trial_id: int) -> int:
        if trial_id in self.final:
            return self.final[trial_id][0]
        return self.node_of[trial_id].trainer.epoch

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        if trial_id in self.final:
            return self.final[trial_id][1]
        model = self.node_of[trial_id].trainer.model
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    def _fork(self, node: _Node, members: list[int]) -> _Node:
        """A new branch of ``node`` for ``members``, continuing from a copy of its whole state."""
        job = self.jobs[members[0]]
        trainer = self.evaluator.trainer(copy.deepcopy(node.trainer.model), job.trial.sample,  # type: ignore[attr-defined]
                                         job.trial.seed)
        trainer.load_state_dict(node.trainer.state_dict())
        child = _Node(self.next_id, node.id, trainer, members)
        self.next_id += 1
        node.members = [m for m in node.members if m not in members]
        for m in members:
            self.node_of[m] = child
            self.jobs[m].trial.info["stages"].append([child.id, node.id, trainer.epoch])
        self.nodes.append(child)
        return child

    def _split(self, node: _Node) -> list[tuple[_Node, list[int]]]:
        """The node's trials due an epoch, by the key of that epoch; new keys fork."""
        epoch = node.trainer.epoch
        due = [m for m in node.members if epoch < self.limit(m)]
        for m in node.members:
            if m not in due and m not in self.final:  # finished: keep what it ends with
                self.final[m] = (epoch, self.weights(m))
        groups: dict[Hashable, list[int]] = {}
        for m in due:
            groups.setdefault(self.configs[m].stage_key(epoch), []).append(m)
        branches = list(groups.values())
        out = [(node, branches[0])] if branches else []
        out += [(self._fork(node, members), members) for members in branches[1:]]
        return out

    def train_epoch(self) -> dict[int, UnitResult]:
        results: dict[int, UnitResult] = {}
        for node, due in [pair for node in list(self.nodes) for pair in self._split(node)]:
            node.trainer.config = self.configs[due[0]]   # the keys agree: any of them trains this epoch
            t0 = time.monotonic()
            try:
                metrics = dict(node.trainer.train_epoch())
                metrics = {**node.trainer.validate(), **metrics}
                outcome: UnitResult = {self.objective.metric: metrics[self.objective.metric], **metrics}
            except Exception as err:
                outcome = err
            self.trained_epochs += 1
            share = (time.monotonic() - t0) / len(due)
            for m in due:
                results[m] = outcome
                info = self.jobs[m].trial.info
                info["train_seconds"] = info.get("train_seconds", 0.0) + share
        return results

    def _leave(self, trial_id: int) -> None:
        self.final.pop(trial_id, None)
        node = self.node_of.pop(trial_id, None)
        if node is not None:
            node.members = [m for m in node.members if m != trial_id]
            if not node.members:
                self.nodes.remove(node)

    def state_dict(self, trial_id: int) -> dict[str, Any] | None:
        if trial_id in self.final:
            return None
        return self.node_of[trial_id].trainer.state_dict()

    def summary(self) -> str:
        alone = sum(self.limit(t) for t in self.jobs)
        shared = tree_size([self.configs[t] for t in self.jobs], [self.limit(t) for t in self.jobs])
        return (f"stage tree unit of {len(self.jobs)} trial(s) [{', '.join(str(i) for i in self.jobs)}]: "
                f"{shared} epoch(s) for {alone} trial-epochs ({alone / max(shared, 1):.2f}x fewer)"
                + (f"; {self.reason}" if self.reason else ""))


def plan_stage_trees(jobs: Sequence[Job], evaluator: StepwiseEvaluator,
                     min_saved: float = MIN_SAVED_FRACTION) -> tuple[list[ExecutionUnit], list[Job]]:
    """Stage-tree units for the jobs that share training prefixes; the rest are left.

    Jobs group by seed, module structure and initial weights; a group becomes one
    :class:`StageTreeUnit` when its tree skips at least ``min_saved`` of its trial-epochs.
    """
    if not callable(getattr(evaluator, "config", None)):
        return [], list(jobs)
    groups: dict[tuple[Any, ...], list[Job]] = {}
    rest: list[Job] = []
    for job in jobs:
        try:
            key = _root_key(job)
            config = evaluator.config(job.trial.sample)  # type: ignore[attr-defined]
        except Exception:  # an invalid sample fails in its own unit, with its own message
            key, config = None, None
        if key is None or not isinstance(config, TrainConfig):
            rest.append(job)
        else:
            groups.setdefault(key, []).append(job)
    units: list[ExecutionUnit] = []
    for members in groups.values():
        if len(members) < 2:
            rest.extend(members)
            continue
        configs = [evaluator.config(job.trial.sample) for job in members]  # type: ignore[attr-defined]
        limits = [cfg.epochs if job.max_steps is None else min(cfg.epochs, job.max_steps)
                  for cfg, job in zip(configs, members)]
        alone, shared = sum(limits), tree_size(configs, limits)
        if alone and 1 - shared / alone >= min_saved:
            units.append(StageTreeUnit(members, evaluator,
                                       reason=f"shared prefixes skip {1 - shared / alone:.0%} of the trial-epochs"))
        else:
            rest.extend(members)
    position = {job.trial.id: i for i, job in enumerate(jobs)}
    rest.sort(key=lambda job: position[job.trial.id])
    return units, rest
