"""The worker side of the Ray executor for declarative (step-wise) evaluators: one Ray task per
execution unit (:mod:`._planner`), and Fluid's data-parallel placements.

A unit task receives its members (the trials' records, their models pickled before the driver
planned, their budgets), plans them again on the worker with the same optimizations and memory
bound (so the same fused unit is built there), and trains it with the in-process executor's epoch
loop (:func:`~._execution.run_lockstep`). After each epoch it writes every member's checkpoint to
storage, posts the round of every member's metrics to the hub, and waits for the driver's verdicts
(the driver's :class:`~._driver.LockstepDriver` decides the round with the members' protocols):
a member told to stop (or out of budget) saves its final weights and leaves the unit, the others go on.

**Checkpoints and restarts.** A member's checkpoint is a trainer checkpoint (what
``SupervisedTrainer.state_dict()`` holds: weights, optimizer state, epoch, step, random state),
taken by the unit that trains it (``ExecutionUnit.state_dict``, :mod:`tridens.units`). Fused units cannot resume mid-way (a batched stack, a shared
prefix or tied super-graph tensors are rebuilt only from initial models), so a unit whose worker
died restarts its unfinished members **as separate trials** (one task training them one after
another) from their last checkpoints. Their metrics go on as the fused run's would (fused equals
separate, see :mod:`tridens.xopt`), except for a super-graph unit, whose children train apart
after the restart (their tied tensors are no longer shared). A member killed before its first
checkpoint starts again from its first epoch (the driver does not record an epoch twice).

**Stages and forks.** A stage tree in a task loads and stores its stages through the driver
(:mod:`._stage_relay`: calls through the hub, checkpoints handed through storage). A member the
driver forks (PBT) continues from its source's state: through the source's unit when the source
trains in the same task, else from the source's checkpoint of that step, which the driver copies
under storage for this task to take (:func:`~._execution.handed_source`).

**Data parallel (Fluid share > 1).** One task reserving ``share`` CPUs (or GPUs) starts ``share``
local processes, one DDP rank each (:mod:`._ddp`, gloo; one node), and relays rank 0's reports to
the hub and the decisions back. The ranks are killed, never torn down, when the trial ends
(tearing a gloo group down can hang, see :mod:`._fluid_pool`).
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

from ..evaluators import StepwiseEvaluator
from ..units import Job, PlanContext
from ._lockstep import LockstepJudge, UnitReport, plan_units, resume_units, run_lockstep
from ._messages import Answer, ArchiveCall, Forked, Left, Outcome, Posted, Report, Round, Started, State, Verdicts
from ._protocol import Verdict, error_text
from ._ray_storage import CheckpointStorage

__all__ = ["run_unit"]

log = logging.getLogger("tridens")



# -- the unit task ------------------------------------------------------------------------------------
class _Worker:
    """The task's side of the hub conversation and of storage, for all members of one unit."""

    def __init__(self, hub: Any, spec: Mapping[str, Any]):
        self.hub, self.spec = hub, spec
        self.attempt = spec["attempt"]
        self.storage = CheckpointStorage(spec["root"])
        self.worker = (os.getpid(), ray.util.get_node_ip_address())
        self.directories = {m["trial"].id: m["directory"] for m in spec["members"]}
        self.trials = {m["trial"].id: m["trial"] for m in spec["members"]}
        self.outcomes: dict[int, Outcome] = {}
        self.calls = 0

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One stage-store call to the driver through the hub (:mod:`._stage_relay`), and its answer."""
        self.calls += 1
        tid = next(iter(self.directories))   # the driver knows the task by any of its members
        key = ("archive", tid, self.attempt, self.calls)
        return ray.get(self.hub.call.remote(key, Posted(self.attempt, self.worker, ArchiveCall(name, args, kwargs, tid), key)))

    def relay(self) -> Any:
        """The stage store of the driver, for this task's stage trees (None: the driver shares none)."""
        if self.spec.get("stages") is None:
            return None
        from ._stage_relay import ArchiveRelay

        experiment = self.spec["experiment"]
        return ArchiveRelay(self.call, self.spec["stages"], lambda state: self.storage.hand(experiment, state),
                            self.storage.take)

    def post(self, message: Any) -> None:
        # waited for: it is in the hub before the task returns
        ray.get(self.hub.post.remote(Posted(self.attempt, self.worker, message)))

    def checkpoint(self, tid: int, step: int, metrics: Mapping[str, float], state: Any,
                   sample: Mapping[str, Any] | None = None) -> None:
        # Before reporting: a worker killed after this line resumes past the epoch and posts its
        # metrics again (the driver ignores a step it already has).
        self.storage.save_round(self.directories[tid], step, metrics, state, sample)

    # -- the DriverLink of this task's LockstepJudge ------------------------------------------------
    def keep(self, reports: Sequence[UnitReport]) -> None:
        for r in reports:
            self.checkpoint(r.trial_id, r.step, r.metrics or {}, r.unit.state_dict(r.trial_id), r.unit.jobs[r.trial_id].sample)

    def round(self, reports: Sequence[Report]) -> Verdicts:
        """Every member's report posted at once, as one :class:`~._messages.Round`; the driver's
        :class:`~._messages.Verdicts` (a fork's ``handed`` source names its state's file under storage)."""
        first = reports[0]
        key = ("round", first.trial_id, self.attempt, first.step)
        return ray.get(self.hub.call.remote(key, Posted(self.attempt, self.worker, Round(list(reports)), key)))

    def handed(self, handed: Any) -> tuple[int, dict[str, Any], Any, Mapping[str, Any]]:
        seed, sample, model, path = handed
        return seed, sample, pickle.loads(model), self.storage.take(path)

    def forked(self, message: Forked) -> None:
        self.post(message)

    def leave(self, tid: int, outcome: Outcome, weights: Mapping[str, Any] | None = None) -> None:
        """Member ``tid`` leaves: its final ``weights`` written under storage (or ``outcome.weights``
        there already), its outcome posted to the driver and kept for the task's result."""
        final = outcome.weights
        if weights is not None:
            final = self.storage.child(self.directories[tid], "final.pt")
            self.storage.save(final, {k: v.detach().cpu() for k, v in weights.items()})
        info = self.trials[tid].info   # what the unit recorded (the stages it went through) goes back too
        outcome = Outcome(outcome.kind, outcome.value, final, outcome.error,
                          {k: info[k] for k in ("stages", "stage_store", "unit") if k in info})
        self.outcomes[tid] = outcome
        self.post(Left(tid, outcome))


def _plan(jobs: Sequence[Job], evaluator: StepwiseEvaluator, spec: Mapping[str, Any], archive: Any = None) -> list[Any]:
    """The unit the driver planned, planned again here with the driver's settings (its batching
    decision included) and memory bound, sent as plain data in the spec; stage trees store and
    load stages through ``archive`` (the driver's, relayed)."""
    if not spec["optimize"]:
        return plan_units(jobs, evaluator, False)[0]
    from ..xopt import Settings

    settings = Settings.from_dict(spec["settings"])
    planning = PlanContext(settings=settings, max_unit_memory=spec["max_unit_memory"], archive=archive)
    units, _ = plan_units(jobs, evaluator, settings, context=planning)
    if (len(units) != 1 or units[0].kind != spec["planned"]) and settings.batching.mode != "auto":
        # (with "auto", an adaptive unit's decision cached in this worker may plan it otherwise)
        log.warning("trials %s: the driver planned one %s unit, this worker planned %s (trained as planned here)",
                    [j.trial.id for j in jobs], spec["planned"], [u.summary() for u in units])
    return units


@ray.remote(max_retries=0)
def run_unit(evaluator: StepwiseEvaluator, spec: dict[str, Any], hub: Any) -> dict[int, Outcome]:
    """Train one unit's members on this worker (see the module docstring); returns every member's
    outcome. Errors of training fail their member only; the worker's death raises on the driver."""
    torch.set_num_threads(max(1, int(spec["cpus"])))
    worker = _Worker(hub, spec)
    assigned = ray.get_runtime_context().get_assigned_resources()
    for m in spec["members"]:
        worker.post(Started(m["trial"].id, assigned))
    jobs = [Job(m["trial"], pickle.loads(m["model"]), m["max_steps"], start_from=m.get("start_from"))
            for m in spec["members"]]
    judge = LockstepJudge(worker, evaluator)
    try:
        if spec.get("world", 1) > 1:
            _run_ddp(worker, jobs[0], evaluator, spec)
            return worker.outcomes
        if spec["resume"]:   # from the members' last rounds, asked again (see resume_units)
            units = resume_units(jobs, evaluator, judge,
                                 lambda tid: worker.storage.last_round(worker.directories[tid]),
                                 f"restarted (attempt {worker.attempt}) from the members' checkpoints")
        else:
            for job in jobs:  # a new run of these trials (after a driver crash too) starts afresh
                worker.storage.clear(worker.directories[job.trial.id])
            units = _plan(jobs, evaluator, spec, worker.relay())   # stages loaded and stored through the driver
    except Exception as err:  # planning or a checkpoint failed: every member fails with it
        text = error_text(err)
        for job in jobs:
            if job.trial.id not in worker.outcomes:
                worker.leave(job.trial.id, Outcome("error", error=text))
        return worker.outcomes
    run_lockstep(units, judge)
    return worker.outcomes


# -- data parallel: one trial over `world` local processes ---------------------------------------------
def _rank_main(rank: int, world: int, port: int, payload: bytes, conn: Any) -> None:
    """One DDP rank in its own process; rank 0 talks to the task through ``conn``."""
    from torch.nn.parallel import DistributedDataParallel

    from . import _ddp
    from ._fluid_pool import budget, epoch_metrics

    torch.set_num_threads(1)
    evaluator, model, sample, seed, max_steps, state = pickle.loads(payload)
    try:
        _ddp.init_group(rank, world, port)
        trainer = evaluator.trainer(model, sample, seed)
        if state is not None:
            trainer.load_state_dict(state)
        ddp = DistributedDataParallel(trainer.model)
        limit = budget(trainer, max_steps)
        while trainer.epoch < limit:
            t0 = time.perf_counter()
            step = trainer.epoch
            train = _ddp.train_epoch(trainer, rank, world, ddp)
            decision = None
            if rank == 0:
                metrics = epoch_metrics(trainer, evaluator, train)
                buffer = io.BytesIO()
                torch.save(trainer.state_dict(), buffer)
                conn.send(State(0, buffer.getvalue()))
                conn.send(Report(0, step, metrics, time.perf_counter() - t0))
                decision = conn.recv().verdict
            decision = _ddp.broadcast(decision, rank)
            if decision != Verdict.CONTINUE.value:
                break
        if rank == 0:
            conn.send(Left(0, Outcome("done", weights={k: v.detach().cpu() for k, v in trainer.model.state_dict().items()})))
    except Exception as err:
        conn.send(Left(0, Outcome("error", error=f"rank {rank} of {world}: " + error_text(err))))
    conn.recv()  # wait to be killed: no gloo teardown


def _run_ddp(worker: _Worker, job: Job, evaluator: StepwiseEvaluator, spec: Mapping[str, Any]) -> None:
    import multiprocessing as mp

    from ._ddp import free_port

    tid, world = job.trial.id, int(spec["world"])
    directory = worker.directories[tid]
    state = None
    if spec["resume"]:
        saved = worker.storage.last_round(directory)
        if saved is not None:
            state = saved["trainer"]
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
            if isinstance(message, Left):
                if message.outcome.kind == "error":
                    worker.leave(tid, Outcome("error", error=message.outcome.error))
                else:
                    worker.leave(tid, Outcome("stopped" if stopped else "done", value), message.outcome.weights)
                return
            report: Report = conns[0].recv()   # after the rank's state
            step, metrics, seconds = report.step, report.metrics, report.seconds
            value = metrics[next(iter(metrics))]
            trainer_state = torch.load(io.BytesIO(message.payload), weights_only=True)
            epoch = int(trainer_state["epoch"])
            worker.checkpoint(tid, step, metrics, trainer_state)
            limit = spec["limit"]
            answer = worker.round([Report(tid, step, metrics, seconds, epoch >= limit)]).answers[tid]
            stopped = answer == Verdict.STOP.value
            if answer in (Verdict.YIELD.value, Verdict.DROP.value):
                conns[0].send(Answer(0, answer))
                worker.leave(tid, Outcome("yielded" if answer == Verdict.YIELD.value else "dropped", value))
                return
            conns[0].send(Answer(0, Verdict.CONTINUE.value if epoch < limit and not stopped else Verdict.STOP.value))
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
        for conn in conns:
            conn.close()
