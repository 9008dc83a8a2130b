"""Exact fusion: a model trained in a fused stack is the model separate training gives, bit for bit
(CPU, float32 and float64), whatever the other models in the stack, for every fused optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tridens as td
from tridens.evaluators._supervised import BatchSource
from tridens.trial import Trial
from tridens.units import Job
from tridens.xopt import BatchingSettings
from tridens.xopt._batched import BatchedMember, _example_batch
from tridens.xopt._exact import BatchedLinear, linear_per_model
from tridens.xopt._grouped import GroupedProgram
from tridens.xopt._vector_optim import _VectorOptimizer, disagreeing_form, stacked_update_is_exact

OPTIMIZERS = ["sgd", "adam", "adamw", "rmsprop"]
# different lrs, momenta (Adam's beta1), weight decays, schedules and dropout in one stack
SAMPLES = [dict(lr=0.01, m=0.9, wd=0.0, s="constant", p=0.0),
           dict(lr=0.003, m=0.5, wd=1e-3, s="cosine", p=0.25),
           dict(lr=0.02, m=0.0, wd=1e-2, s="rex", p=0.5),
           dict(lr=0.001, m=0.8, wd=1e-3, s="step", p=0.1)]


@pytest.fixture(scope="module")
def data():
    return td.datasets.digits()


def bn_cnn(p: float, dtype: torch.dtype) -> nn.Module:
    """Three 3x3 convolutions with biases before BatchNorm (their true gradient is zero: pure
    rounding noise, which Adam and RMSprop turn into lr-sized steps), max-pool, channel and
    element-wise dropout of maps and of features, a linear head."""
    return nn.Sequential(
        nn.Conv2d(1, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(), nn.Dropout2d(p / 2),
        nn.Conv2d(12, 24, 3, padding=1), nn.BatchNorm2d(24), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(p / 2),
        nn.Conv2d(24, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(p), nn.Linear(32 * 2 * 2, 10)).to(dtype)


def mlp(p: float, dtype: torch.dtype) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 48), nn.BatchNorm1d(48), nn.ReLU(), nn.Dropout(p),
                         nn.Linear(48, 10)).to(dtype)


class ShapeCheckedCnn(nn.Module):
    """A forward as users write it: a rank check on its input (flat 64-pixel rows are made maps)
    and a global-average head, ``.mean((2, 3))``."""

    def __init__(self, p: float):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                                      nn.Conv2d(12, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        if x.dim() == 2:
            x = x.view(x.size(0), 1, 8, 8)
        return self.head(self.drop(self.features(x).mean((2, 3))))


def shape_checked_cnn(p: float, dtype: torch.dtype) -> nn.Module:
    return ShapeCheckedCnn(p).to(dtype)


def evaluator(data, optimizer, dtype, epochs=2, **kwargs):
    train, val = (torch.utils.data.TensorDataset(d.tensors[0].to(dtype), d.tensors[1]) for d in data)
    return td.evaluators.Classification(
        train, val, epochs=epochs, batch_size=64, optimizer=optimizer, lr=td.loguniform("lr", 1e-6, 1.0),
        momentum=td.uniform("m", 0.0, 0.99), weight_decay=td.uniform("wd", 0.0, 1.0),
        schedule=td.choice("s", ["constant", "cosine", "rex", "step"]), **kwargs)


def jobs(build, dtype, samples=SAMPLES):
    out = []
    for i, s in enumerate(samples):
        torch.manual_seed(100 + i)
        out.append(Job(Trial(id=i, sample=s, seed=100 + i), build(s["p"], dtype)))
    return out


def train_side_by_side(ev, build, dtype, settings, epochs, leave=None, maps=None):
    """Train the samples separately and fused on the same batches, comparing every model's loss,
    parameters and buffers bit for bit after every step and its validation metrics every epoch.
    ``leave``: (trial, epoch, batch) after which that trial leaves the stack; ``maps``: the grouped
    program's layout of maps, if not its own choice. Returns the steps."""
    separate = {j.trial.id: ev.trainer(j.model, j.sample, j.trial.seed) for j in jobs(build, dtype)}
    member = BatchedMember(jobs(build, dtype), ev, settings=settings)
    if maps is not None:
        cfg = ev.config(SAMPLES[0])
        member._program = GroupedProgram(build(0.0, dtype).to("meta"), channels_last=cfg.channels_last, exact=True,
                                         example_inputs=_example_batch(cfg.train), maps=maps)
    source = BatchSource(ev.config(SAMPLES[0]).train, torch.device("cpu"))
    cfg = ev.config(SAMPLES[0])
    steps = 0
    for epoch in range(epochs):
        member.begin_epoch()
        for t in separate.values():
            t.begin_epoch()
        for batch, (x, y) in enumerate(source.epoch_batches(cfg, 0, epoch)):
            fused = member.train_batch(x, y, batch)
            assert set(fused) == set(member.ids)
            for row, tid in enumerate(member.ids):
                assert fused[tid] == separate[tid].train_batch(x, y, batch), (tid, epoch, batch)
                model = separate[tid].model
                for name, value in [*model.named_parameters(), *model.named_buffers()]:
                    stacked = member.params.get(name, member.buffers.get(name))
                    assert torch.equal(stacked[row], value), (tid, epoch, batch, name)
            steps += 1
            if leave is not None and (epoch, batch) == leave[1:]:
                member.leave(leave[0])
                del separate[leave[0]]
        member.end_epoch()
        member.begin_validation()
        for x, y in BatchSource(cfg.val, cfg.device).validation_batches(cfg, 0):
            member.validate_batch(x, y)
        val = member.end_validation()
        for tid, trainer in separate.items():
            assert val[tid] == trainer.validate(), (tid, epoch)
    return steps, member


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_bn_cnn_is_separate_bit_for_bit(data, optimizer, dtype):
    """The grouped-kernel engine: every step's loss, parameters and BatchNorm statistics equal;
    a model leaving mid-epoch leaves the others' arithmetic as it was."""
    ev = evaluator(data, optimizer, dtype)
    steps, member = train_side_by_side(ev, bn_cnn, dtype, BatchingSettings(), epochs=2, leave=(1, 0, 11))
    assert member.engine == "grouped kernels" and steps == 46 and member.ids == [0, 2, 3]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_per_model_engine_is_separate_bit_for_bit(data, optimizer):
    """Models the grouped program does not run (here: packed=False) run per model, still exact;
    an MLP with BatchNorm1d on the grouped engine too."""
    ev = evaluator(data, optimizer, torch.float32, epochs=1)
    _, member = train_side_by_side(ev, bn_cnn, torch.float32, BatchingSettings(packed=False), epochs=1)
    assert member.engine == "per model"
    _, member = train_side_by_side(ev, mlp, torch.float32, BatchingSettings(), epochs=1, leave=(3, 0, 5))
    assert member.engine == "grouped kernels"


def test_a_forward_with_a_shape_check_and_a_mean_head_runs_grouped_and_exact(data):
    """The grouped program traces as the graph IR does (the rank check decided from the data's
    shape) and runs the mean over the maps itself: grouped kernels, bit for bit separate."""
    ev = evaluator(data, "adamw", torch.float32, epochs=1)
    _, member = train_side_by_side(ev, shape_checked_cnn, torch.float32, BatchingSettings(), epochs=1,
                                   leave=(2, 0, 7))
    assert member.engine == "grouped kernels", member.why_vmap
    assert "grouped_mean" in str(member._program)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_fused_bn_cnn_channels_last_is_separate_channels_last_bit_for_bit(data, optimizer, precision):
    """The memory-format policy runs separate and fused training channels-last alike: the grouped
    engine stacks the models' maps along the batch and runs each model's convolution, BatchNorm,
    ReLU and pooling on its own rows, and each model's dropout of maps draws as its separate
    trainer (in the maps' memory order), so every step's loss, parameters and statistics equal
    separate channels-last training."""
    ev = evaluator(data, optimizer, torch.float32, epochs=1, memory_format="channels_last", precision=precision)
    assert ev.config(SAMPLES[0]).channels_last
    steps, member = train_side_by_side(ev, bn_cnn, torch.float32, BatchingSettings(), epochs=1, leave=(2, 0, 9))
    assert member.engine == "grouped kernels" and member._program.channels_last and steps == 23
    assert member._program.maps == "N" and "stacked_conv_batch_norm" in str(member._program)
    # every ReLU and max-pool runs per model inside the convolution-BatchNorm before it
    assert not [n for n in member._program.module.graph.nodes if n.op == "call_module"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_batch_stacked_maps_are_exact_in_nchw_too(data, optimizer):
    """The batch-stacked program on contiguous (NCHW) maps, with a mean head and a member
    leaving: bit for bit separate training."""
    ev = evaluator(data, optimizer, torch.float32, epochs=1)
    steps, member = train_side_by_side(ev, shape_checked_cnn, torch.float32, BatchingSettings(), epochs=1,
                                       leave=(1, 0, 4), maps="N")
    assert member.engine == "grouped kernels" and member._program.maps == "N" and steps == 23
    assert "stacked_conv_batch_norm" in str(member._program) and "grouped_mean" in str(member._program)


def test_native_channels_last_batch_norm_over_k_models_is_exact_but_for_the_input_gradient():
    """Why the exact channels-last program runs BatchNorm per model: the native channels-last
    kernel over K*C channels gives each model's forward, running statistics and parameter
    gradients bit for bit, but its input gradient only to float32 rounding (the lane a channel
    falls on changes the rounding; on this CPU, 12-channel models differ). Bound: 1e-6 relative."""
    torch.manual_seed(0)
    k, c = 4, 12
    x = torch.randn(64, k * c, 8, 8).contiguous(memory_format=torch.channels_last).requires_grad_()
    w, b = torch.randn(k * c, requires_grad=True), torch.randn(k * c, requires_grad=True)
    rm, rv = torch.zeros(k * c), torch.ones(k * c)
    out = nn.functional.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    for m in range(k):
        part = slice(m * c, (m + 1) * c)
        xm = x.detach()[:, part].contiguous(memory_format=torch.channels_last).requires_grad_()
        wm, bm = w.detach()[part].clone().requires_grad_(), b.detach()[part].clone().requires_grad_()
        rmm, rvm = torch.zeros(c), torch.ones(c)
        om = nn.functional.batch_norm(xm, rmm, rvm, wm, bm, True, 0.1, 1e-5)
        om.backward(g[:, part].contiguous(memory_format=torch.channels_last))
        assert torch.equal(out[:, part], om) and torch.equal(rm[part], rmm) and torch.equal(rv[part], rvm)
        assert torch.equal(w.grad[part], wm.grad) and torch.equal(b.grad[part], bm.grad)
        scale = xm.grad.abs().max()
        assert (x.grad[:, part] - xm.grad).abs().max() <= 1e-6 * scale


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_bn_cnn_is_separate_bit_for_bit_over_hundreds_of_steps(data, optimizer):
    ev = evaluator(data, optimizer, torch.float32, epochs=10)
    steps, _ = train_side_by_side(ev, bn_cnn, torch.float32, BatchingSettings(), epochs=10)
    assert steps == 230


@pytest.mark.parametrize("momenta", ["mixed", "shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_vector_optimizer_is_torch_optim_bit_for_bit(data, optimizer, dtype, momenta):
    """Given the same gradients (real ones, of each model on real batches), the vectorized step is
    torch.optim's, per model: different lrs and weight decays, mixed or shared momenta (Adam's
    beta1), a parameter without a gradient on some steps (its own step count), a model leaving."""
    samples = SAMPLES if momenta == "mixed" else [dict(s, m=0.9) for s in SAMPLES]
    models = [mlp(0.0, dtype) for _ in samples]
    cfgs = [evaluator(data, optimizer, dtype).config(s) for s in samples]
    opts = [c.make_optimizer(m.parameters()) for c, m in zip(cfgs, models)]
    stacked = {n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]).requires_grad_()
               for n, _ in models[0].named_parameters()}
    momentum = [c.momentum for c in cfgs]
    vector = _VectorOptimizer(optimizer, momentum, [c.weight_decay for c in cfgs])
    rows = list(range(len(models)))
    x, y = data[0].tensors[0].to(dtype), data[0].tensors[1]
    for step in range(30):
        if step == 12:  # model 1 leaves
            rows.remove(1)
            vector.select([0, 2, 3])
            stacked = {n: t.detach()[torch.tensor([0, 2, 3])].requires_grad_() for n, t in stacked.items()}
        batch = slice(64 * step % 1400, 64 * step % 1400 + 64)
        grads = []
        for r in rows:
            models[r].zero_grad(set_to_none=True)
            nn.functional.cross_entropy(models[r](x[batch]), y[batch]).backward()
            if step % 3 == 1:  # the head's bias has no gradient on these steps
                models[r][-1].bias.grad = None
            grads.append({n: p.grad for n, p in models[r].named_parameters()})
        for n, t in stacked.items():
            t.grad = None if grads[0][n] is None else torch.stack([g[n] for g in grads])
        for r in rows:
            opts[r].step()
        vector.step(stacked, [cfgs[r].lr for r in rows])
        for row, r in enumerate(rows):
            for n, p in models[r].named_parameters():
                assert torch.equal(stacked[n][row], p.detach()), (optimizer, step, r, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stacked_update_forms_are_the_per_row_forms_at_every_row_length(dtype):
    """What the stacked update rests on, exhaustively: each of its forms on K stacked rows (one
    operation for all, a per-model scalar as a column) gives every row the bits the per-row form
    gives it, at every row length 1..200 (each position of a kernel's scalar tail against its
    vector body); and the check the optimizer runs agrees on this CPU, so the fused tests in this
    file run the stacked update."""
    assert stacked_update_is_exact(dtype)
    gen = torch.Generator().manual_seed(1)
    for length in range(1, 201):
        assert disagreeing_form(dtype, "cpu", 5, length, gen) is None, length


def odd_mlp(dtype: torch.dtype) -> nn.Module:
    """Layers of odd widths: weights and biases of 3 to 1,073 elements, so each parameter's last
    elements fall at another position of the kernels' scalar tail."""
    widths = [64, 37, 29, 23, 19, 17, 13, 11, 7, 5, 3]
    layers: list[nn.Module] = [nn.Flatten()]
    for i, o in zip(widths, widths[1:]):
        layers += [nn.Linear(i, o), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(3, 10)).to(dtype)


@pytest.mark.parametrize("decay", ["all", "some"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_stacked_update_is_torch_optim_bit_for_bit_on_odd_sizes(data, optimizer, dtype, decay):
    """The stacked update (every model with momentum, different lrs, momenta and weight decays:
    per-model scalars as columns) against torch.optim per model, on parameters of odd sizes
    trained on digits: every parameter bit for bit after every step."""
    lrs, momenta = [0.02, 0.005, 0.001, 0.01], [0.9, 0.5, 0.8, 0.95]
    decays = [1e-3, 1e-2, 5e-4, 1e-3] if decay == "all" else [0.0, 1e-2, 0.0, 1e-3]
    torch.manual_seed(0)
    models = [odd_mlp(dtype) for _ in lrs]
    cfgs = [evaluator(data, optimizer, dtype).config(dict(lr=lr, m=m, wd=wd, s="constant"))
            for lr, m, wd in zip(lrs, momenta, decays)]
    opts = [c.make_optimizer(m.parameters()) for c, m in zip(cfgs, models)]
    stacked = {n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]).requires_grad_()
               for n, _ in models[0].named_parameters()}
    vector = _VectorOptimizer(optimizer, [c.momentum for c in cfgs], [c.weight_decay for c in cfgs])
    assert vector._stackable(list(stacked), stacked)
    x, y = data[0].tensors[0].to(dtype), data[0].tensors[1]
    for step in range(12):
        batch = slice(64 * step, 64 * step + 64)
        for m in models:
            m.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(m(x[batch]), y[batch]).backward()
        for n, t in stacked.items():
            t.grad = torch.stack([dict(m.named_parameters())[n].grad for m in models])
        for o in opts:
            o.step()
        vector.step(stacked, [c.lr for c in cfgs])
        for row, m in enumerate(models):
            for n, p in m.named_parameters():
                assert torch.equal(stacked[n][row], p.detach()), (optimizer, step, row, n)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_of_k_models_is_each_models_linear_bit_for_bit(data, dtype, threads):
    """The exact program's Linear of K models (one batched matmul where its check passes at the
    shape, else K Linears) against each model's own Linear on digits: outputs, input, weight and
    bias gradients bit for bit, the output gradient arriving contiguous or batch-major (as a
    packed BatchNorm hands it back), from a long reduction (split over threads by BLAS) to a
    tiny one (summed by a plain loop in a batched matmul), on a shared input and on one per model."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pixels, labels = data[0].tensors[0].flatten(1).to(dtype)[:64], data[0].tensors[1][:64]
        wide = pixels.repeat(1, 25)
        used = []
        for k, batch, features, out, shared, layout in [
                (4, 64, 64, 48, True, "contiguous"), (4, 64, 64, 48, False, "batch-major"),
                (3, 64, 1568, 10, False, "contiguous"), (3, 64, 1568, 10, True, "batch-major"),
                (4, 5, 7, 3, False, "batch-major")]:
            torch.manual_seed(features + out)
            models = [nn.Linear(features, out).to(dtype) for _ in range(k)]
            head = torch.randn(out, 10, dtype=dtype)
            x = wide[:batch, :features]
            v = x if shared else torch.stack([x * (m + 1) for m in range(k)]).requires_grad_()
            params = {"l.weight": torch.stack([m.weight.detach() for m in models]).requires_grad_(),
                      "l.bias": torch.stack([m.bias.detach() for m in models]).requires_grad_()}
            fused = linear_per_model(v, params, k, name="l", src="S" if shared else "M")
            # batch-major: each model's outputs taken from a (B, K, O) copy, so their gradient comes back so
            rows = fused.transpose(0, 1).contiguous().unbind(1) if layout == "batch-major" else fused.unbind(0)
            sum(nn.functional.cross_entropy(rows[m] @ head, labels[:batch]) for m in range(k)).backward()
            used.append(BatchedLinear.is_exact(k, batch, features, out, True, shared, dtype, "cpu", threads))
            for m, model in enumerate(models):
                xm = x if shared else (x * (m + 1)).requires_grad_()
                alone = model(xm)
                nn.functional.cross_entropy(alone @ head, labels[:batch]).backward()
                assert torch.equal(fused[m], alone), (k, features, out, m)
                assert torch.equal(params["l.weight"].grad[m], model.weight.grad), (k, features, out, m)
                assert torch.equal(params["l.bias"].grad[m], model.bias.grad), (k, features, out, m)
                assert shared or torch.equal(v.grad[m], xm.grad), (k, features, out, m)
        # the MLP shapes run batched; the tiny one, summed by another loop, does not
        assert used[:2] == [True, True] and not used[-1]
    finally:
        torch.set_num_threads(old)


class BnCnnSpace(td.nn.ModelSpace):
    """The BatchNorm CNN with a dropout-rate choice (one structure for every sample)."""

    def __init__(self):
        super().__init__()
        self.body = bn_cnn(td.choice("p", [0.0, 0.25]), torch.float32)
        self.example_inputs = (torch.zeros(2, 1, 8, 8),)

    def forward(self, x):
        return self.body(x)


def test_adamw_experiment_fused_twice_and_separate_give_the_same_trials(data, tmp_path):
    """lr x weight decay x dropout with AdamW, fused (forced) twice and separately: every trial's
    per-epoch metrics are equal, bit for bit."""
    train, val = data
    ev = td.evaluators.Classification(train, val, epochs=2, batch_size=64, optimizer="adamw",
                                      lr=td.choice("lr", [1e-3, 1e-2]), weight_decay=td.choice("wd", [0.0, 1e-3]))
    force = td.xopt.Settings().with_batching(mode="force")
    runs = []
    for i, optimize in enumerate((force, False, force)):
        exp = td.Experiment(BnCnnSpace(), ev, td.strategy.GridSearch(), budget=8, store=tmp_path / f"{i}.db",
                            name="adamw", executor=td.executors.Inline(optimize=optimize),
                            options=td.RunOptions(verbose=False, seed=3))
        exp.run()
        runs.append({tuple(sorted(t.sample.items())): (t.seed, t.metrics) for t in exp.trials()})
        if optimize:
            assert all(t.info["unit"]["kind"] == "batched" for t in exp.trials())
    assert len(runs[0]) == 8 and runs[0] == runs[1] == runs[2]
