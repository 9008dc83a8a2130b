"""The worker side of the Ray executor for declarative (step-wise) evaluators: one Ray task per
execution unit (:mod:`._planner`), and Fluid's data-parallel placements.

A unit task receives its members (the trials' records, their models pickled before the driver
planned, their budgets), plans them again on the worker with the same optimizations and memory
bound (so the same fused unit is built there), and trains it epoch by epoch. After each epoch it
writes every member's checkpoint to storage, posts every member's metrics to the hub, and waits for
the driver's per-member decisions: a member told to stop (or out of budget) saves its final
weights and leaves the unit, the others go on.

**Checkpoints and restarts.** A member's checkpoint is a trainer checkpoint (what
``SupervisedTrainer.state_dict()`` holds: weights, optimizer state, epoch, step, random state),
taken from whichever unit trains it: a separate trainer as is; a member of a shared-pipeline,
mixed or super-graph unit from its trainer, with a suffix-after-a-shared-prefix's optimizer state
re-indexed onto the whole model; a member of a batched unit from its row of the stacked weights,
optimizer state and random stream. Fused units cannot resume mid-way (a batched stack, a shared
prefix or tied super-graph tensors are rebuilt only from initial models), so a unit whose worker
died restarts its unfinished members **as separate trials** (one task training them one after
another) from their last checkpoints. Their metrics go on as the fused run's would (fused equals
separate, see :mod:`tridens.xopt`), except for a super-graph unit, whose children train apart
after the restart (their tied tensors are no longer shared). A member killed before its first
checkpoint starts again from its first epoch (the driver does not record an epoch twice).

**Data parallel (Fluid share > 1).** One task reserving ``share`` CPUs (or GPUs) starts ``share``
local processes, one DDP rank each (:mod:`._ddp`, gloo; one node), and relays rank 0's reports to
the hub and the decisions back. The ranks are killed, never torn down, when the trial ends
(tearing a gloo group down can hang, see :mod:`._fluid`).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
from typing import Any, Mapping, Sequence

import ray
import torch

from ..evaluators._base import StepwiseEvaluator
from ..trial import Decision
from ..units import Job
from ._execution import _error_text

__all__ = ["run_unit", "member_state"]

log = logging.getLogger("tridens")

YIELD = "yield"  # a Fluid decision: checkpoint and leave, to be placed again at a new share
DROP = "drop"    # the driver gave up on the member (its timeout): leave without a word


# -- a member's trainer checkpoint, from the unit that trains it -------------------------------------
def _optimizer_groups(evaluator: StepwiseEvaluator, job: Job) -> list[dict[str, Any]]:
    """The param_groups of a fresh optimizer over the trial's whole model (lr is reset every step)."""
    cfg = evaluator.config(job.trial.sample)  # type: ignore[attr-defined]
    return cfg.make_optimizer(job.model.parameters()).state_dict()["param_groups"]


def _trainer_member_state(member: Any, job: Job, evaluator: StepwiseEvaluator) -> dict[str, Any]:
    trainer = member.trainer
    state = trainer.state_dict()
    if trainer.model is job.model:
        return state
    # A suffix after a shared prefix: its modules are the model's own, so its parameters are found
    # in the whole model by identity; the frozen prefix has no optimizer state.
    index = {id(p): i for i, p in enumerate(job.model.parameters())}
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    inner = state["optimizer"]["state"]
    state["optimizer"] = {"state": {index[id(params[i])]: s for i, s in inner.items()},
                          "param_groups": _optimizer_groups(evaluator, job)}
    # (weights() may hand out the live tensors: a checkpoint must not change as training goes on)
    state["model"] = {k: v.clone() for k, v in member.weights(job.trial.id).items()}
    return state


def _batched_member_state(member: Any, job: Job, evaluator: StepwiseEvaluator) -> dict[str, Any] | None:
    from ..evaluators import CHECKPOINT_FORMAT as _CHECKPOINT_FORMAT

    tid = job.trial.id
    if tid not in member.ids or member.device.type != "cpu":
        return None  # (a CUDA stack's random streams are not a SupervisedTrainer's)
    row = member.ids.index(tid)
    opt = member.optimizer
    adaptive = opt.kind in ("adam", "adamw", "rmsprop")  # torch keeps a step count per parameter
    state: dict[int, dict[str, Any]] = {}
    for i, (name, _) in enumerate(job.model.named_parameters()):
        stacked = opt.state.get(name)
        if not stacked:
            continue
        entry = {k: v[row].detach().clone().cpu() for k, v in stacked.items()}
        if adaptive:
            entry["step"] = torch.tensor(float(opt.steps[name]))
        state[i] = entry
    return {"format": _CHECKPOINT_FORMAT, "model": member.weights(tid),
            "optimizer": {"state": state, "param_groups": _optimizer_groups(evaluator, job)},
            "epoch": member.epoch(tid), "step": member.step, "seed": job.trial.seed,
            "rng": member._generators[tid].get_state().clone()}


def member_state(unit: Any, trial_id: int, evaluator: StepwiseEvaluator) -> dict[str, Any] | None:
    """The trainer checkpoint of ``trial_id`` in ``unit`` (None where none can be taken: then the
    member restarts from its first epoch)."""
    from ..units import SeparateUnit

    job = unit.jobs[trial_id]
    if isinstance(unit, SeparateUnit):
        trainer = unit.trainers.get(trial_id)
        return None if trainer is None else trainer.state_dict()
    from ..xopt._adaptive import AdaptiveMember
    from ..xopt._batching import BatchedMember, BatchedUnit
    from ..xopt._cse import JointMember, SharedPipelineUnit, TrainerMember

    member: Any = None
    if isinstance(unit, BatchedUnit):
        member = unit.member
    elif isinstance(unit, SharedPipelineUnit):
        member = unit._by_trial.get(trial_id)
        if isinstance(member, JointMember):  # members stepped together keep each trial's TrainerMember
            member = member._by.get(trial_id)
    if isinstance(member, AdaptiveMember):  # fused or separate as it decided on its first steps
        member = member.member_of(trial_id)
    if isinstance(member, TrainerMember):
        return _trainer_member_state(member, job, evaluator)
    if isinstance(member, BatchedMember):
        return _batched_member_state(member, job, evaluator)
    return None


# -- the unit task ------------------------------------------------------------------------------------
class _Worker:
    """The task's side of the hub conversation and of storage, for all members of one unit."""

    def __init__(self, hub: Any, spec: Mapping[str, Any]):
        from ._ray import _Storage

        self.hub, self.spec = hub, spec
        self.attempt = spec["attempt"]
        self.storage = _Storage(spec["root"])
        self.worker = (os.getpid(), ray.util.get_node_ip_address())
        self.directories = {m["trial"].id: m["directory"] for m in spec["members"]}
        self.outcomes: dict[int, dict[str, Any]] = {}

    def post(self, *message: Any) -> None:
        ray.get(self.hub.post.remote(message))  # waited for: it is in the hub before the task returns

    def checkpoint(self, tid: int, epoch: int, step: int, metrics: Mapping[str, float], state: Any) -> None:
        storage, directory = self.storage, self.directories[tid]
        # Before reporting: a worker killed after this line resumes past the epoch and posts its
        # metrics again (the driver ignores a step it already has).
        storage.save(storage.child(directory, f"epoch-{epoch}.pt"), {"trainer": state, "step": step, "metrics": metrics})
        if epoch > 1:
            storage.remove(storage.child(directory, f"epoch-{epoch - 1}.pt"))

    def ask(self, reports: Sequence[tuple[int, int, dict[str, float], bool, float]]) -> dict[int, str]:
        """Post every member's report at once; the driver's answers, by trial id."""
        refs = [self.hub.ask.remote(tid, self.attempt, step, metrics, last, seconds, self.worker)
                for tid, step, metrics, last, seconds in reports]
        return {report[0]: answer for report, answer in zip(reports, ray.get(refs))}

    def leave(self, tid: int, kind: str, value: float | None = None, weights: Mapping[str, Any] | None = None,
              error: str | None = None) -> None:
        final = None
        if weights is not None:
            final = self.storage.child(self.directories[tid], "final.pt")
            self.storage.save(final, {k: v.detach().cpu() for k, v in weights.items()})
        outcome = {"kind": kind, "value": value, "final": final, "error": error}
        self.outcomes[tid] = outcome
        self.post("left", tid, self.attempt, self.worker, outcome)


def _resume(worker: _Worker, jobs: Sequence[Job], evaluator: StepwiseEvaluator) -> Any:
    """A separate unit of ``jobs``, each from its last checkpoint; members whose last checkpointed
    step is answered STOP (or that were out of budget) leave at once."""
    from ..units import SeparateUnit

    unit = SeparateUnit(jobs, evaluator, reason=f"restarted (attempt {worker.attempt}) from the members' checkpoints")
    log.info("%s", unit.describe())
    storage = worker.storage
    reports = []
    for job in jobs:
        tid = job.trial.id
        directory = worker.directories[tid]
        epoch = storage.latest_epoch(directory)
        trainer = unit.trainers.get(tid)
        if epoch is None or trainer is None:
            continue
        saved = storage.load(storage.child(directory, f"epoch-{epoch}.pt"))
        if saved["trainer"] is None:
            continue  # no trainer state could be taken: from the first epoch
        trainer.load_state_dict(saved["trainer"])
        # the report may not have reached the driver before the old worker died
        reports.append((tid, saved["step"], saved["metrics"], trainer.epoch >= unit.limit(tid), 0.0))
    answers = worker.ask(reports)
    for tid, _, metrics, last, _ in reports:
        _decided(worker, unit, tid, answers[tid], last, metrics[next(iter(metrics))])
    return unit


def _decided(worker: _Worker, unit: Any, tid: int, answer: str, last: bool, value: float) -> None:
    """Act on the driver's answer for a member that just reported."""
    if answer == DROP:
        worker.leave(tid, "dropped")
    elif answer == YIELD:
        worker.leave(tid, "yielded", value)
    elif last or answer == Decision.STOP.value:
        worker.leave(tid, "stopped" if answer == Decision.STOP.value else "done", value, unit.weights(tid))
    else:
        return
    unit.drop(tid)


def _plan(jobs: Sequence[Job], evaluator: StepwiseEvaluator, spec: Mapping[str, Any]) -> list[Any]:
    """The unit the driver planned, planned again here with its batching decision."""
    import dataclasses

    from ._planner import plan

    if not spec["optimize"]:
        from ..units import SeparateUnit

        return [SeparateUnit(jobs, evaluator)]
    from ..xopt import batching as _batching

    from ..xopt import cse as _cse

    # the driver's settings, for this task only (a worker serves many tasks)
    given = {"batching": (_batching.settings, spec["batching"]),
             "cse": (_cse.settings, spec["cse"])}
    saved = {name: dataclasses.replace(live) for name, (live, _) in given.items()}
    try:
        for name in saved:
            live, new = given[name]
            for f in dataclasses.fields(live):
                setattr(live, f.name, getattr(new, f.name))
        units = plan(jobs, evaluator, True, max_unit_memory=spec["max_unit_memory"])
    finally:
        for name, old in saved.items():
            for f in dataclasses.fields(old):
                setattr(given[name][0], f.name, getattr(old, f.name))
    if (len(units) != 1 or units[0].kind != spec["planned"]) and spec["batching"].mode != "auto":
        # (with "auto", an adaptive unit's decision cached in this worker may plan it otherwise)
        log.warning("trials %s: the driver planned one %s unit, this worker planned %s (trained as planned here)",
                    [j.trial.id for j in jobs], spec["planned"], [u.describe() for u in units])
    return units


@ray.remote(max_retries=0)
def run_unit(evaluator: StepwiseEvaluator, spec: dict[str, Any], hub: Any) -> dict[int, dict[str, Any]]:
    """Train one unit's members on this worker (see the module docstring); returns every member's
    outcome. Errors of training fail their member only; the worker's death raises on the driver."""
    torch.set_num_threads(max(1, int(spec["cpus"])))
    worker = _Worker(hub, spec)
    assigned = ray.get_runtime_context().get_assigned_resources()
    for m in spec["members"]:
        worker.post("started", m["trial"].id, worker.attempt, worker.worker, assigned)
    jobs = [Job(m["trial"], pickle.loads(m["model"]), m["max_steps"]) for m in spec["members"]]
    try:
        if spec.get("world", 1) > 1:
            _run_ddp(worker, jobs[0], evaluator, spec)
            return worker.outcomes
        if spec["resume"]:
            units = [_resume(worker, jobs, evaluator)]
        else:
            for job in jobs:  # a new run of these trials (after a driver crash too) starts afresh
                worker.storage.clear(worker.directories[job.trial.id])
            units = _plan(jobs, evaluator, spec)
    except Exception as err:  # planning or a checkpoint failed: every member fails with it
        text = _error_text(err)
        for job in jobs:
            if job.trial.id not in worker.outcomes:
                worker.leave(job.trial.id, "error", error=text)
        return worker.outcomes
    while any(unit.active() for unit in units):
        for unit in units:
            if not unit.active():
                continue
            before = {j.trial.id: j.trial.info.get("train_seconds", 0.0) for j in unit.active()}
            results = unit.train_epoch()
            reports = []
            for tid, result in results.items():
                if isinstance(result, BaseException):
                    worker.leave(tid, "error", error=_error_text(result))
                    unit.drop(tid)
                    continue
                metrics = {k: float(v) for k, v in result.items()}
                epoch = unit.epoch(tid)
                worker.checkpoint(tid, epoch, epoch - 1, metrics, member_state(unit, tid, evaluator))
                seconds = unit.jobs[tid].trial.info.get("train_seconds", 0.0) - before.get(tid, 0.0)
                reports.append((tid, epoch - 1, metrics, epoch >= unit.limit(tid), seconds))
            answers = worker.ask(reports)
            for tid, _, metrics, last, _ in reports:
                _decided(worker, unit, tid, answers[tid], last, metrics[next(iter(metrics))])
            for job in list(unit.active()):  # trained nothing this epoch (no budget): done
                tid = job.trial.id
                if tid not in results and unit.epoch(tid) >= unit.limit(tid):
                    worker.leave(tid, "done", None, unit.weights(tid))
                    unit.drop(tid)
    return worker.outcomes


# -- data parallel: one trial over `world` local processes ---------------------------------------------
def _rank_main(rank: int, world: int, port: int, payload: bytes, conn: Any) -> None:
    """One DDP rank in its own process; rank 0 talks to the task through ``conn``."""
    from torch.nn.parallel import DistributedDataParallel

    from . import _ddp
    from ._fluid import _epoch_metrics, _limit

    torch.set_num_threads(1)
    evaluator, model, sample, seed, max_steps, state = pickle.loads(payload)
    try:
        _ddp.init_group(rank, world, port)
        trainer = evaluator.trainer(model, sample, seed)
        if state is not None:
            trainer.load_state_dict(state)
        ddp = DistributedDataParallel(trainer.model)
        limit = _limit(trainer, max_steps)
        while trainer.epoch < limit:
            t0 = time.perf_counter()
            step = trainer.epoch
            train = _ddp.train_epoch(trainer, rank, world, ddp)
            decision = None
            if rank == 0:
                metrics = _epoch_metrics(trainer, evaluator, train)
                buffer = io.BytesIO()
                torch.save(trainer.state_dict(), buffer)
                conn.send(("report", step, metrics, time.perf_counter() - t0, buffer.getvalue()))
                decision = conn.recv()
            decision = _ddp.broadcast(decision, rank)
            if decision != Decision.CONTINUE.value:
                break
        if rank == 0:
            conn.send(("weights", {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}))
    except Exception as err:
        conn.send(("error", f"rank {rank} of {world}: " + _error_text(err)))
    conn.recv()  # wait to be killed: no gloo teardown


def _run_ddp(worker: _Worker, job: Job, evaluator: StepwiseEvaluator, spec: Mapping[str, Any]) -> None:
    import multiprocessing as mp

    from ._ddp import free_port

    tid, world = job.trial.id, int(spec["world"])
    directory = worker.directories[tid]
    state = None
    if spec["resume"]:
        epoch = worker.storage.latest_epoch(directory)
        if epoch is not None:
            state = worker.storage.load(worker.storage.child(directory, f"epoch-{epoch}.pt"))["trainer"]
    else:
        worker.storage.clear(directory)
    payload = ray.cloudpickle.dumps((evaluator, job.model, job.trial.sample, job.trial.seed, job.max_steps, state))
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    try:
        for rank in range(world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(rank, world, port, payload, theirs), daemon=True,
                               name=f"tridens-ddp-{tid}-{rank}")
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(mine)
        value: float | None = None
        stopped = False
        while True:
            message = conns[0].recv()
            if message[0] == "error":
                worker.leave(tid, "error", error=message[1])
                return
            if message[0] == "weights":
                worker.leave(tid, "stopped" if stopped else "done", value, message[1])
                return
            _, step, metrics, seconds, state_bytes = message
            value = metrics[next(iter(metrics))]
            trainer_state = torch.load(io.BytesIO(state_bytes), weights_only=True)
            epoch = int(trainer_state["epoch"])
            worker.checkpoint(tid, epoch, step, metrics, trainer_state)
            limit = spec["limit"]
            answer = worker.ask([(tid, step, metrics, epoch >= limit, seconds)])[tid]
            stopped = answer == Decision.STOP.value
            if answer in (YIELD, DROP):
                conns[0].send(answer)
                worker.leave(tid, "yielded" if answer == YIELD else "dropped", value)
                return
            conns[0].send(Decision.CONTINUE.value if epoch < limit and not stopped else Decision.STOP.value)
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
        for conn in conns:
            conn.close()
