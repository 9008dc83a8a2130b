"""The shared-pipeline unit: trials reading ONE data pipeline, its members and shared frozen prefixes.

A :class:`SharedPipelineUnit` reads each batch once (indexed and augmented once) and feeds it to
every :class:`PipelineMember`; a :class:`SharedPrefix` computes a frozen prefix once per batch.
The planner that builds these units is :mod:`._cse`.
"""

from __future__ import annotations


import copy
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx as fx

from ..units import ExecutionUnit, Job, UnitResult
from ..evaluators import StepwiseEvaluator
from ..evaluators import SupervisedTrainer, TrainConfig, ValidationSums, BatchSource, SupervisedEvaluator

#: The key of the shared (augmented) input batch among a unit's shared tensors.
BATCH = "batch"

def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------------
# members
# ------------------------------------------------------------------------------------------------
def supervised_trainer(evaluator: StepwiseEvaluator, model: torch.nn.Module | None, sample: Mapping[str, Any],
                       seed: int) -> SupervisedTrainer:
    """``evaluator.trainer(model, sample, seed)`` for a unit that steps it batch by batch (a shared
    pipeline, a stage tree): a :class:`SupervisedTrainer` (Classification, Regression), else a TypeError."""
    trainer = evaluator.trainer(model, sample, seed)
    if not isinstance(trainer, SupervisedTrainer):
        raise TypeError(f"{type(evaluator).__name__}.trainer made a {type(trainer).__name__}; a unit that steps "
                        "trainers batch by batch needs a SupervisedTrainer (Classification, Regression)")
    return trainer


class PipelineMember:
    """What a :class:`SharedPipelineUnit` feeds: one or more trials training on the shared batches.

    ``inputs`` names the shared tensors the member reads (``(BATCH,)``: the augmented input batch;
    otherwise outputs of a :class:`SharedPrefix`); with one name it receives that tensor, with
    several a tuple. Per epoch the unit calls ``begin_epoch()``, ``train_batch(x, y, batch)`` for
    every batch, ``end_epoch()``, then ``begin_validation()``, ``validate_batch(x, y)`` for every
    validation batch and ``end_validation()``. Failures are per trial: a trial whose step raised
    reports the error from ``end_epoch`` and receives no more batches; the others go on.
    """

    inputs: tuple[str, ...] = (BATCH,)

    def trial_ids(self) -> list[int]:  # pragma: no cover - abstract
        """The member's trials still in the unit, in order."""
        raise NotImplementedError

    def limit(self, trial_id: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def epoch(self, trial_id: int) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def wants_epoch(self) -> bool:
        """Whether any of its trials trains this epoch."""
        return any(self.epoch(t) < self.limit(t) for t in self.trial_ids())

    def begin_epoch(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def train_batch(self, x: Any, y: torch.Tensor, batch: int) -> object:  # pragma: no cover - abstract
        """One optimizer step of every trial that trains this epoch and has not failed (what it
        returns is the member's own; the unit ignores it)."""
        raise NotImplementedError

    def end_epoch(self) -> dict[int, dict[str, float] | BaseException]:  # pragma: no cover - abstract
        """Per trial trained this epoch: its training metrics, or the error that failed it."""
        raise NotImplementedError

    def begin_validation(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def validate_batch(self, x: Any, y: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def end_validation(self) -> dict[int, dict[str, float] | BaseException]:  # pragma: no cover - abstract
        raise NotImplementedError

    def weights(self, trial_id: int) -> dict[str, Any] | None:  # pragma: no cover - abstract
        """The trial's weights, keyed as its own model's state_dict."""
        raise NotImplementedError

    def leave(self, trial_id: int) -> None:  # pragma: no cover - abstract
        """Release the trial's state."""
        raise NotImplementedError

    def state_dict(self, trial_id: int, job: Job, evaluator: StepwiseEvaluator) -> dict[str, Any] | None:
        """The trial's trainer checkpoint (None where this member cannot take one)."""
        return None

    def batching(self) -> str:
        """``"force"``: a vectorized model of several trials; ``"auto"``: deciding; ``"off"``."""
        return "off"


class TrainerMember(PipelineMember):
    """One trial: a :class:`SupervisedTrainer` of its model, or of its suffix after a shared prefix.

    ``model`` is the trial's whole model (what ``weights`` returns); ``trainer.model`` is what
    trains (the same model, or the suffix, whose modules are the model's own). ``prefix_buffers``
    maps the model's state_dict keys of the prefix's buffers to the tensors of the shared prefix
    that replace them (BatchNorm running statistics updated once for all members).
    """

    def __init__(self, job: Job, trainer: SupervisedTrainer, *, inputs: tuple[str, ...] = (BATCH,),
                 prefix_buffers: Mapping[str, torch.Tensor] | None = None):
        self.job = job
        self.trainer = trainer
        self.inputs = inputs
        self.prefix_buffers = dict(prefix_buffers or {})
        self.trial_id = job.trial.id
        self._training = False
        self._error: BaseException | None = None
        self._total = 0.0
        self._count = 0
        self._val: ValidationSums | None = None
        self._was_training = True
        self._left = False

    def trial_ids(self) -> list[int]:
        return [] if self._left else [self.trial_id]

    def limit(self, trial_id: int) -> int:
        steps = self.job.max_steps
        return self.trainer.epochs if steps is None else min(self.trainer.epochs, steps)

    def epoch(self, trial_id: int) -> int:
        return self.trainer.epoch

    def begin_epoch(self) -> None:
        self._training = self.wants_epoch()
        self._error = None
        self._total, self._count = 0.0, 0
        if self._training:
            try:
                self.trainer.begin_epoch()
            except Exception as err:
                self._error = err

    def train_batch(self, x: Any, y: torch.Tensor, batch: int) -> None:
        if not self._training or self._error is not None:
            return
        try:
            loss = self.trainer.train_batch(x, y, batch)
        except Exception as err:
            self._error = err
            return
        self._total += loss * len(y)
        self._count += len(y)

    def end_epoch(self) -> dict[int, dict[str, float] | BaseException]:
        if not self._training:
            return {}
        if self._error is not None:
            return {self.trial_id: self._error}
        try:
            return {self.trial_id: self.trainer.end_epoch(self._total / self._count)}
        except Exception as err:
            self._error = err
            return {self.trial_id: err}

    def begin_validation(self) -> None:
        self._val = None
        if not self._training or self._error is not None:
            return
        model = self.trainer.model
        self._was_training = model.training
        model.eval()
        self._val = ValidationSums(self.trainer.config)

    @torch.no_grad()
    def validate_batch(self, x: Any, y: torch.Tensor) -> None:
        if self._val is None or self._error is not None:
            return
        try:
            with self.trainer._random_stream():
                self._val.add(self.trainer.model(x), y)
        except Exception as err:
            self._error = err

    def end_validation(self) -> dict[int, dict[str, float] | BaseException]:
        if not self._training:
            return {}
        if self._val is not None:
            self.trainer.model.train(self._was_training)
        if self._error is not None:
            return {self.trial_id: self._error}
        assert self._val is not None
        return {self.trial_id: self._val.result()}

    def weights(self, trial_id: int) -> dict[str, Any]:
        state = {k: v.detach().cpu() for k, v in self.job.concrete_model.state_dict().items()}
        for key, tensor in self.prefix_buffers.items():
            if key in state:
                state[key] = tensor.detach().cpu().clone()
        return state

    def leave(self, trial_id: int) -> None:
        self._left = True

    def state_dict(self, trial_id: int, job: Job, evaluator: StepwiseEvaluator) -> dict[str, Any] | None:
        trainer = self.trainer
        state = trainer.state_dict()
        if trainer.model is job.model:
            return state
        # A suffix after a shared prefix: its modules are the model's own, so its parameters are
        # found in the whole model by identity; the frozen prefix has no optimizer state.
        index = {id(p): i for i, p in enumerate(job.concrete_model.parameters())}
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        inner = state["optimizer"]["state"]
        cfg = job.config(evaluator)
        state["optimizer"] = {"state": {index[id(params[i])]: s for i, s in inner.items()},
                              "param_groups": cfg.make_optimizer(job.concrete_model.parameters()).state_dict()["param_groups"]}
        # (weights() may hand out the live tensors: a checkpoint must not change as training goes on)
        state["model"] = {k: v.clone() for k, v in self.weights(trial_id).items()}
        return state


# ------------------------------------------------------------------------------------------------
# a shared frozen prefix
# ------------------------------------------------------------------------------------------------
class SharedPrefix:
    """A frozen prefix computed once per batch for several members.

    ``module`` is an fx ``GraphModule`` over the prefix modules of a representative model; it maps
    the input batch to the tuple of tensors named ``outputs``. Its modules' training flags are those
    the representative's own ``train()``/``eval()`` set (``train_flags``/``eval_flags``, over
    ``module.modules()``), so a model that keeps its backbone in eval mode keeps it so. ``calls``
    counts forward passes.
    """

    def __init__(self, key: str, module: fx.GraphModule, outputs: tuple[str, ...], description: str,
                 train_flags: Sequence[bool], eval_flags: Sequence[bool]):
        self.key = key
        self.module = module
        self.outputs = outputs
        self.description = description
        self.train_flags = list(train_flags)
        self.eval_flags = list(eval_flags)
        self.calls = 0

    def _set(self, flags: Sequence[bool]) -> None:
        for m, flag in zip(self.module.modules(), flags):
            m.training = flag

    def train_mode(self) -> None:
        self._set(self.train_flags)

    def eval_mode(self) -> None:
        self._set(self.eval_flags)

    def copy(self) -> "SharedPrefix":
        """An independent copy (own modules and buffers), for a second unit."""
        return SharedPrefix(self.key, copy.deepcopy(self.module), self.outputs, self.description,
                            self.train_flags, self.eval_flags)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        out = self.module(x)
        return dict(zip(self.outputs, out))


# ------------------------------------------------------------------------------------------------
# the unit
# ------------------------------------------------------------------------------------------------
class SharedPipelineUnit(ExecutionUnit):
    """Trials reading ONE data pipeline: each batch is indexed and augmented once per unit and fed
    to every member, validation batches too; shared frozen prefixes run once per batch.

    ``members`` default to one :class:`TrainerMember` per job training its whole model; the
    planner (:func:`plan_cse`) passes members that train suffixes after ``prefixes``. Every job's
    config must share dataset, transforms, batch size, data seed and device (the planner checks).
    ``counts`` holds ``batches`` (training batches read), ``augment`` (augmentation calls) and
    ``val_batches``.
    """

    kind = "cse"
    splittable = True

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, *,
                 members: Sequence[PipelineMember] | None = None, prefixes: Sequence[SharedPrefix] = (),
                 reason: str = "", memory: int | None = None):
        super().__init__(jobs, evaluator)
        self.reason = reason
        self.memory = memory
        self.errors: dict[int, BaseException] = {}
        self.prefixes = {p.key: p for p in prefixes}
        # a shared frozen prefix is the point of such a unit: two halves would each compute it
        self.splittable = not self.prefixes
        self.counts = {"batches": 0, "augment": 0, "val_batches": 0}
        self._order = {job.trial.id: i for i, job in enumerate(jobs)}
        if members is None:
            built: list[PipelineMember] = []
            for job in jobs:
                try:
                    trainer = supervised_trainer(evaluator, job.model, job.sample, job.trial.seed)
                except Exception as err:  # reported as the trial's failure at its first epoch
                    self.errors[job.trial.id] = err
                    continue
                built.append(TrainerMember(job, trainer))
            members = built
        self.members: list[PipelineMember] = list(members)
        self._ever: list[PipelineMember] = list(members)  # members that left too: what they measured stays
        self._by_trial: dict[int, PipelineMember] = {t: m for m in self.members for t in m.trial_ids()}
        self.config: TrainConfig | None = None
        self._seed = jobs[0].trial.seed if jobs else 0
        if jobs and isinstance(evaluator, SupervisedEvaluator):
            try:  # the pipeline every member shares (the planner checked they agree)
                self.config = jobs[0].config(evaluator)
            except Exception:  # the trials' own trainers failed too: reported per trial
                self.config = None
        self._train: BatchSource | None = None
        self._val: BatchSource | None = None
        if self.config is not None:
            self._train = BatchSource(self.config.train, self.config.device)
            self._val = BatchSource(self.config.val, self.config.device)
        self._copies: set[int] = set()  # ids of members that modify their inputs in place

    # -- the ExecutionUnit protocol -------------------------------------------------------------
    def limit(self, trial_id: int) -> int:
        member = self._by_trial.get(trial_id)
        return 0 if member is None else member.limit(trial_id)

    def epoch(self, trial_id: int) -> int:
        member = self._by_trial.get(trial_id)
        return 0 if member is None else member.epoch(trial_id)

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        member = self._by_trial.get(trial_id)
        if member is None:
            model = self.jobs[trial_id].model
            return None if model is None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return member.weights(trial_id)

    def _leave(self, trial_id: int) -> None:
        self.errors.pop(trial_id, None)
        member = self._by_trial.pop(trial_id, None)
        if member is None:
            return
        member.leave(trial_id)
        if not member.trial_ids():
            self.members.remove(member)
            self._copies.discard(id(member))
            used = {key for m in self.members for key in m.inputs}
            for key in [k for k, p in self.prefixes.items() if not used & set(p.outputs)]:
                del self.prefixes[key]  # nobody reads it any more: stop computing it

    def summary(self) -> str:
        ids = ", ".join(str(i) for i in self.jobs)
        text = f"{self.kind} unit of {len(self.jobs)} trial(s) [{ids}]"
        return text + (f": {self.reason}" if self.reason else "")

    def state_dict(self, trial_id: int) -> dict[str, Any] | None:
        member = self._by_trial.get(trial_id)
        return None if member is None else member.state_dict(trial_id, self.jobs[trial_id], self.evaluator)

    def groups(self) -> list[list[int]]:
        return [list(m.trial_ids()) for m in self.members]

    def split(self) -> list[ExecutionUnit] | None:
        """Two units, each reading its own copy of the pipeline, the members dealt by size (largest
        first, to the smaller half); None with fewer than two members, a shared frozen prefix, once
        training began, or with a member that failed to build."""
        if len(self.members) < 2 or self.prefixes or self.counts["batches"] or self.errors:
            return None
        halves: list[list[PipelineMember]] = [[], []]
        for member in sorted(self.members, key=lambda m: -len(m.trial_ids())):
            min(halves, key=lambda h: sum(len(m.trial_ids()) for m in h)).append(member)
        units: list[ExecutionUnit] = []
        for half in halves:
            ids = [t for t in self.jobs if any(t in m.trial_ids() for m in half)]
            units.append(SharedPipelineUnit([self.jobs[t] for t in ids], self.evaluator, members=half,
                                            reason=f"half of a unit split in two: {self.reason}"))
        return units

    def shared(self) -> list[str]:
        return ["one data pipeline"] + [f"frozen prefix {key}" for key in self.prefixes]

    def measurements(self) -> list[Any]:
        return [m for member in self._ever for m in getattr(member, "recorded", ())]

    def speedups(self) -> list[dict[str, Any]]:
        out = []
        for member in self.members:
            measured = getattr(member, "measured", None)  # batched members fused on a measured speed-up
            decided = measured() if measured is not None else None
            if decided:
                out.append(decided)
        return out

    def batching(self) -> str:
        kinds = {m.batching() for m in self.members}
        return "auto" if "auto" in kinds else "force" if "force" in kinds else "off"

    # -- training ---------------------------------------------------------------------------------
    def _shared(self, x: torch.Tensor, prefixes: Iterable[SharedPrefix]) -> dict[str, Any]:
        env: dict[str, Any] = {BATCH: x}
        for prefix in prefixes:
            env.update(prefix(x))
        return env

    def _feed(self, members: Sequence[PipelineMember], env: dict[str, Any], y: torch.Tensor,
              call: Callable[[PipelineMember, Any, torch.Tensor], object], seconds: dict[int, float]) -> None:
        """Give each member its inputs; a member that modifies a shared tensor in place is found by
        the tensor's version counter, the tensor is restored and that member gets copies from then on."""
        readers: dict[str, int] = {}
        for m in members:
            for key in set(m.inputs):
                readers[key] = readers.get(key, 0) + 1
        watched = {k: v for k, v in env.items() if readers.get(k, 0) > 1 and isinstance(v, torch.Tensor)}
        if len(members) > 1:
            watched["__y__"] = y
        pristine = {k: v.clone() for k, v in watched.items()}
        for m in members:
            copies = id(m) in self._copies
            args = [env[k].clone() if copies else env[k] for k in m.inputs]
            x = args[0] if len(args) == 1 else tuple(args)
            versions = {k: v._version for k, v in watched.items()}
            t0 = time.monotonic()
            call(m, x, y.clone() if copies else y)
            seconds[id(m)] = seconds.get(id(m), 0.0) + time.monotonic() - t0
            changed = [k for k, v in watched.items() if v._version != versions[k]]
            if changed and not copies:
                self._copies.add(id(m))
                with torch.no_grad():
                    for k in changed:
                        watched[k].copy_(pristine[k])

    def train_epoch(self) -> dict[int, UnitResult]:
        results: dict[int, UnitResult] = {}
        for trial_id in list(self.errors):
            if trial_id in self.jobs:
                results[trial_id] = self.errors.pop(trial_id)
        members = [m for m in self.members if m.wants_epoch()]
        if not members or self.config is None:
            return results
        cfg = self.config
        assert self._train is not None and self._val is not None
        epochs = {m.epoch(t) for m in members for t in m.trial_ids() if m.epoch(t) < m.limit(t)}
        if len(epochs) != 1:
            raise RuntimeError(f"the members of a shared pipeline must be at the same epoch; got {sorted(epochs)}")
        epoch = epochs.pop()
        needed = {key for m in members for key in m.inputs}
        prefixes = [p for p in self.prefixes.values() if needed & set(p.outputs)]
        seconds: dict[int, float] = {}
        shared = 0.0
        for prefix in prefixes:
            prefix.train_mode()
        for m in members:
            m.begin_epoch()
        t_shared = time.monotonic()
        for batch, (x, y) in enumerate(self._train.epoch_batches(cfg, self._seed, epoch)):
            x = cfg.augment(x, self._seed, epoch, batch)
            self.counts["batches"] += 1
            if cfg.transforms is not None:
                self.counts["augment"] += 1
            env = self._shared(x, prefixes)
            shared += time.monotonic() - t_shared
            self._feed(members, env, y, lambda m, xb, yb: m.train_batch(xb, yb, batch), seconds)
            t_shared = time.monotonic()
        trained: dict[int, dict[str, float] | BaseException] = {}
        for m in members:
            trained.update(m.end_epoch())
        # validation: each batch read once (and each prefix run once) for every member
        for prefix in prefixes:
            prefix.eval_mode()
        for m in members:
            m.begin_validation()
        t_shared = time.monotonic()
        try:
            for x, y in self._val.validation_batches(cfg, self._seed):
                self.counts["val_batches"] += 1
                env = self._shared(x, prefixes)
                shared += time.monotonic() - t_shared
                self._feed(members, env, y, lambda m, xb, yb: m.validate_batch(xb, yb), seconds)
                t_shared = time.monotonic()
        finally:
            for prefix in prefixes:
                prefix.train_mode()
        validated: dict[int, dict[str, float] | BaseException] = {}
        for m in members:
            validated.update(m.end_validation())
        # results in the jobs' order, as the separate unit reports them
        metric = self.objective.metric
        for trial_id in sorted(trained, key=lambda t: self._order.get(t, 0)):
            train = trained[trial_id]
            val = validated.get(trial_id)
            if isinstance(train, BaseException):
                results[trial_id] = train
            elif isinstance(val, BaseException):
                results[trial_id] = val
            else:
                metrics = {**(val or {}), **train}
                if metric in metrics:
                    results[trial_id] = {metric: metrics[metric], **metrics}
                else:
                    results[trial_id] = KeyError(metric)
        # each trial's time: its own steps plus an equal share of the shared work
        share = (shared / len(trained)) if trained else 0.0
        for m in members:
            ids = [t for t in m.trial_ids() if t in trained]
            for trial_id in ids:
                info = self.jobs[trial_id].trial.info
                own = seconds.get(id(m), 0.0) / max(len(ids), 1)
                info["train_seconds"] = info.get("train_seconds", 0.0) + own + share
        return results


# ------------------------------------------------------------------------------------------------
# planning: pipelines
# ------------------------------------------------------------------------------------------------
def _dataset_key(ds: Any) -> Any:
    spec = getattr(ds, "spec", None)
    return ("spec", spec) if isinstance(spec, str) else ("id", id(ds))


_KEY_PARTS = ("training data", "validation data", "batch size", "transforms", "data seed", "device")


def _pipeline_key(cfg: TrainConfig, seed: int) -> tuple[Any, ...]:
    batch = (cfg.batch_size, *cfg.batch_schedule) if cfg.batch_schedule else cfg.batch_size   # sizes per epoch
    return (_dataset_key(cfg.train), _dataset_key(cfg.val), batch,
            None if cfg.transforms is None else id(cfg.transforms), cfg.data_seed_of(seed), str(cfg.device))


def _difference(key: tuple[Any, ...], other: tuple[Any, ...]) -> str:
    for name, a, b in zip(_KEY_PARTS, key, other):
        if a != b:
            if name in ("batch size", "data seed", "device"):
                return f"different {name} ({a}, not {b})"
            return f"different {name}"
    return "alone"  # pragma: no cover - equal keys are grouped
