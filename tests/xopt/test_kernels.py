"""The grouped-kernel engine's hand-written kernels against torch's own (values, gradients,
running statistics), in float32 (rounding) and float64 (the same computation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tridens.xopt._kernels import BatchNormTrain, batch_norm_pays, batch_norm_supported


def _reference(x, weight, bias, rm, rv, momentum, eps, relu):
    out = F.batch_norm(x, rm, rv, weight, bias, True, momentum, eps)
    return F.relu(out) if relu else out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("shape", [(16, 12, 8, 8), (7, 5, 3), (4, 6, 2, 3, 2)])
@pytest.mark.parametrize("affine,relu", [(True, True), (True, False), (False, True)])
def test_batch_norm_matches_native(dtype, tol, shape, affine, relu):
    g = torch.Generator().manual_seed(0)
    c = shape[1]
    x0 = torch.randn(shape, generator=g, dtype=dtype) * 3 + 2  # an offset mean: the variance is two-pass
    x0[0, 0] = 1.5  # a constant plane
    w0 = torch.rand(c, generator=g, dtype=dtype) + 0.5 if affine else None
    b0 = torch.randn(c, generator=g, dtype=dtype) if affine else None
    dy = torch.randn(shape, generator=g, dtype=dtype)
    rm0, rv0 = torch.randn(c, generator=g, dtype=dtype), torch.rand(c, generator=g, dtype=dtype) + 0.5
    results = []
    for fn in (_reference, BatchNormTrain.apply):
        x = x0.clone().requires_grad_()
        w = None if w0 is None else w0.clone().requires_grad_()
        b = None if b0 is None else b0.clone().requires_grad_()
        rm, rv = rm0.clone(), rv0.clone()
        assert batch_norm_supported(x)
        out = fn(x, w, b, rm, rv, 0.1, 1e-5, relu)
        out.backward(dy)
        results.append([out.detach(), x.grad, rm, rv] + ([w.grad, b.grad] if affine else []))
    for ref, got in zip(*results):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        scale = ref.abs().max().clamp_min(1)
        assert (got - ref).abs().max() <= tol * scale, (got - ref).abs().max()


def test_batch_norm_without_running_statistics_and_nan():
    x = torch.randn(8, 4, 5, 5, requires_grad=True)
    out = BatchNormTrain.apply(x, None, None, None, None, 0.0, 1e-5, False)
    ref = F.batch_norm(x, None, None, None, None, True, 0.0, 1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    bad = x.detach().clone()
    bad[0, 1, 2, 3] = float("nan")
    out, ref = (BatchNormTrain.apply(bad, None, None, None, None, 0.0, 1e-5, True),
                F.relu(F.batch_norm(bad, None, None, None, None, True, 0.0, 1e-5)))
    assert torch.equal(out.isnan(), ref.isnan())


def test_batch_norm_supported():
    assert not batch_norm_supported(torch.randn(4, 3))                   # no spatial dimension: native
    assert not batch_norm_supported(torch.randn(1, 3, 1))                # one value per channel: native raises
    assert not batch_norm_supported(torch.randn(4, 3, 5).transpose(1, 2))  # not contiguous
    assert not batch_norm_supported(torch.randn(4, 3, 5).half())
    # where it is used: large enough maps with planes of >= 32 values (measured break-even)
    assert batch_norm_pays(torch.empty(64, 256, 8, 8)) and not batch_norm_pays(torch.empty(64, 16, 8, 8))
    assert not batch_norm_pays(torch.empty(64, 1024, 2, 2))


def test_packed_pooling_without_gradients_matches_max_pool():
    """The grouped engine's 2x2 max-pool (validation path: no gradient masks) equals
    ``F.max_pool2d(F.relu(x), 2)`` bit for bit, ties and NaN included."""
    from tridens.xopt._grouped import grouped_max_pool2x2

    x = torch.randn(3, 4, 6, 8)
    x[0, 0] = 1.0  # a constant plane: ties everywhere
    x[1, 2, 3, 5] = float("nan")
    for relu in (False, True):
        with torch.no_grad():
            got = grouped_max_pool2x2(x, relu=relu)
        ref = F.max_pool2d(F.relu(x) if relu else x, 2)
        assert torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(got.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("optimizer,dtype", [("sgd", torch.float32), ("adamw", torch.float32), ("sgd", torch.float64)])
def test_fused_with_the_batch_norm_kernel_everywhere_equals_separate(optimizer, dtype, monkeypatch):
    """Inexact settings: the grouped engine with :class:`BatchNormTrain` on every packed BatchNorm (also the small
    maps it is not used for by default, and with the ReLU after it folded in) trains as separate
    models do: per-epoch metrics within 1e-4 in float32, 1e-9 in float64."""
    import tridens as td
    from tridens.units import SeparateUnit
    from tridens.xopt import BatchingSettings, _batching, _grouped

    from .test_batching import ADAPTIVE, SAMPLES, TOL, assert_close_runs, cnn, evaluator, make_jobs, run

    used = []
    monkeypatch.setattr(_grouped, "batch_norm_pays", lambda v: used.append(v.shape) or True)
    data = td.datasets.digits()
    ev = evaluator(data, optimizer, epochs=2 if dtype == torch.float32 else 1)
    samples = SAMPLES if optimizer == "sgd" else ADAPTIVE

    def build(p):
        return cnn(p, dtype)

    unit = _batching.BatchedUnit(make_jobs(samples, build), ev, settings=BatchingSettings(exact=False))
    fused = run(unit)
    assert unit.member.engine == "grouped kernels"
    assert {s[1] for s in used} == {4 * 8, 4 * 16}  # both BatchNorms (the first one with its ReLU)
    assert any(n.target is _grouped.grouped_batch_norm and n.kwargs["relu"]
               for n in unit.member._program.module.graph.nodes)
    tol = TOL if dtype == torch.float32 else 1e-9
    assert_close_runs(run(SeparateUnit(make_jobs(samples, build), ev)), fused, tol, weight_tol=2e-3 if tol == TOL else 1e-9)
