"""The fused models of operator batching: K same-shaped models as ONE vectorized model
(:class:`BatchedMember`) and the unit that trains them (:class:`BatchedUnit`).

Parameters, buffers and optimizer state are stacked with ``torch.func``; dropout masks are drawn
outside vmap from each trial's own random stream, so fused equals separate. The planner is
:mod:`._batching`; the knobs are a :class:`~._settings.BatchingSettings` given to each member.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, vmap

from ..units import ExecutionUnit, Job, UnitResult
from ..evaluators import StepwiseEvaluator
from ..evaluators import NonFiniteLoss
from ..evaluators import BatchSource, SupervisedEvaluator, align_output
from ._grouped import GroupedProgram, _Unsupported
from ._pipeline import PipelineMember
from ._stacked import _DROPOUTS, _ForwardState, _MaskDropout, _dropout_names, _dropout_ps, _forward_state, _keep_freed_memory, _skeleton
from ._settings import BatchingSettings, Settings
from ._variants import order_by_variant, runs, sites, variant
from ._vector_optim import _VectorOptimizer, _resolved_momentum

# examples of the first batch on which the grouped program is checked against vmap
_CHECKED_EXAMPLES = 8

# -- the fused models ------------------------------------------------------------------------------------
def _example_batch(data: Any) -> tuple[torch.Tensor, ...] | None:
    """A batch of two examples shaped like ``data``'s first, on the meta device (None when its
    examples are not one tensor)."""
    try:
        example = data[0][0]
    except Exception:  # a dataset that cannot be indexed: the program traces without shapes
        return None
    if not isinstance(example, torch.Tensor):
        return None
    return (torch.empty((2, *example.shape), dtype=example.dtype, device="meta"),)


class BatchedMember(PipelineMember):
    """The K fused models of a unit: stacked parameters, buffers, optimizer state and random
    streams, stepped on batches its driver supplies.

    It is a :class:`~._pipeline.PipelineMember` (``inputs``,
    ``trial_ids``, ``limit``, ``epoch``, ``wants_epoch``, ``begin_epoch``, ``train_batch(x, y,
    batch)``, ``end_epoch``, ``begin_validation``, ``validate_batch(x, y)``, ``end_validation``,
    ``weights``, ``leave``), so a shared-pipeline unit can feed it like one trainer;
    :class:`BatchedUnit` drives it with its own pipeline. Per epoch: ``end_epoch()`` gives each
    trial trained ``{"train_loss": ...}`` or the error that failed it, ``end_validation()`` its
    validation metrics.
    """

    inputs: tuple[str, ...] = ("batch",)

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, *, shared_input: bool | None = None,
                 settings: BatchingSettings | None = None):
        if not isinstance(evaluator, SupervisedEvaluator):
            raise TypeError(f"operator batching trains Classification/Regression trials, not {type(evaluator).__name__}")
        models = [job.model for job in jobs if isinstance(job.model, nn.Module)]
        if len(jobs) == 0 or len(models) != len(jobs):
            raise TypeError("operator batching needs a model per trial")
        order = order_by_variant(models)  # each activation variant's rows together
        jobs, models = [jobs[i] for i in order], [models[i] for i in order]
        self.settings = settings = settings if settings is not None else Settings.from_env().batching
        if settings.keep_freed_memory:
            _keep_freed_memory()
        self.jobs = {job.trial.id: job for job in jobs}
        self.speedup: float | None = None  # fused on this measured speed-up (set by the planner), if known
        self.configs = {job.trial.id: job.config(evaluator) for job in jobs}
        self.cfg = cfg = self.configs[jobs[0].trial.id]
        self.owner = type(evaluator).__name__
        self.device = cfg.device
        self.ids: list[int] = [job.trial.id for job in jobs]  # the stack's rows, in order
        self._members = list(self.ids)                         # every trial not left yet
        first = models[0]
        self.base = _skeleton(first)
        self._keys = _state_keys(first)
        # activation variants (:mod:`._variants`): each row's, the sites where they differ, and a
        # skeleton per variant for the vmapped forward
        variants = [variant(m) for m in models]
        if len({tuple(name for name, _ in v) for v in variants}) > 1:
            raise TypeError("the models have their activations in different places")
        self._variants = {job.trial.id: v for job, v in zip(jobs, variants)}
        representative: dict[tuple[Any, ...], nn.Module] = {}  # each variant's first model
        for v, m in zip(variants, models):
            representative.setdefault(v, m)
        self._site_modules = {v: sites(m) for v, m in representative.items()}
        choices = [dict(v) for v in representative]
        self._mixed_sites = {name for name in choices[0] if len({c[name] for c in choices}) > 1}
        # one skeleton per variant (the first model's is the base) where the unit mixes them
        self._bases = {v: self.base if m is first else _skeleton(m) for v, m in representative.items()} \
            if self._mixed_sites else {}
        self._runs: list[tuple[int, int, tuple[Any, ...]]] = []
        self._forwards: dict[tuple[Any, ...], tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {}
        with torch.no_grad():
            named = [(dict(m.named_parameters()), dict(m.named_buffers())) for m in models]
            self.params: dict[str, torch.Tensor] = {
                n: torch.stack([p[n].detach().to(self.device) for p, _ in named]).requires_grad_(t.requires_grad)
                for n, t in first.named_parameters()}
            self.buffers: dict[str, torch.Tensor] = {
                n: torch.stack([b[n].detach().to(self.device) for _, b in named]) for n, _ in first.named_buffers()}
        self._ps = {job.trial.id: _dropout_ps(m) for job, m in zip(jobs, models)}
        self._dropout_index = _dropout_names(first)
        self._dropout_dims = {n: _DROPOUTS[type(m)] for n, m in first.named_modules() if type(m) in _DROPOUTS}
        self._mask_shapes: dict[tuple[Any, ...], tuple[int, ...]] = {}
        self._scales: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._program: GroupedProgram | None = None
        self._program_checked = False
        self.why_vmap = "" if settings.packed else "settings.packed is False"
        if settings.packed:
            try:
                # channels-last where asked, and where the memory-format policy runs the separate trainer so
                last = settings.channels_last or cfg.channels_last
                self._program = GroupedProgram(copy.deepcopy(first).to("meta"), channels_last=last,
                                               mixed=self._mixed_sites, exact=settings.exact,
                                               example_inputs=_example_batch(cfg.train))
            except _Unsupported as err:
                self.why_vmap = str(err)
        self._generators = {job.trial.id: self._generator(job.trial.seed) for job in jobs}
        self.optimizer = _VectorOptimizer(cfg.optimizer, [_resolved_momentum(self.configs[i]) for i in self.ids],
                                          [self.configs[i].weight_decay for i in self.ids])
        self._epochs = {i: 0 for i in self.ids}
        self.step = 0
        self._parked: dict[int, dict[str, torch.Tensor]] = {}
        self._errors: dict[int, BaseException] = {}
        self._calls: dict[tuple[int, ...], list[tuple[int, tuple[int, ...], torch.dtype]]] = {}
        self.shared_input = shared_input
        self._fwd_shared, self._fwd_each = self._vmapped(self.base)
        self._training: list[int] = []
        self._update_runs()
        self._totals: dict[int, float] = {}
        self._count = 0
        self._val_sums: dict[int, dict[str, float]] = {}
        self._val_n = self._val_elements = 0

    # -- the member protocol ---------------------------------------------------------------------
    def measured(self) -> dict[str, Any] | None:
        """``{"trials", "speedup", "fused": True}`` when fused on a known measured speed-up."""
        if self.speedup is None:
            return None
        return {"trials": list(self.jobs), "speedup": self.speedup, "fused": True}

    def trial_ids(self) -> list[int]:
        return list(self._members)

    def limit(self, trial_id: int) -> int:
        job = self.jobs[trial_id]
        epochs = self.configs[trial_id].epochs
        return epochs if job.max_steps is None else min(epochs, job.max_steps)

    def epoch(self, trial_id: int) -> int:
        return self._epochs.get(trial_id, 0)

    def wants_epoch(self) -> bool:
        return any(self.epoch(t) < self.limit(t) for t in self.ids)

    def begin_epoch(self) -> None:
        """Park the trials out of budget (not left yet), put the others in training mode."""
        done = [r for r, i in enumerate(self.ids) if self._epochs[i] >= self.limit(i)]
        if done:
            self._remove(done, park=True)
        self._training = list(self.ids)
        self._totals = {i: 0.0 for i in self.ids}
        self._count = 0
        self.base.train()

    def train_batch(self, x: torch.Tensor, y: torch.Tensor, batch: int) -> dict[int, float]:
        """One optimizer step of every model in the stack; returns each one's training loss.
        A model whose loss is not finite fails (reported by :meth:`end_epoch`) and leaves the
        stack before the step; the others' steps do not depend on it."""
        if not self.ids:
            return {}
        cfg = self.cfg
        lrs = [self.configs[i].lr_at(self.step) for i in self.ids]
        with cfg.autocast():  # the evaluator's precision, as its separate trainer runs it
            out = self._train_outputs(x)
        losses = _stacked_loss(cfg.loss, _full(out), y)
        values = losses.detach().tolist()
        bad = [r for r, v in enumerate(values) if not math.isfinite(v)]
        good = [r for r in range(len(values)) if r not in bad]
        if good:
            (losses[torch.tensor(good, device=losses.device)] if bad else losses).sum().backward()
        result: dict[int, float] = {}
        for r, i in enumerate(self.ids):
            if r in bad:
                self._errors[i] = NonFiniteLoss.at(self.owner, values[r], epoch=self._epochs[i], batch=batch,
                                                   step=self.step, lr=lrs[r])
            else:
                result[i] = values[r]
                if i in self._totals:
                    self._totals[i] += values[r] * len(y)
        self._count += len(y)
        if bad:
            self._remove(bad, park=True, keep_grads=True)
            lrs = [lrs[r] for r in good]
        if self.ids:
            self.optimizer.step(self.params, lrs)
        for p in self.params.values():
            p.grad = None
        self.step += 1
        return result

    def end_epoch(self) -> dict[int, dict[str, float] | BaseException]:
        out: dict[int, dict[str, float] | BaseException] = {}
        for i in self._training:
            if i in self._errors:
                out[i] = self._errors.pop(i)
            elif i in self.ids:
                self._epochs[i] += 1
                out[i] = {"train_loss": self._totals[i] / self._count}
        return out

    def begin_validation(self) -> None:
        self.base.eval()
        self._val_sums = {i: {name: 0.0 for name in self.cfg.metrics} for i in self.ids}
        self._val_n = self._val_elements = 0

    @torch.no_grad()
    def validate_batch(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Accumulate every model's metrics on a validation batch, as ``SupervisedTrainer.validate``
        does (per-batch values as Python floats, summed in the same order)."""
        if not self.ids:
            return
        cfg, names = self.cfg, self.cfg.metrics
        with cfg.autocast():
            out = _full(self._eval_outputs(x))
        size = len(y)
        self._val_n += size
        per: dict[str, list[float]] = {}
        if "val_loss" in names:
            per["val_loss"] = [v * size for v in _stacked_loss(cfg.loss, out, y).tolist()]
        if "val_acc" in names:
            # max's indices are argmax's (the first maximum, NaN first), and over the class dim of
            # the grouped program's (K, C, B) outputs much faster (argmax walks it per element)
            per["val_acc"] = [float(c) for c in (out.max(dim=2).indices == y).sum(dim=1).tolist()]
        if "val_mse" in names or "val_mae" in names:
            diff = vmap(lambda o: align_output(o, y) - y.to(o.dtype))(out)
            self._val_elements += diff[0].numel()
            flat = diff.reshape(len(self.ids), -1)
            if "val_mse" in names:
                per["val_mse"] = (flat * flat).sum(dim=1).tolist()
            if "val_mae" in names:
                per["val_mae"] = flat.abs().sum(dim=1).tolist()
        for name, values in per.items():
            for i, v in zip(self.ids, values):
                self._val_sums[i][name] += float(v)

    def end_validation(self) -> dict[int, dict[str, float] | BaseException]:
        self.base.train()
        n, elements = self._val_n, self._val_elements
        return {i: {name: value / (elements if name in ("val_mse", "val_mae") else n) for name, value in sums.items()}
                for i, sums in self._val_sums.items() if i in self._training}

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        if trial_id in self._parked:
            return dict(self._parked[trial_id])
        return self._row_state(self.ids.index(trial_id))

    def batching(self) -> str:
        """Always ``"force"``: one vectorized model."""
        return "force"

    def state_dict(self, trial_id: int, job: Job, evaluator: StepwiseEvaluator) -> dict[str, Any] | None:
        """The trial's trainer checkpoint, from its row of the stacked weights, optimizer state and
        random stream, as a SupervisedTrainer of its model would hold it (None on CUDA, whose
        random streams are not a trainer's)."""
        from ..evaluators import CHECKPOINT_FORMAT

        if trial_id not in self.ids or self.device.type != "cpu":
            return None
        row = self.ids.index(trial_id)
        opt = self.optimizer
        adaptive = opt.kind in ("adam", "adamw", "rmsprop")  # torch keeps a step count per parameter
        state: dict[int, dict[str, Any]] = {}
        for i, (name, _) in enumerate(job.concrete_model.named_parameters()):
            stacked = opt.state.get(name)
            if not stacked:
                continue
            entry = {k: v[row].detach().clone().cpu() for k, v in stacked.items()}
            if adaptive:
                entry["step"] = torch.tensor(float(opt.steps[name]))
            state[i] = entry
        cfg = job.config(evaluator)
        groups = cfg.make_optimizer(job.concrete_model.parameters()).state_dict()["param_groups"]
        return {"format": CHECKPOINT_FORMAT, "model": self.weights(trial_id),
                "optimizer": {"state": state, "param_groups": groups},
                "epoch": self.epoch(trial_id), "step": self.step, "seed": job.trial.seed,
                "rng": self._generators[trial_id].get_state().clone()}

    def leave(self, trial_id: int) -> None:
        if trial_id in self.ids:
            self._remove([self.ids.index(trial_id)], park=False)
        for store in (self._parked, self._errors, self._generators):
            store.pop(trial_id, None)
        if trial_id in self._members:
            self._members.remove(trial_id)

    # -- the vectorized forward ------------------------------------------------------------------
    def _generator(self, seed: int) -> torch.Generator:
        if self.device.type == "cpu":
            # The state torch.manual_seed(seed) gives the CPU stream: what a separate trainer draws from.
            return torch.Generator().manual_seed(seed)
        return torch.Generator(device=self.device).manual_seed(seed)

    @staticmethod
    def _vmapped(base: nn.Module) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
        """``base``'s forward vmapped over the stacked models, on a shared and on a per-model input.
        A dropout call whose rate is 0 in every model has no mask (None): not mapped over."""
        def forward(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                    masks: tuple[torch.Tensor | None, ...], x: torch.Tensor) -> torch.Tensor:
            with _forward_state(_ForwardState(masks=masks)):
                return functional_call(base, (params, buffers), (x,))

        def mapped(x_dim: int | None) -> Callable[..., torch.Tensor]:
            def call(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                     masks: tuple[torch.Tensor | None, ...], x: torch.Tensor) -> torch.Tensor:
                mask_dims = tuple(None if m is None else 0 for m in masks)
                return vmap(forward, in_dims=(0, 0, mask_dims, x_dim), randomness="error")(params, buffers, masks, x)
            return call

        return mapped(None), mapped(0)

    def _update_runs(self) -> None:
        """The runs of rows with one activation variant (one run unless the unit mixes them)."""
        self._runs = runs([self._variants[i] for i in self.ids])

    def site_runs(self, name: str) -> list[tuple[int, int, nn.Module]]:
        """``(start, end, module)``: the activation the rows ``start:end`` apply at site ``name``."""
        return [(start, end, self._site_modules[v][name]) for start, end, v in self._runs]

    def _dropout_calls(self, x: torch.Tensor) -> list[tuple[int, tuple[int, ...], torch.dtype]]:
        """The dropout calls of a training forward on ``x``: (dropout index, mask shape, dtype) in
        call order, found once per input shape by a forward of one model that records them. A
        forward run per model is checked there to draw no other random numbers (those would come
        from the global stream, not the trial's: vmap refuses them with ``randomness="error"``)."""
        key = tuple(x.shape)
        if key not in self._calls:
            record: list[tuple[int, tuple[int, ...], torch.dtype]] = []
            per_model = self._program is None and self.settings.exact
            if per_model or any(type(m) is _MaskDropout for m in self.base.modules()):
                params = {n: p[0].detach() for n, p in self.params.items()}
                buffers = {n: b[0].clone() for n, b in self.buffers.items()}
                before = torch.get_rng_state()
                # (under the precision's autocast: masks have the dtype the training forward gives)
                with torch.no_grad(), _forward_state(_ForwardState(record=record)), self.cfg.autocast():
                    functional_call(self.base, (params, buffers), (x,))
                if per_model and not torch.equal(before, torch.get_rng_state()):
                    raise RuntimeError("the forward draws random numbers besides its dropout modules")
            self._calls[key] = record
        return self._calls[key]

    @property
    def engine(self) -> str:
        """``"grouped kernels"`` (the packed program), else ``"per model"`` (exact settings: each
        model's own forward on its rows) or ``"vmap"``."""
        if self._program is not None:
            return "grouped kernels"
        return "per model" if self.settings.exact else "vmap"

    def _check_program(self, x: torch.Tensor) -> None:
        """Use the packed program only if it reproduces the vmapped forward (eval mode) on ``x``'s
        first examples (the whole batch would cost a vmapped forward of every model)."""
        self._program_checked = True
        assert self._program is not None
        x = x[:_CHECKED_EXAMPLES]
        was_training = self.base.training
        self.base.eval()
        try:  # (in full precision: under autocast the two would differ by bf16 roundings)
            with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
                reference = self._outputs(x, ())
                try:
                    got = self._program.run(self, x, training=False)
                except Exception as err:
                    self.why_vmap, self._program = self._program.describe_error(err), None
                    return
                if got.shape != reference.shape or not torch.allclose(got, reference, rtol=1e-4, atol=1e-5):
                    self.why_vmap, self._program = f"the grouped program disagreed with {self.engine}", None
        finally:
            self.base.train(was_training)

    def _train_outputs(self, x: torch.Tensor) -> torch.Tensor:
        if self._program is not None and not self._program_checked:
            self._check_program(x)
        if self._program is not None:
            return self._program.run(self, x, training=True)
        return self._outputs(x, self._masks(x))

    def _eval_outputs(self, x: torch.Tensor) -> torch.Tensor:
        if self._program is not None and not self._program_checked:
            self._check_program(x)
        if self._program is not None:
            return self._program.run(self, x, training=False)
        return self._outputs(x, ())  # eval mode: dropout is the identity

    def _draw(self, shape: tuple[int, ...], dtype: torch.dtype, ps: Sequence[float],
              like: torch.Tensor | None = None) -> torch.Tensor:
        """Masks ``(K, *shape)``, row k drawn from model k's stream as ``F.dropout`` draws on CPU
        (laid out in memory like ``like`` where that has their shape and dtype)."""
        numel = math.prod(shape)
        if self.device.type == "cpu" and dtype in (torch.float32, torch.float64) and _uniform_dropout():
            # F.dropout's mask is bernoulli_(1 - p) / (1 - p), and bernoulli_ compares one double
            # uniform per element (torch.rand's draw) with 1 - p: drawing the uniforms per model,
            # then comparing and scaling every row in one op each, gives the same masks bit for
            # bit in less time than one bernoulli_ per model
            u = torch.empty((len(ps), *shape), dtype=torch.float64)
            for r, (i, p) in enumerate(zip(self.ids, ps)):
                if 0 < p < 1 and numel:
                    u[r].uniform_(0, 1, generator=self._generators[i])
                else:  # F.dropout draws nothing: ones (0 < 1) for p = 0, zeros (0 < 0) for p = 1
                    u[r].zero_()
            q, c = self._mask_scales(tuple(ps), dtype, len(shape))
            out = torch.empty_like(like) if like is not None and like.shape == u.shape and like.dtype == dtype \
                else torch.empty(u.shape, dtype=dtype)
            return torch.lt(u, q, out=out).mul_(c)
        rows = []
        for i, p in zip(self.ids, ps):
            if p == 0 or numel == 0:  # F.dropout returns its input without drawing
                rows.append(torch.ones(shape, dtype=dtype, device=self.device))
            elif p == 1:
                rows.append(torch.zeros(shape, dtype=dtype, device=self.device))
            else:
                rows.append(torch.empty(shape, dtype=dtype, device=self.device)
                            .bernoulli_(1 - p, generator=self._generators[i]).div_(1 - p))
        return torch.stack(rows)

    def _mask_scales(self, ps: tuple[float, ...], dtype: torch.dtype, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, ``1 - p`` (float64: what bernoulli_ compares with; 1 / 0 where nothing is drawn)
        and the scale ``1 / (1 - p)`` as ``F.dropout`` divides (in ``dtype``), shaped to broadcast."""
        key = (ps, dtype, dims)
        if key not in self._scales:
            shape = (-1,) + (1,) * dims
            q = torch.tensor([1.0 if p == 0 else 0.0 if p == 1 else 1 - p for p in ps], dtype=torch.float64)
            keep = torch.tensor([1 - p if 0 < p < 1 else 1.0 for p in ps], dtype=dtype)
            self._scales[key] = (q.view(shape), (torch.ones((), dtype=dtype) / keep).view(shape))
        return self._scales[key]

    def _packed_dropout(self, v: torch.Tensor, name: str, src: str) -> torch.Tensor:
        """Dropout of a packed value: "C" ``(B, K*C, ...)`` or "M" ``(K, B, F)``."""
        index = self._dropout_index[name]
        ps = [self._ps[i][index] for i in self.ids]
        if all(p == 0 for p in ps):
            return v
        k = len(self.ids)
        key = (name, src, k, tuple(v.shape))
        shape = self._mask_shapes.get(key)
        if shape is None:
            per_model = (v.shape[0], v.shape[1] // k, *v.shape[2:]) if src == "C" else tuple(v.shape[1:])
            shape = self._mask_shapes[key] = _MaskDropout(index, self._dropout_dims[name]).mask_shape(
                torch.Size(per_model))
        mask = self._draw(shape, v.dtype, ps, like=v if src == "M" else None)
        if src == "C":
            mask = mask.transpose(0, 1).reshape(shape[0], k * shape[1], *shape[2:])
        return v * mask

    def _row_dropout(self, v: torch.Tensor, name: str) -> torch.Tensor:
        """Dropout of batch-stacked maps ``(K*B, ...)``: each model's rows through the dropout's own
        function, with the default generator of their device holding that trial's stream while it
        draws -- what the separate trainer runs, so the masks are its masks bit for bit whatever the
        maps' memory format (a channels-last map draws in memory order) and the build's sampler."""
        index = self._dropout_index[name]
        ps = [self._ps[i][index] for i in self.ids]
        if all(p == 0 for p in ps):
            return v
        drop = _DROPOUT_FUNCTIONS[self._dropout_dims[name]]
        default = torch.cuda.default_generators[v.device.index or 0] if v.device.type == "cuda" \
            else torch.default_generator
        outer = default.get_state()
        outs = []
        try:
            for i, p, rows in zip(self.ids, ps, v.split(v.shape[0] // len(self.ids))):
                stream = self._generators[i]
                default.set_state(stream.get_state())
                outs.append(drop(rows, p, True))
                stream.set_state(default.get_state())
        finally:
            default.set_state(outer)
        return torch.cat(outs)

    def _masks(self, x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """This step's dropout masks, ``(K, *mask shape)`` per call; each model's rows drawn from
        its own stream in call order, as ``F.dropout`` draws on CPU."""
        masks: list[torch.Tensor | None] = []
        for index, shape, dtype in self._dropout_calls(x):
            ps = [self._ps[i][index] for i in self.ids]
            masks.append(None if all(p == 0 for p in ps) else self._draw(shape, dtype, ps))
        return tuple(masks)

    def _outputs(self, x: torch.Tensor, masks: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """The stacked outputs ``(K, ...)`` without the packed program: per model under exact
        settings, else vmapped (:meth:`_vmapped_forward`)."""
        if self.settings.exact:
            return self._per_model_outputs(x, masks)
        return self._vmapped_forward(x, masks)

    def _per_model_outputs(self, x: torch.Tensor, masks: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """Each model's own forward (its variant's skeleton) on views of its rows of the stacked
        parameters and buffers, its dropout masks its rows of ``masks``: the kernels, layouts and
        values of separate training, so its outputs and gradients are that model's bit for bit
        (BatchNorm's running statistics update the stacked buffers through the views)."""
        outs = []
        params = {n: p.unbind(0) for n, p in self.params.items()}
        buffers = {n: b.unbind(0) for n, b in self.buffers.items()}
        for r, i in enumerate(self.ids):
            base = self._bases.get(self._variants[i], self.base) if self._mixed_sites else self.base
            if base.training != self.base.training:
                base.train(self.base.training)
            row = tuple(None if m is None else m[r] for m in masks)
            with _forward_state(_ForwardState(masks=row)):
                outs.append(functional_call(base, ({n: p[r] for n, p in params.items()},
                                                   {n: b[r] for n, b in buffers.items()}), (x,)))
        return torch.stack(outs)

    def _vmapped_forward(self, x: torch.Tensor, masks: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """The stacked outputs ``(K, ...)`` by vmap. The input is shared (not batched) so the first layer
        runs as one wide layer; if the models cannot take an unbatched input (BatchNorm on the raw
        input updates batched statistics from it), each gets its own expanded copy. A unit that
        mixes activation variants runs each variant's rows (a slice: views of the stacked
        parameters and buffers) through that variant's skeleton."""
        if not self._mixed_sites:
            return self._vmapped_outputs(self._fwd_shared, self._fwd_each, self.params, self.buffers, masks, x)
        outs = []
        for start, end, v in self._runs:
            base = self._bases[v]
            if base.training != self.base.training:
                base.train(self.base.training)
            if v not in self._forwards:
                self._forwards[v] = self._vmapped(base)
            rows = slice(start, end)
            outs.append(self._vmapped_outputs(
                *self._forwards[v], {n: p[rows] for n, p in self.params.items()},
                {n: b[rows] for n, b in self.buffers.items()}, tuple(None if m is None else m[rows] for m in masks), x))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _vmapped_outputs(self, shared: Callable[..., torch.Tensor], each: Callable[..., torch.Tensor],
                         params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                         masks: tuple[torch.Tensor | None, ...], x: torch.Tensor) -> torch.Tensor:
        if self.shared_input is None:  # first call: try sharing on copies of the buffers
            trial = {n: b.clone() for n, b in buffers.items()}
            try:
                out = shared(params, trial, masks, x)
            except RuntimeError:
                self.shared_input = False
            else:
                self.shared_input = True
                with torch.no_grad():
                    for n, b in buffers.items():
                        b.copy_(trial[n])
                return out
        if self.shared_input:
            return shared(params, buffers, masks, x)
        rows = next(iter(params.values())).shape[0]
        return each(params, buffers, masks, x.expand(rows, *x.shape))

    # -- the stack -------------------------------------------------------------------------------
    def _row_state(self, row: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, name in self._keys:
            source = self.params[name] if name in self.params else self.buffers[name]
            out[key] = source[row].detach().clone().cpu()
        return out

    def _remove(self, rows: list[int], *, park: bool, keep_grads: bool = False) -> None:
        """Take the models at ``rows`` out of the stack (keeping their weights if ``park``)."""
        if park:
            for r in rows:
                self._parked[self.ids[r]] = self._row_state(r)
        keep = [r for r in range(len(self.ids)) if r not in rows]
        self.ids = [self.ids[r] for r in keep]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        with torch.no_grad():
            params = {}
            for n, p in self.params.items():
                q = p.detach().index_select(0, index).requires_grad_(p.requires_grad)
                if keep_grads and p.grad is not None:
                    q.grad = p.grad.index_select(0, index)
                params[n] = q
            self.params = params
            self.buffers = {n: b.index_select(0, index) for n, b in self.buffers.items()}
        self.optimizer.select(keep)
        self._update_runs()


# dropout module kind (its ``_DROPOUTS`` entry: the rank it drops features of) -> its function
_DROPOUT_FUNCTIONS: dict[int | None, Callable[..., torch.Tensor]] = {
    None: F.dropout, 3: F.dropout1d, 4: F.dropout2d, 5: F.dropout3d}


def _full(out: torch.Tensor) -> torch.Tensor:
    """Outputs of a mixed-precision forward in float32 (the loss and metrics are computed so)."""
    return out.float() if out.dtype in (torch.bfloat16, torch.float16) else out


def _stacked_loss(loss: Callable[..., torch.Tensor], out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each model's loss on stacked outputs ``(K, B, ...)``: ``loss`` on each model's rows, laid
    out in memory as the separate model's output (contiguous), so every value and gradient is the
    separate model's bit for bit. (One cross entropy over the K*B rows averaged per model, or
    over the class dim of the grouped program's ``(K, C, B)`` outputs as they lie, is a little
    faster but sums in another order: an ulp off.)"""
    return torch.stack([loss(o, y) for o in out.contiguous().unbind(0)])


@functools.lru_cache(maxsize=None)  # a fact of this torch build, not of a run
def _uniform_dropout() -> bool:
    """Whether this build's CPU ``bernoulli_(q)`` is ``torch.rand(dtype=float64) < q`` (its default
    kernel; with MKL on Intel CPUs it draws from an MKL stream instead): checked once per process."""
    a, b = torch.Generator().manual_seed(20261123), torch.Generator().manual_seed(20261123)
    drawn = torch.empty(1000).bernoulli_(0.7, generator=a)
    compared = torch.rand(1000, dtype=torch.float64, generator=b).lt(0.7).float()
    return torch.equal(drawn, compared) and torch.equal(a.get_state(), b.get_state())


def _state_keys(model: nn.Module) -> list[tuple[str, str]]:
    """``(state_dict key, name of the stacked tensor holding it)``: tied parameters and buffers
    appear under every name in a state_dict but are stacked once."""
    canonical = {id(t): n for n, t in model.named_parameters()}
    for n, t in model.named_buffers():
        canonical.setdefault(id(t), n)
    alias = {n: canonical[id(t)] for n, t in model.named_parameters(remove_duplicate=False)}
    alias.update({n: canonical[id(t)] for n, t in model.named_buffers(remove_duplicate=False)})
    return [(k, alias.get(k, k)) for k in model.state_dict().keys()]


class BatchedUnit(ExecutionUnit):
    """K trials with identical model structure and training setup, trained as one vectorized
    model (see the module docstring) on one data pipeline. Built by :func:`plan_batching`;
    usable directly::

        unit = BatchedUnit(jobs, evaluator)
        while unit.active():
            results = unit.train_epoch()       # {trial id: metrics, or the error that failed it}
            ...                                 # unit.drop(trial_id) when a trial ends or stops

    ``weights(trial_id)`` is the trial's own ``state_dict`` (same keys as its model's).
    """

    kind = "batched"
    splittable = True

    def __init__(self, jobs: Sequence[Job], evaluator: StepwiseEvaluator, reason: str = "", *,
                 shared_input: bool | None = None, settings: BatchingSettings | None = None):
        super().__init__(jobs, evaluator)
        self.reason = reason
        self.memory: int | None = None  # the planner's estimate (bytes), read by the mixed-unit pass
        self.member = BatchedMember(jobs, evaluator, shared_input=shared_input, settings=settings)
        cfg = self.member.cfg
        self._seed = jobs[0].trial.seed  # data order and augmentation: shared (the group key says so)
        self._train = BatchSource(cfg.train, cfg.device)
        self._val = BatchSource(cfg.val, cfg.device)

    def summary(self) -> str:
        m = self.member  # (the planner's probe already checked the grouped program on this structure)
        return super().summary() + f" ({m.engine}" + (f": {m.why_vmap}" if m._program is None else "") + ")"

    def state_dict(self, trial_id: int) -> dict[str, Any] | None:
        return self.member.state_dict(trial_id, self.jobs[trial_id], self.evaluator)

    def groups(self) -> list[list[int]]:
        return [list(self.member.trial_ids())]

    def shared(self) -> list[str]:
        return ["one data pipeline", f"one vectorized model ({self.member.engine})"]

    def speedups(self) -> list[dict[str, Any]]:
        measured = self.member.measured()
        return [measured] if measured else []

    def measurements(self) -> list[Any]:
        return list(getattr(self.member, "recorded", ()))

    def batching(self) -> str:
        return "auto" if self.member.batching() == "auto" else "force"

    def limit(self, trial_id: int) -> int:
        return self.member.limit(trial_id)

    def epoch(self, trial_id: int) -> int:
        return self.member.epoch(trial_id)

    def weights(self, trial_id: int) -> dict[str, Any] | None:
        return self.member.weights(trial_id)

    def _leave(self, trial_id: int) -> None:
        self.member.leave(trial_id)

    def train_epoch(self) -> dict[int, UnitResult]:
        member, cfg = self.member, self.member.cfg
        if not member.wants_epoch():
            return {}
        t0 = time.monotonic()
        epoch = min(member.epoch(i) for i in member.ids if member.epoch(i) < member.limit(i))
        member.begin_epoch()
        trained = list(member.ids)
        for batch, (x, y) in enumerate(self._train.epoch_batches(cfg, self._seed, epoch)):
            if not member.ids:
                break  # every model failed: the rest of the epoch trains nothing
            member.train_batch(cfg.augment(x, self._seed, epoch, batch), y, batch)
        train = member.end_epoch()
        val: dict[int, dict[str, float] | BaseException] = {}
        if member.ids:
            member.begin_validation()
            for x, y in self._val.validation_batches(cfg, self._seed):
                member.validate_batch(x, y)
            val = member.end_validation()
        results: dict[int, UnitResult] = {}
        metric = self.objective.metric
        for i in trained:
            result = train.get(i)
            if isinstance(result, BaseException) or result is None:
                results[i] = result if result is not None else RuntimeError(f"trial {i} was not trained")
                continue
            scores = val.get(i)
            metrics = {**scores, **result} if isinstance(scores, dict) else result
            results[i] = {metric: metrics[metric], **metrics}
        share = (time.monotonic() - t0) / max(len(trained), 1)
        for i in trained:
            info = self.jobs[i].trial.info
            info["train_seconds"] = info.get("train_seconds", 0.0) + share
        return results
