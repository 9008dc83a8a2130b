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
stage, node ids ``"<tree>.<n>"`` with ``<tree>`` the lowest trial id of the tree.

With a stage store (:class:`tridens.store.StageArchive`, the ``archive`` of the run's
:class:`~tridens.units.PlanContext`), each stage's end -- where the tree forks, or trials
finish, stop or leave -- is stored: its range, hyperparameters, the trials that went through it and
a checkpoint of the trainer there. A trial then starts from the longest stored prefix of its
:func:`~tridens.evaluators.stage_record` path: a resumed run does not train its finished stages
again, nor a later experiment of the same store those that an earlier one trained. A stage whose
training raises (a NaN loss) is stored as failed; its siblings and parent are not touched.

>>> from tridens.xopt import plan_stage_trees
>>> units, rest = plan_stage_trees(jobs, evaluator)      # doctest: +SKIP
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch
from torch import nn

from ..evaluators import (CHECKPOINT_FORMAT, StepwiseEvaluator, SupervisedTrainer, TrainConfig, record_digest,
                          stage_record)
from ..units import ExecutionUnit, Job, PlanContext, UnitResult
from ._pipeline import supervised_trainer

log = logging.getLogger("tridens")

__all__ = ["StageTreeUnit", "PrefixCache", "plan_stage_trees", "prefix_cache", "MIN_SAVED_FRACTION"]

MIN_SAVED_FRACTION = 0.2
"""A group trains as a stage tree when the tree skips at least this fraction of its trial-epochs."""


@dataclass
class _Node:
    """One stage being trained: a trainer and the trials that are still identical to it.

    ``path`` holds the stage keys of the epochs its trainer has trained, ``history`` their
    metrics; a node started from a cached prefix first reports that prefix's ``history`` (one epoch
    per call, ``reported`` counting) before it trains."""

    id: str
    parent: str | None
    trainer: SupervisedTrainer
    members: list[int] = field(default_factory=list)
    path: tuple[Hashable, ...] = ()
    history: list[dict[str, float]] = field(default_factory=list)
    reported: int = 0
    stage: int | None = None        # the stored stage it continues (its parent in the store)
    stage_from: int = 0             # the epoch its current (not yet stored) stage began
    users: set[int] = field(default_factory=set)   # trials that went through the current stage
    failed: bool = False


class PrefixCache:
    """Trainer states at the end of trained epochs, by (initial state, stage keys so far): a later
    TrialGroup of the same experiment starts a trial from the longest prefix trained before instead
    of training it again. Least recently used entries go first beyond ``max_bytes``; it is not
    pickled (a unit sent to another process starts with an empty one).

    >>> PrefixCache(max_bytes=2**20).longest(("root",), [("k0",)], 1)
    (0, None)
    """

    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[Any, ...], tuple[dict[str, Any], list[dict[str, float]], str, int,
                                                         tuple[int | None, int]]] = OrderedDict()
        self.size = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"max_bytes": self.max_bytes, "entries": OrderedDict(), "size": 0}

    def put(self, root: tuple[Any, ...], path: tuple[Hashable, ...], state: dict[str, Any],
            history: list[dict[str, float]], node: str, stage: tuple[int | None, int] = (None, 0)) -> None:
        size = sum(v.numel() * v.element_size() for v in _tensors(state))
        if size > self.max_bytes // 8:
            return
        key = (root, path)
        if key in self.entries:
            self.size -= self.entries.pop(key)[3]
        self.entries[key] = (state, [dict(h) for h in history], node, size, stage)
        self.size += size
        while self.size > self.max_bytes and self.entries:
            self.size -= self.entries.popitem(last=False)[1][3]

    def longest(self, root: tuple[Any, ...], keys: Sequence[Hashable], limit: int
                ) -> tuple[int, tuple[dict[str, Any], list[dict[str, float]], str, tuple[int | None, int]] | None]:
        """The most epochs (at most ``limit``) of ``keys`` trained before, and that entry: state,
        history, node, and (stored stage it continues, epoch its stage began)."""
        for epoch in range(min(limit, len(keys)), 0, -1):
            entry = self.entries.get((root, tuple(keys[:epoch])))
            if entry is not None:
                self.entries.move_to_end((root, tuple(keys[:epoch])))
                # a copy: loading a state shares its optimizer tensors, which training then changes in place
                return epoch, (copy.deepcopy(entry[0]), entry[1], entry[2], entry[4])
        return 0, None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def prefix_cache(context: PlanContext) -> PrefixCache:
    """The prefix cache of a run (its plan context's ``stages``, made on first use): the states of
    trained prefixes that later groups of the run start from."""
    if context.stages is None:
        context.stages = PrefixCache()
    cache: PrefixCache = context.stages
    return cache


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


def _archive_root(job: Job, root: tuple[Any, ...] | None) -> str | None:
    """The stored form of a root key: a digest of the model fingerprint, seed, structure, initial
    weights, torch version and checkpoint format (no fingerprint: not shared across runs)."""
    if root is None or not job.trial.fingerprint:
        return None
    return hashlib.sha1(repr((job.trial.fingerprint, *root, torch.__version__, CHECKPOINT_FORMAT)).encode()).hexdigest()


def _record_paths(config: TrainConfig, limit: int) -> list[str] | None:
    """``paths[e]``: the digest of the stage records of epochs ``0..e`` (None: not storable)."""
    paths, previous = [], ""
    for epoch in range(limit):
        record = stage_record(config, epoch)
        if record is None:
            return None
        previous = record_digest(previous, record)
        paths.append(previous)
    return paths


def _summary(config: TrainConfig, first: int, last: int) -> dict[str, Any]:
    """The hyperparameters of epochs ``[first, last)`` as plain data: their stage records with the
    learning rates as [first, last] and the batch sizes they use (what ``tridens show`` prints)."""
    records = [stage_record(config, e) or {} for e in range(first, last)]
    lrs = [lr for r in records for lr in r.get("lrs", [])]
    out = {k: v for k, v in (records[0] if records else {}).items() if k not in ("lrs", "batch_size")}
    out["batch_size"] = sorted({r.get("batch_size") for r in records}, key=str)
    out["lr"] = [lrs[0], lrs[-1]] if lrs else []
    return out


def _first_step(config: TrainConfig, epoch: int) -> int:
    """The first optimizer step of ``epoch``."""
    return config.epoch_steps(epoch)[0]


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


def _keys(config: TrainConfig, limit: int) -> list[Hashable]:
    return [config.stage_key(epoch) for epoch in range(limit)]


class StageTreeUnit(ExecutionUnit):
    """Trials of one model, seed and initial weights, trained as a tree of shared stages; with a
    :class:`PrefixCache`, each trial starts from the longest prefix trained before."""

    kind = "stage tree"

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, reason: str = "",
                 cache: PrefixCache | None = None, archive: Any = None):
        super().__init__(jobs, evaluator)
        self.reason = reason
        self.cache = cache
        self.configs: dict[int, TrainConfig] = {job.trial.id: job.config(evaluator)
                                                for job in jobs}
        self.root = _root_key(jobs[0])
        self.tree_id = min(job.trial.id for job in jobs)   # node ids "tree.n" are unique in the store
        self.nodes: list[_Node] = []
        self.node_of: dict[int, _Node] = {}
        self.final: dict[int, tuple[int, dict[str, Any] | None, dict[str, Any] | None]] = {}  # epochs, weights, state
        self.next_id = 0
        self.trained_epochs = 0
        self.reused_epochs = 0
        self.stored_epochs = 0   # of those, epochs loaded from the stage store (earlier runs)
        self.archive = archive   # a tridens.store.StageArchive (or a view of it) where the run stores stages
        self.archive_root = None if self.archive is None else _archive_root(jobs[0], self.root)
        self.paths: dict[int, list[str] | None] = {}
        starts: dict[tuple[Hashable, ...], list[Job]] = {}
        found: dict[tuple[Hashable, ...], Any] = {}
        stored: dict[tuple[Hashable, ...], tuple[int, str]] = {}
        for job in jobs:
            tid = job.trial.id
            limit = self.limit(tid)
            epoch, entry = (0, None) if cache is None or self.root is None else \
                cache.longest(self.root, _keys(self.configs[tid], limit), limit)
            if self.archive_root is not None:
                self.paths[tid] = paths = _record_paths(self.configs[tid], limit)
                depth = 0 if paths is None else self.archive.deepest(self.archive_root, paths)
                if depth > epoch:
                    epoch, entry = depth, None
                    stored[tuple(_keys(self.configs[tid], depth))] = (depth, paths[depth - 1])  # type: ignore[index]
            path = tuple(_keys(self.configs[tid], epoch))
            starts.setdefault(path, []).append(job)
            found[path] = entry
        for path, members in starts.items():
            entry = found[path]
            ids = [job.trial.id for job in members]
            first = members[0]
            trainer = supervised_trainer(evaluator, first.model if entry is None and path not in stored
                                         else copy.deepcopy(first.model), first.sample, first.trial.seed)
            if path in stored:   # a stage stored by an earlier run: loaded once for its trials
                hit = self.archive.load(self.archive_root, stored[path][1], stored[path][0])
                try:
                    if hit is not None:
                        trainer.load_state_dict(hit.state)
                except Exception as err:   # a checkpoint this trainer cannot continue from: train it again
                    log.warning("stage tree: stored stage %d not used (%s: %s)", hit.stage, type(err).__name__, err)
                    hit = None
                if hit is None:
                    path, entry = (), None
                    trainer = supervised_trainer(evaluator, first.model, first.sample, first.trial.seed)
                else:
                    entry = (hit.state, hit.history, hit.label, (hit.stage, hit.epochs))
                    self.archive.link(hit.stage, ids)
                    self.stored_epochs += hit.epochs
                    for job in members:
                        job.trial.info["stage_store"] = {"stage": hit.stage, "epochs": hit.epochs,
                                                         "experiment": hit.experiment}
                    log.info("stage tree: trial(s) %s start from stored stage %d (node %s: their first %d epoch(s), "
                             "trained by %s): not trained again", ", ".join(map(str, ids)), hit.stage, hit.label, hit.epochs,
                             "this experiment before" if hit.experiment == self.archive.experiment
                             else f"experiment {hit.experiment!r}")
            elif entry is not None:
                trainer.load_state_dict(entry[0])
            node = self._new_node(None if entry is None else entry[2], trainer, ids)
            if entry is not None:
                node.path, node.history = path, [dict(h) for h in entry[1]]
                node.stage, node.stage_from = entry[3]
                node.reported = len(path)
                self._store_stage(node, label=entry[2])   # started inside a stage: its part so far is one
                node.reported = 0
                self.reused_epochs += len(path)
            for job in members:
                job.trial.info["stages"] = ([[entry[2], None, 0]] if entry is not None else []) + \
                    [[node.id, None if entry is None else entry[2], len(path)]]

    def _new_node(self, parent: str | None, trainer: SupervisedTrainer, members: list[int]) -> _Node:
        node = _Node(f"{self.tree_id}.{self.next_id}", parent, trainer, members, users=set(members))
        self.next_id += 1
        self.nodes.append(node)
        for m in members:
            self.node_of[m] = node
        return node

    def limit(self, trial_id: int) -> int:
        return self._limit_of(self.jobs[trial_id], self.configs[trial_id].epochs)

    def epoch(self, trial_id: int) -> int:
        if trial_id in self.final:
            return self.final[trial_id][0]
        return self.node_of[trial_id].reported

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        if trial_id in self.final:
            return self.final[trial_id][1]
        model = self.node_of[trial_id].trainer.model
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    def state_dict(self, trial_id: int) -> dict[str, Any] | None:
        """The trial's checkpoint: its node's trainer state (the trial's own, as trained alone)."""
        if trial_id in self.final:
            return self.final[trial_id][2]
        node = self.node_of.get(trial_id)
        return None if node is None else node.trainer.state_dict()

    def groups(self) -> list[list[int]]:
        """The members by the node (stage) they are in now."""
        return [list(node.members) for node in self.nodes if node.members]

    def shared(self) -> list[str]:
        alone = sum(self.limit(t) for t in self.jobs)
        shared = tree_size([self.configs[t] for t in self.jobs], [self.limit(t) for t in self.jobs])
        return [f"training prefixes: {shared} epoch(s) for {alone} trial-epochs"] + (
            [f"{self.reused_epochs} epoch(s) trained by earlier groups"] if self.reused_epochs else [])

    def _fork(self, node: _Node, members: list[int]) -> _Node:
        """A new branch of ``node`` for ``members``, continuing from a copy of its whole state."""
        job = self.jobs[members[0]]
        trainer = supervised_trainer(self.evaluator, copy.deepcopy(node.trainer.model), job.sample, job.trial.seed)
        trainer.load_state_dict(node.trainer.state_dict())
        node.members = [m for m in node.members if m not in members]
        node.users -= set(members)   # they go through the child's stage, not the node's next one
        child = self._new_node(node.id, trainer, members)
        child.path, child.history, child.reported = node.path, list(node.history), node.reported
        child.stage, child.stage_from = node.stage, node.stage_from
        for m in members:
            self.jobs[m].trial.info["stages"].append([child.id, node.id, trainer.epoch])
        return child

    def _split(self, node: _Node) -> list[tuple[_Node, list[int]]]:
        """The node's trials due an epoch, by the key of that epoch; new keys fork."""
        epoch = node.reported
        due = [m for m in node.members if epoch < self.limit(m)]
        for m in node.members:
            if m not in due and m not in self.final:  # finished: keep what it ends with
                self.final[m] = (epoch, self.weights(m), node.trainer.state_dict())
        if epoch < node.trainer.epoch:   # replaying a cached prefix: the members agree on it
            return [(node, due)] if due else []
        groups: dict[Hashable, list[int]] = {}
        for m in due:
            groups.setdefault(self.configs[m].stage_key(epoch), []).append(m)
        branches = list(groups.values())
        if len(branches) > 1 or len(due) < len(node.members):   # a branch point: the stage ends here
            self._store_stage(node)
        out = [(node, branches[0])] if branches else []
        out += [(self._fork(node, members), members) for members in branches[1:]]
        return out

    def _train(self, node: _Node, due: list[int]) -> UnitResult:
        config = node.trainer.config = self.configs[due[0]]   # the keys agree: any of them trains this epoch
        key = config.stage_key(node.trainer.epoch)
        try:
            metrics = dict(node.trainer.train_epoch())
            metrics = {**node.trainer.validate(), **metrics}
        except Exception as err:
            node.failed = True
            self._store_failure(node, due, err)
            return err
        self.trained_epochs += 1
        outcome = {self.objective.metric: metrics[self.objective.metric], **metrics}
        node.path = node.path + (key,)
        node.history.append(outcome)
        if self.cache is not None and self.root is not None:
            self.cache.put(self.root, node.path, node.trainer.state_dict(), node.history, node.id,
                           (node.stage, node.stage_from))
        return outcome

    def train_epoch(self) -> dict[int, UnitResult]:
        results: dict[int, UnitResult] = {}
        for node, due in [pair for node in list(self.nodes) for pair in self._split(node)]:
            t0 = time.monotonic()
            outcome = node.history[node.reported] if node.reported < node.trainer.epoch else self._train(node, due)
            node.reported += 1
            share = (time.monotonic() - t0) / len(due)
            for m in due:
                results[m] = dict(outcome) if isinstance(outcome, dict) else outcome
                info = self.jobs[m].trial.info
                info["train_seconds"] = info.get("train_seconds", 0.0) + share
        return results

    def _leave(self, trial_id: int) -> None:
        self.final.pop(trial_id, None)
        node = self.node_of.pop(trial_id, None)
        if node is not None:
            if not node.failed:
                self._store_stage(node)   # a trial leaves (finished or stopped): the stage ends where it got to
            node.members = [m for m in node.members if m != trial_id]
            node.users.discard(trial_id)
            if not node.members:
                self.nodes.remove(node)

    def _store_stage(self, node: _Node, label: str | None = None) -> None:
        """Store the node's current stage (from ``stage_from`` to its trainer's epoch): the trials
        that went through it, its hyperparameters, and a checkpoint of the trainer there."""
        end = node.trainer.epoch
        if self.archive is None or self.archive_root is None or end <= node.stage_from or node.reported < end:
            return
        member = next(iter(node.members), None)
        paths = None if member is None else self.paths.get(member)
        if member is None or paths is None or len(paths) < end:
            return
        config = self.configs[member]
        sid = self.archive.save(
            root=self.archive_root, path=paths[end - 1], parent=node.stage, label=label or node.id,
            epochs=(node.stage_from, end), steps=(_first_step(config, node.stage_from), node.trainer.step),
            hyperparameters=_summary(config, node.stage_from, end), history=node.history[:end],
            state=node.trainer.state_dict(), trials=sorted(node.users))
        node.stage, node.stage_from, node.users = sid, end, set(node.members)

    def _store_failure(self, node: _Node, due: list[int], err: BaseException) -> None:
        """Store the node's stage up to the epoch that raised, as failed (never reused)."""
        if self.archive is None or self.archive_root is None:
            return
        paths = self.paths.get(due[0])
        epoch = node.trainer.epoch
        if paths is None or len(paths) <= epoch:
            return
        config = self.configs[due[0]]
        first = err.args[0] if err.args else type(err).__name__
        self.archive.fail(root=self.archive_root, path=paths[epoch], parent=node.stage, label=node.id,
                          epochs=(node.stage_from, epoch + 1), steps=(_first_step(config, node.stage_from), node.trainer.step),
                          hyperparameters=_summary(config, node.stage_from, epoch + 1),
                          error=f"{type(err).__name__}: {str(first).splitlines()[0] if str(first) else ''}",
                          trials=sorted(node.users | set(due)))

    def summary(self) -> str:
        alone = sum(self.limit(t) for t in self.jobs)
        shared = tree_size([self.configs[t] for t in self.jobs], [self.limit(t) for t in self.jobs])
        return (f"stage tree unit of {len(self.jobs)} trial(s) [{', '.join(str(i) for i in self.jobs)}]: "
                f"{shared} epoch(s) for {alone} trial-epochs ({alone / max(shared, 1):.2f}x fewer)"
                + (f", {self.reused_epochs} reused from earlier groups" if self.reused_epochs else "")
                + (f"; {self.reason}" if self.reason else ""))


def plan_stage_trees(jobs: Sequence[Job], evaluator: StepwiseEvaluator, min_saved: float = MIN_SAVED_FRACTION, *,
                     settings: Any = None, context: PlanContext | None = None) -> tuple[list[ExecutionUnit], list[Job]]:
    """Stage-tree units for the jobs that share training prefixes, among themselves or with trials
    of earlier groups of the run (its ``context``'s :func:`prefix_cache`) or with stages stored by
    earlier runs (``context.archive``); the rest are left.

    Jobs group by seed, module structure and initial weights; a group becomes one
    :class:`StageTreeUnit` when it trains at least ``min_saved`` fewer epochs than its trials alone.
    (No knob of ``settings``, the :class:`~tridens.xopt.Settings`, changes stage trees.)
    """
    if not callable(getattr(evaluator, "config", None)):
        return [], list(jobs)
    context = context if context is not None else PlanContext()
    cache = prefix_cache(context)
    archive = context.archive
    groups: dict[tuple[Any, ...], list[Job]] = {}
    rest: list[Job] = []
    for job in jobs:
        try:
            key = _root_key(job)
            config = job.config(evaluator)
        except Exception:  # an invalid sample fails in its own unit, with its own message
            key, config = None, None
        if key is None or not isinstance(config, TrainConfig):
            rest.append(job)
        else:
            groups.setdefault(key, []).append(job)
    units: list[ExecutionUnit] = []
    for root, members in groups.items():
        stored_root = None if archive is None else _archive_root(members[0], root)
        if stored_root is not None and not archive.has_root(stored_root):
            stored_root = None
        if len(members) < 2 and stored_root is None and not any(key[0] == root for key in cache.entries):
            rest.extend(members)   # nothing to share (the default per-trial seeds): skip the stage keys
            continue
        configs = [job.config(evaluator) for job in members]
        limits = [cfg.epochs if job.max_steps is None else min(cfg.epochs, job.max_steps)
                  for cfg, job in zip(configs, members)]
        alone = sum(limits)
        prefixes = {tuple(keys[:e + 1]) for cfg, limit in zip(configs, limits)
                    for keys in [_keys(cfg, limit)] for e in range(limit)}
        cached = {p for p in prefixes if (root, p) in cache.entries}
        if stored_root is not None:   # prefixes stored by earlier runs count as trained
            for cfg, limit in zip(configs, limits):
                paths = _record_paths(cfg, limit)
                depth = 0 if paths is None else archive.deepest(stored_root, paths)
                cached.update(tuple(_keys(cfg, e)) for e in range(1, depth + 1))
        needed = len(prefixes) - len(cached)
        if alone and 1 - needed / alone >= min_saved:
            units.append(StageTreeUnit(members, evaluator, cache=cache, archive=archive, reason=(
                f"shared prefixes skip {1 - needed / alone:.0%} of the trial-epochs")))
        else:
            rest.extend(members)
    position = {job.trial.id: i for i, job in enumerate(jobs)}
    rest.sort(key=lambda job: position[job.trial.id])
    return units, rest
