"""Operator batching decided from a unit's own first real training steps.

:func:`tridens.xopt._batching.plan_batching` (batching ``mode == "auto"``) builds an
:class:`AdaptiveUnit` for a group of same-shaped trials whose fusion has not been measured yet. It
is a :class:`~tridens.xopt._batching.BatchedUnit` (so the mixed-unit pass and the Ray executor see
it as one) whose member, :class:`AdaptiveMember`, trains the group's first epoch *speculatively*
and decides on the way, with nothing thrown away that it does not have to:

1. **One model's separate steps** (the *timing trial*: the first trial, its real trainer on its
   real model, stepped as separate training would step it: with the exact 2x2 max-pool kernel
   where its model has one, :func:`tridens.xopt._cse.with_fast_kernels`) train the first ``1 + 2``
   batches. The batches are kept (references; a few MiB at most). From the CPU time of those
   steps and the model's FLOPs (counted once per group at planning) the member records how close one model already runs to the peak fp32
   matmul rate (:func:`tridens.xopt._batching.peak_matmul_flops`, once per process): logged with
   the decision, never deciding it (near the peak, fusion of small CNNs can still pay).
2. Then the **fused** stack (built at planning from the untouched initial models: a
   :class:`~tridens.xopt._batching.BatchedMember` stacks copies) trains the kept batches, then
   every further batch, each fused step followed by the timing trial's separate step, timed in
   CPU seconds (a loaded machine disturbs CPU time far less than wall time). After
   ``measure_rounds`` timed fused steps (past one warm-up; up to twice as many while the
   ratio is at most 25% above the bar) the speed-up is separate over fused CPU time per model for
   an epoch: its training steps at one model's median separate step time and the median fused
   step time per model, plus its validation batches at the evaluation forwards' times (one
   model's and the fused stack's on a kept batch, timed once). Medians: one model stepping alone
   varies more from step to step than the fused stack, so least times favoured separate
   training; validation: fused evaluation can gain more than a training step. The bar is met **from here**: the speed-up
   over what is left of the trials' training, counting that going separate trains the kept
   batches again on every other model (:meth:`AdaptiveMember._from_here`; on a short run this
   outweighs a small measured difference). At ``min_speedup`` or more the group stays **fused**:
   the timing trial's model is put back to its initial state and its trainer dropped (the waste:
   a few separate steps of ONE model). Below, it goes **separate**: the other trials' trainers
   train the kept batches (the waste: those few fused steps). The cache keeps the measured
   ratio, which later groups, with nothing taken yet, compare with the bar.

Either way each trial's results are exactly those of never having decided: the fused stack started
from the initial weights and the trials' random streams from their seeds; separate trainers start
from the untouched models and seeds and see the same batches in the same order. Per-epoch metrics
are those of fused (or separate) training, bit for bit. Going separate keeps the shared data
pipeline and trains the group as the planner's shared-pipeline units train separate trials: one
joint step of the trainers (:func:`tridens.xopt._cse.joint_trainers`), so the decision compares
fused training with the separate training it would replace.

An epoch too short to decide decides at its end on what it has (the fused stack trains the kept
batches if it has not yet). A fused stack that fails (a forward that does not vectorize, an
evaluation forward that fails) goes separate, saying why. The outcome is logged ("batching: trials
[...] fused: measured from 5 real steps: 2.31x") and cached per (structure, setup, K, device type,
threads at planning; the data order left out): later groups with the same key are planned fused
or separate directly (or measure again while the measurements are few and near the bar:
:func:`tridens.xopt._batching.settled_speedup`); a group planned fused is an adaptive unit that
starts fused, with no deciding steps.

**A fused stack that shrinks measures again.** Fewer models gain less from fusion (fused LeNet-5s
on Fashion-MNIST: 1.15x at K=8, 0.83x at K=3), and strategies stop trials while their stack
trains: ASHA stops about two thirds of a group after its first rung. When the stack has shrunk
since it fused, its next few fused steps (real training) are timed against one model's separate
step measured when the group decided (kept per key for groups planned fused later); below 1x the
remaining models go on as separate trainers from their rows' checkpoints (``state_dict``: weights,
optimizer state, step, random stream), so their results equal fused training up to that epoch
and separate training after it, to rounding. A stack with finished trials not yet collected, or on
CUDA (no trainer checkpoint from the stack), stays fused. Knobs are
:class:`tridens.xopt.BatchingSettings` given to the unit (``override_speedup`` replaces the measured ratio
in the decision: tests use it to drive either path on real training).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from ..units import Decisions, ExecutionUnit, Job, Measurement, numbered
from ..evaluators import StepwiseEvaluator
from ._decision_cache import SEPARATE_STEP, DecisionCache
from ._batching import _SETUP_FIELDS, BatchedMember, BatchedUnit, peak_matmul_flops
from ._cse import TrainerMember, joint_trainers, with_fast_kernels
from ._pipeline import PipelineMember, supervised_trainer
from ._settings import BatchingSettings, CSESettings

__all__ = ["AdaptiveMember", "AdaptiveUnit", "decision_key"]

log = logging.getLogger("tridens")

# separate steps of the timing trial before the roofline check: one warm-up, then timed ones
_SEPARATE_ROUNDS = 2
# fused steps timed after the stack shrank (the first, a warm-up at the new size, not counted)
_SHRUNK_ROUNDS = 4


def decision_key(skey: str, setup: tuple[Any, ...], k: int, device: torch.device) -> tuple[Any, ...]:
    """The cache key of a measured speed-up: structure, setup, K, device type and torch threads.
    The setup's data order is left out: groups that differ only in it (e.g. ASHA's successive
    groups of the same model) run at the same speed, so the first group's measurement decides
    for the others."""
    speed_setup = tuple(v for (name, _), v in zip(_SETUP_FIELDS, setup) if name != "data order")
    return (skey, speed_setup, k, device.type, torch.get_num_threads())


class AdaptiveMember:
    """A group of same-shaped trials that trains fused or separately, decided from its first
    real steps (see the module docstring). It answers the pipeline-member protocol of
    :mod:`tridens.xopt._cse` like :class:`~tridens.xopt._batching.BatchedMember`; after the
    decision it delegates to the fused stack or to one :class:`~tridens.xopt._cse.TrainerMember`
    per trial. ``state`` is ``"deciding"``, ``"fused"`` or ``"separate"``; ``decision`` says why."""

    inputs: tuple[str, ...] = ("batch",)

    def __init__(self, fused: BatchedMember, jobs: Sequence[Job], evaluator: StepwiseEvaluator, *,
                 skey: str = "", setup: tuple[Any, ...] = (), flops: float = 0.0, cse: CSESettings | None = None,
                 stored_key: str | None = None, known: tuple[float, str] | None = None,
                 decisions: Decisions | None = None, max_unit_memory: int | None = None):
        self.fused: BatchedMember | None = fused
        self.max_unit_memory = max_unit_memory  # the run's bound, for separate trainers stepped jointly
        # the run's decisions (tridens.units.PlanContext) this group reads and records into; what it
        # measured is also kept as data (``recorded``) for a driver in another process
        self.decisions = decisions if decisions is not None else Decisions()
        self.recorded: list[Measurement] = []
        self.settings = fused.settings  # the knobs of the decision
        self.cse = cse if cse is not None else CSESettings()  # how separate trainers step (joint, exact kernels)
        self.jobs = {job.trial.id: job for job in jobs}
        self.evaluator = evaluator
        self.cfg = fused.cfg
        self.device = fused.device
        self.skey, self.setup = skey, setup
        # the cache key, taken now: the planner looks it up with the threads it plans under, which
        # the engine's thread policy may change while the unit runs
        self.key = decision_key(skey, setup, len(self.jobs), self.device)
        # the key the decision persists under (:mod:`._decision_cache`; None: this process only)
        self.stored_key = stored_key if self.settings.decision_cache else None
        self.flops = flops  # one model's training FLOPs per step (0: unknown, no roofline check)
        self.state = "deciding"
        self.decision = ""
        self.speedup: float | None = None  # the measured (or overridden) ratio that decided
        self.trainers: dict[int, TrainerMember] = {}
        # what steps the trainers once separate: one joint member (one backward, exact faster
        # kernels) as the planner's shared-pipeline units have, or the trainers themselves
        self._steppers: list[PipelineMember] = []
        self._order = list(self.jobs)
        self._left: set[int] = set()
        self._errors: dict[int, BaseException] = {}  # trainers that could not be built
        self._limits = {t: fused.limit(t) for t in self._order}
        self._kept: list[tuple[Any, torch.Tensor, int]] = []
        self._timing: TrainerMember | None = None
        self._timing_step: PipelineMember | None = None  # the timing trial's steps as separate trainers take them
        self._snapshot: dict[str, torch.Tensor] | None = None
        self._was_training = True
        self._separate: list[float] = []            # the timing trial's timed separate steps (CPU s)
        self._fused_steps: list[tuple[float, int]] = []  # timed fused steps: (CPU s, models stepped)
        # evaluation forwards, timed once: (one model's, the fused stack's per model) CPU s; () if not timed
        self._eval: tuple[float, ...] | None = None
        self._fused_started = False
        self._fused_calls = 0
        self._separate_calls = 0
        # CPU (CUDA: wall) seconds of each kind of step taken while deciding: the kind not kept is
        # the decision's waste (``wasted_seconds``, reported by bench/batching.py)
        self._spent = {"fused": 0.0, "separate": 0.0}
        self.wasted_seconds = 0.0
        self._why_separate = ""
        self._efficiency = ""  # one model's separate step against the peak matmul rate (logged)
        self._clock: Callable[[], float] = time.process_time if self.device.type == "cpu" else time.perf_counter
        # once fused: the models it decided for, one model's separate step (CPU s; None: unknown),
        # and the fused steps timed after the stack shrank: (models, CPU s of each step)
        self._decided_k = 0
        self._separate_step: float | None = None
        self._shrunk: tuple[int, list[float]] | None = None
        self._rechecked: set[int] = set()
        if known is not None:  # fused from an earlier measurement: no deciding steps
            speedup, where = known
            self.state, self.speedup = "fused", speedup
            self.decision = f"fused: measured {speedup:.2f}x on {where}"
            self._decided_k = len(self.jobs)
            self._separate_step = self.decisions.separate_steps.get(decision_key(skey, setup, 1, self.device))

    # -- the member protocol ---------------------------------------------------------------------
    def trial_ids(self) -> list[int]:
        return [t for t in self._order if t not in self._left]

    def measured(self) -> dict[str, Any] | None:
        """Once decided on a measured speed-up: ``{"trials", "speedup", "fused"}`` (what the
        store records with each trial's unit, from which the dashboard tells the seconds saved)."""
        if self.speedup is None:
            return None
        return {"trials": list(self._order), "speedup": self.speedup, "fused": self.state == "fused"}

    @property
    def ids(self) -> list[int]:
        """The trials training now (a fused stack's rows; separate trainers without an error)."""
        if self.state == "separate":
            return [t for t, m in self.trainers.items() if m._training and m._error is None]
        assert self.fused is not None
        return self.fused.ids

    @property
    def engine(self) -> str:
        if self.state == "separate":
            return "separate trainers"
        assert self.fused is not None
        return self.fused.engine + (", deciding" if self.state == "deciding" else "")

    def member_of(self, trial_id: int) -> Any:
        """What trains ``trial_id`` now: the fused stack, its trainer, or None while deciding."""
        if self.state == "fused":
            return self.fused
        if self.state == "separate":
            return self.trainers.get(trial_id)
        return None

    def limit(self, trial_id: int) -> int:
        return self._limits[trial_id]

    def epoch(self, trial_id: int) -> int:
        if self.state == "separate":
            member = self.trainers.get(trial_id)
            return 0 if member is None else member.epoch(trial_id)
        assert self.fused is not None
        return self.fused.epoch(trial_id)

    def wants_epoch(self) -> bool:
        return any(self.epoch(t) < self.limit(t) for t in self.trial_ids())

    def begin_epoch(self) -> None:
        if self.state == "fused":
            self._recheck_shrunk()
        if self.state == "separate":
            for m in self._steppers:
                m.begin_epoch()
            return
        assert self.fused is not None
        self.fused.begin_epoch()
        if self.state == "deciding":
            self._start_timing()
        else:
            self._time_if_shrunk()

    def train_batch(self, x: Any, y: torch.Tensor, batch: int) -> None:
        if self.state == "fused":
            assert self.fused is not None
            shrunk = self._shrunk
            if shrunk is not None and len(shrunk[1]) < _SHRUNK_ROUNDS and len(self.fused.ids) == shrunk[0]:
                shrunk[1].append(self._timed(lambda: self.fused.train_batch(x, y, batch)))  # type: ignore[union-attr]
            else:
                self.fused.train_batch(x, y, batch)
        elif self.state == "separate":
            for m in self._steppers:
                m.train_batch(x, y, batch)
        else:
            self._kept.append((x, y, batch))
            self._decide_step(x, y, batch)

    def end_epoch(self) -> dict[int, dict[str, float] | BaseException]:
        if self.state == "deciding":
            self._decide_now()
        out: dict[int, dict[str, float] | BaseException] = dict(self._errors)
        self._errors.clear()
        if self.state == "separate":
            for m in self._steppers:
                out.update(m.end_epoch())
            return out
        assert self.fused is not None
        out.update(self.fused.end_epoch())
        return out

    def begin_validation(self) -> None:
        if self.state == "separate":
            for m in self._steppers:
                m.begin_validation()
        else:
            assert self.fused is not None
            self.fused.begin_validation()

    def validate_batch(self, x: Any, y: torch.Tensor) -> None:
        if self.state == "separate":
            for m in self._steppers:
                m.validate_batch(x, y)
        else:
            assert self.fused is not None
            self.fused.validate_batch(x, y)

    def end_validation(self) -> dict[int, dict[str, float] | BaseException]:
        if self.state == "separate":
            out: dict[int, dict[str, float] | BaseException] = {}
            for m in self._steppers:
                out.update(m.end_validation())
            return out
        assert self.fused is not None
        return self.fused.end_validation()

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        if self.state == "fused":
            assert self.fused is not None
            return self.fused.weights(trial_id)
        if self.state == "separate" and trial_id in self.trainers:
            return self.trainers[trial_id].weights(trial_id)
        # deciding (nothing final trained yet): the initial weights
        if self._timing is not None and trial_id == self._timing.trial_id and self._snapshot is not None:
            return {k: v.detach().cpu().clone() for k, v in self._snapshot.items()}
        return {k: v.detach().cpu() for k, v in self.jobs[trial_id].concrete_model.state_dict().items()}

    def batching(self) -> str:
        """``"auto"`` while deciding, then ``"force"`` while fused and ``"off"`` once separate."""
        return {"deciding": "auto", "fused": "force"}.get(self.state, "off")

    def state_dict(self, trial_id: int, job: Job, evaluator: StepwiseEvaluator) -> dict[str, Any] | None:
        """The trial's checkpoint from what trains it now (None while deciding)."""
        member = self.member_of(trial_id)
        return None if member is None else member.state_dict(trial_id, job, evaluator)

    def leave(self, trial_id: int) -> None:
        self._left.add(trial_id)
        self._errors.pop(trial_id, None)
        if self.fused is not None and trial_id in self.fused.trial_ids():
            self.fused.leave(trial_id)
        member = self.trainers.pop(trial_id, None)
        if member is not None:
            for stepper in self._steppers:
                if stepper is not member and trial_id in stepper.trial_ids():
                    stepper.leave(trial_id)
            member.leave(trial_id)
            self._steppers = [m for m in self._steppers if m.trial_ids()]
        if self._timing is not None and self._timing.trial_id == trial_id and self.state == "deciding":
            self._timing, self._timing_step = None, None  # (decided at the epoch's end on what was timed)

    # -- deciding ---------------------------------------------------------------------------------
    def _start_timing(self) -> None:
        assert self.fused is not None
        ids = self.fused.ids
        if not ids or self._timing is not None:
            return
        job = self.jobs[ids[0]]
        try:
            trainer = supervised_trainer(self.evaluator, job.model, job.sample, job.trial.seed)
        except Exception:  # the separate trainers will report it; decide on the fused stack alone
            return
        # its first steps train the real model: kept if the group goes separate, undone otherwise
        self._snapshot = {k: v.detach().clone() for k, v in job.concrete_model.state_dict().items()}
        self._was_training = job.concrete_model.training
        self._timing = TrainerMember(job, trainer)
        self._timing.begin_epoch()
        # timed as the separate trainers would step it: with the exact faster kernels they get
        self._timing_step = with_fast_kernels(self._timing, self.cse)

    def _timed(self, fn: Callable[[], Any]) -> float:
        sync = self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(self.device)
        t0 = self._clock()
        fn()
        if sync:
            torch.cuda.synchronize(self.device)
        return self._clock() - t0

    def _step_separate(self, x: Any, y: torch.Tensor, batch: int) -> None:
        timing = self._timing
        if timing is None or timing._error is not None:
            return
        step = self._timing_step if self._timing_step is not None else timing
        seconds = self._timed(lambda: step.train_batch(x, y, batch))
        self._spent["separate"] += seconds
        self._separate_calls += 1
        if timing._error is None and self._separate_calls > 1:  # past its warm-up step
            self._separate.append(seconds)

    def _step_fused(self, x: Any, y: torch.Tensor, batch: int) -> bool:
        """One fused step (timed past the first); False when the stack failed (-> separate)."""
        fused = self.fused
        assert fused is not None
        k = len(fused.ids)
        if k == 0:
            return True
        try:
            seconds = self._timed(lambda: fused.train_batch(x, y, batch))
        except Exception as err:
            self._why_separate = f"the models do not vectorize ({_first_line(err)})"
            return False
        self._fused_calls += 1
        self._spent["fused"] += seconds
        if self._fused_calls > 1:
            self._fused_steps.append((seconds, k))
        return True

    def _roofline(self) -> str:
        """How close one model's separate step runs to the peak matmul rate ('' where unknown):
        recorded in the run's ``decisions.efficiency`` and logged with the decision; the measured ratio decides."""
        if not (self.device.type == "cpu" and self.flops > 0 and self._separate):
            return ""
        rate = self.flops / max(min(self._separate), 1e-9)
        fraction = rate / peak_matmul_flops(self.device)
        self.decisions.efficiency[(self.skey, self.setup, torch.get_num_threads())] = (fraction, rate, min(self._separate))
        return f"one model's step at {100 * fraction:.0f}% of the peak matmul rate"

    def _start_fused(self) -> bool:
        """The fused stack trains the batches kept so far (catching up with the timing trial)."""
        self._fused_started = True
        for x, y, batch in self._kept:
            if not self._step_fused(x, y, batch):
                return False
        return True

    def _decide_step(self, x: Any, y: torch.Tensor, batch: int) -> None:
        if not self._fused_started:
            self._step_separate(x, y, batch)
            if len(self._separate) < _SEPARATE_ROUNDS and self._timing is not None and self._timing._error is None:
                return
            self._efficiency = self._roofline()
            if not self._start_fused():
                self._go_separate(self._why_separate)
            else:
                self._maybe_decide()
            return
        if not self._step_fused(x, y, batch):
            self._go_separate(self._why_separate)
            return
        self._step_separate(x, y, batch)
        self._maybe_decide()

    def _ratio(self) -> float | None:
        """Separate over fused CPU time per model for an epoch: its training steps (medians of the
        timed ones) and its validation batches (evaluation forwards, timed once), weighted by how
        many of each an epoch has."""
        if self.settings.override_speedup is not None:
            return float(self.settings.override_speedup)
        if not self._separate or not self._fused_steps:
            return None
        separate = statistics.median(self._separate)
        fused = statistics.median(seconds / k for seconds, k in self._fused_steps)
        steps, val_batches = self._epoch_batches()
        evals = self._eval_times() if val_batches else ()
        if evals:
            separate, fused = steps * separate + val_batches * evals[0], steps * fused + val_batches * evals[1]
        return separate / max(fused, 1e-12)

    def _from_here(self, ratio: float) -> float:
        """Separate over fused CPU time for the rest of the group's training, the steps already
        taken counted: staying fused wastes only the timing trial's separate steps, going separate
        trains the kept batches again on every other model. ``ratio`` (per model and epoch) scales
        the epoch's remaining steps and validation and the trials' later epochs (up to their
        budgets: a strategy that stops trials early makes the stack shrink, which is measured
        again); the kept batches are training steps at one model's separate step. Equal to
        ``ratio`` when nothing is left to replay. Short runs gain most: 16 LeNet-5s trained for one
        epoch of 32 steps measure level fused and separate, and going separate after ~7 batches
        would train them again on 15 models (~105 separate steps, a fifth of what is left)."""
        fused = self.fused
        if fused is None or not fused.ids or not self._kept:
            return ratio
        k, done = len(fused.ids), len(self._kept)
        steps, val_batches = self._epoch_batches()
        if self.settings.override_speedup is None and self._separate:
            step = statistics.median(self._separate)
            evals = self._eval_times() if val_batches else ()
            val = val_batches * evals[0] if evals else 0.0
        else:  # an overridden ratio: steps in units of one separate step, validation left out
            step, val = 1.0, 0.0
        later = statistics.mean(max(fused.limit(t) - fused.epoch(t) - 1, 0) for t in fused.ids)
        left = max(steps - done, 0) * step + val + later * (steps * step + val)  # one model, separate
        if left <= 0:
            return math.inf if ratio > 0 else ratio
        replay = (k - 1) * done * step
        return ratio * (replay + k * left) / (k * left)

    def _epoch_batches(self) -> tuple[int, int]:
        """Training steps and validation batches of one epoch (validation: 0 where unknown)."""
        cfg = self.cfg
        try:
            val = 0 if cfg.val is None else math.ceil(len(cfg.val) / cfg.batch_size)
            return cfg.steps_per_epoch, val
        except TypeError:  # data without a length
            return 1, 0

    def _eval_times(self) -> tuple[float, ...]:
        """One model's and the fused stack's (per model) evaluation forward on a kept batch, CPU s,
        medians of 3 after a warm-up; timed once. Validation gains from fusion too, and more than
        a training step on some models (compute-bound CNNs)."""
        if self._eval is not None:
            return self._eval
        self._eval = ()
        timing, fused = self._timing, self.fused
        if timing is None or fused is None or not fused.ids or not self._kept or \
                not isinstance(self._kept[-1][0], torch.Tensor):
            return self._eval
        x, model, k = self._kept[-1][0], timing.trainer.model, len(fused.ids)
        flags = (model.training, fused.base.training)
        try:
            model.eval()
            fused.base.eval()
            with torch.no_grad():
                one = [self._timed(lambda: model(x)) for _ in range(4)][1:]
                stacked = [self._timed(lambda: fused._eval_outputs(x)) for _ in range(4)][1:]
        except Exception:  # validation will say what fails; decide on the training steps
            return self._eval
        finally:
            model.train(flags[0])
            fused.base.train(flags[1])
        self._eval = (statistics.median(one), statistics.median(stacked) / k)
        return self._eval

    def _maybe_decide(self) -> None:
        rounds = len(self._fused_steps)
        timing_alive = self._timing is not None and self._timing._error is None
        if rounds < self.settings.measure_rounds and timing_alive and self.fused is not None and self.fused.ids:
            return
        ratio = self._ratio()
        # Just above the bar, a few more rounds confirm fusing, which the rest of the run would pay
        # for if noise made it look better than it is. Below the bar the group goes separate at
        # once: that costs at most the bar's margin over fused training, and each further round
        # is a fused step of every model thrown away.
        if ratio is not None and rounds < 2 * self.settings.measure_rounds and timing_alive \
                and 1.0 <= self._from_here(ratio) / self.settings.min_speedup <= 1.25:
            return
        self._decide(ratio)

    def _decide_now(self) -> None:
        """The epoch ended before the measurement did: decide on what was timed."""
        if not self._fused_started:
            self._efficiency = self._roofline()
            if not self._start_fused():
                self._go_separate(self._why_separate)
                return
        self._decide(self._ratio())

    def _decide(self, ratio: float | None) -> None:
        steps = len(self._fused_steps) + len(self._separate)
        assert self.fused is not None
        if ratio is None:
            if self.fused.ids:
                self._go_separate("too few steps timed to measure a speed-up")
            else:
                self._go_separate("every model failed")
            return
        self.recorded.append(self.decisions.record_speedup(self.key, ratio))
        self._store(ratio)
        if self._separate:  # (measured also where the ratio is overridden)
            step = self._separate_step = statistics.median(self._separate)
            self.recorded.append(self.decisions.record_separate_step(decision_key(self.skey, self.setup, 1, self.device),
                                                                     step))
            if self.stored_key is not None and self.settings.override_speedup is None:
                DecisionCache(self.settings.decision_cache).put(self.stored_key + SEPARATE_STEP, step)
        self.speedup = ratio
        evals = " and evaluation forwards" if self._eval else ""
        text = f"measured from {steps} real steps{evals}: {ratio:.2f}x"
        if self.settings.override_speedup is not None:
            text = f"settings.override_speedup: {ratio:.2f}x"
        note = f"; {self._efficiency}" if self._efficiency else ""
        here = self._from_here(ratio)
        if here != ratio and math.isfinite(here):
            text += f"; {here:.2f}x from here (separate would train the {len(self._kept)} batches taken again)"
        if here >= self.settings.min_speedup:
            self._go_fused(text + note)
        else:
            self._go_separate(f"{text} (below {self.settings.min_speedup:.2f}x){note}")
        self._record_decision()

    def _store(self, ratio: float, *, replace: bool = False) -> None:
        """Keep a measured ratio for later processes (not an overridden one)."""
        if self.stored_key is not None and self.settings.override_speedup is None:
            DecisionCache(self.settings.decision_cache).put(self.stored_key, ratio, replace=replace)

    def _record_decision(self) -> None:
        """Add this group's decision (:meth:`measured`) to what each of its trials records of its
        unit (``info["unit"]["speedups"]``, set by the planner), so the store keeps it."""
        entry = self.measured()
        if entry is not None:  # recorded by number in the experiment, as the planner records the unit
            entry = numbered(entry, {t: job.trial.label for t, job in self.jobs.items()})
        for job in self.jobs.values():
            unit = job.trial.info.get("unit")
            if entry is not None and isinstance(unit, dict):
                others = [e for e in unit.get("speedups") or [] if e.get("trials") != entry["trials"]]
                job.trial.info["unit"] = {**unit, "speedups": others + [entry]}

    def _go_fused(self, why: str) -> None:
        fused = self.fused
        assert fused is not None
        if self._kept and fused.ids:  # the evaluation forward works too (validation must not fail later)
            x, y, _ = self._kept[-1]
            try:
                fused.begin_validation()
                fused.validate_batch(x, y)
                fused.end_validation()
            except Exception as err:
                fused.base.train()
                self._go_separate(f"the models do not vectorize in evaluation ({_first_line(err)})")
                return
        timing = self._timing
        if timing is not None and self._snapshot is not None:  # undo the timing trial's separate steps
            model = timing.job.concrete_model
            with torch.no_grad():
                model.load_state_dict(self._snapshot)
            model.train(self._was_training)
        self._timing, self._timing_step, self._snapshot, self._kept = None, None, None, []
        self.wasted_seconds = self._spent["separate"]
        self._decided_k = len(fused.ids)
        self.state = "fused"
        self.decision = f"fused: {why}"
        log.info("batching: trials %s %s (%s)", self.trial_ids(), self.decision, fused.engine)

    # -- a fused stack that shrank ------------------------------------------------------------------
    def _time_if_shrunk(self) -> None:
        """Trials left the stack since it fused (a strategy stopped them): time this epoch's first
        fused steps at the new size (real training), once per size."""
        fused = self.fused
        assert fused is not None
        n = len(fused.ids)
        if self._separate_step is None or not 0 < n < self._decided_k or n in self._rechecked:
            return
        self._rechecked.add(n)
        self._shrunk = (n, [])

    def _recheck_shrunk(self) -> None:
        """With the shrunk stack's steps timed: fewer models gain less from fusion (K=8 LeNet-5s
        1.15x, K=3 0.83x), so where separate steps are now faster (below 1x; no margin asked, as
        going separate throws nothing away), its models go on as separate trainers from their rows'
        checkpoints -- results equal to fused training up to here and separate training after, to
        rounding."""
        shrunk, fused = self._shrunk, self.fused
        if shrunk is None or fused is None or len(shrunk[1]) < 2 or self._separate_step is None:
            return
        self._shrunk = None
        n, times = shrunk[0], shrunk[1][1:]
        ratio = n * self._separate_step / max(statistics.median(times), 1e-12)
        if self.settings.override_speedup is not None:
            ratio = float(self.settings.override_speedup)
        ids = list(fused.ids)
        if ratio >= 1.0 or not ids or len(ids) > n or set(fused.trial_ids()) != set(ids) \
                or any(fused.epoch(t) >= fused.limit(t) for t in ids):
            log.info("batching: trials %s stay fused: %d of %d models left, fused steps measured %.2fx of separate",
                     ids, len(ids), self._decided_k, ratio)
            return
        trainers: dict[int, TrainerMember] = {}
        try:
            for t in ids:
                job = self.jobs[t]
                state = fused.state_dict(t, job, self.evaluator)
                if state is None:  # (CUDA: no trainer checkpoint from the stack)
                    return
                trainer = supervised_trainer(self.evaluator, job.model, job.sample, job.trial.seed)
                trainer.load_state_dict(state)
                trainers[t] = TrainerMember(job, trainer)
        except Exception as err:  # stay fused: it trains them as it did
            log.info("batching: trials %s stay fused: %s", ids, _first_line(err))
            return
        for t in ids:
            fused.leave(t)
        joint = self._train_separately(trainers)
        epoch = trainers[ids[0]].epoch(ids[0])
        self.decision += (f"; separately from epoch {epoch + 1}: {len(ids)} of {self._decided_k} models left, fused "
                          f"steps measured {ratio:.2f}x of separate" + (f" ({joint})" if joint else ""))
        log.info("batching: trials %s train separately from epoch %d: %d of %d models left, fused steps measured "
                 "%.2fx of separate", ids, epoch + 1, len(ids), self._decided_k, ratio)

    def _train_separately(self, trainers: Mapping[int, TrainerMember]) -> str:
        """From now on ``trainers`` (in the trials' order) train the models, stepping as the CSE
        settings say; returns how they step jointly ("" when they do not)."""
        self.trainers = {t: trainers[t] for t in self._order if t in trainers}
        self._steppers, joint = joint_trainers(list(self.trainers.values()), self.cse,
                                               max_unit_memory=self.max_unit_memory, decisions=self.decisions)
        self.fused = None
        self.state = "separate"
        return joint

    def _go_separate(self, why: str) -> None:
        if why.startswith("the models do not vectorize"):  # structural: later groups need not try
            self.recorded.append(self.decisions.record_speedup(self.key, 0.0, replace=True))
            self._store(0.0, replace=True)
        timing = self._timing
        for t in self.trial_ids():
            if timing is not None and t == timing.trial_id:
                self.trainers[t] = timing
                continue
            job = self.jobs[t]
            try:
                trainer = supervised_trainer(self.evaluator, job.model, job.sample, job.trial.seed)
            except Exception as err:  # reported as the trial's failure at the epoch's end
                self._errors[t] = err
                continue
            member = TrainerMember(job, trainer)
            member.begin_epoch()
            for x, y, batch in self._kept:  # the batches the group has trained so far, in order
                member.train_batch(x, y, batch)
            self.trainers[t] = member
        joint = self._train_separately(self.trainers)
        self._timing, self._timing_step, self._snapshot, self._kept = None, None, None, []
        self.wasted_seconds = self._spent["fused"]
        self.decision = f"not fused: {why}; trained separately on one data pipeline" + (f" ({joint})" if joint else "")
        log.info("batching: trials %s %s", self.trial_ids(), self.decision)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]


class AdaptiveUnit(BatchedUnit):
    """A :class:`~tridens.xopt._batching.BatchedUnit` whose member is an :class:`AdaptiveMember`:
    fused or separate, decided from its first real training steps (see the module docstring)."""

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, reason: str = "", *,
                 shared_input: bool | None = None, skey: str = "", setup: tuple[Any, ...] = (),
                 flops: float = 0.0, settings: BatchingSettings | None = None, cse: CSESettings | None = None,
                 stored_key: str | None = None, known: tuple[float, str] | None = None,
                 decisions: Decisions | None = None, max_unit_memory: int | None = None):
        super().__init__(jobs, evaluator, reason, shared_input=shared_input, settings=settings)
        fused = self.member
        assert isinstance(fused, BatchedMember)
        self.member: AdaptiveMember = AdaptiveMember(fused, jobs, evaluator, skey=skey, setup=setup,  # type: ignore[assignment]
                                                     flops=flops, cse=cse, stored_key=stored_key, known=known,
                                                     decisions=decisions, max_unit_memory=max_unit_memory)

    def summary(self) -> str:
        return ExecutionUnit.summary(self) + f" ({self.member.engine})"

