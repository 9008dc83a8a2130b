"""The grouped program as an fx pass: a printable, linted GraphModule of grouped ops whose
errors name the node, with the ReLU fusions as graph rewrites."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tridens as td
from tridens.units import SeparateUnit
from tridens.xopt import _grouped
from tridens.xopt._batching import BatchedUnit

from .test_batching import SAMPLES, assert_close_runs, evaluator, make_jobs, run


def bn_cnn(p: float) -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(p),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


def test_the_program_is_a_linted_graph_module_of_grouped_ops_with_relus_folded():
    program = _grouped.GroupedProgram(bn_cnn(0.1))
    graph = program.module.graph
    graph.lint()
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [_grouped.grouped_input, _grouped.grouped_conv, _grouped.grouped_batch_norm,
                       _grouped.grouped_max_pool2x2, _grouped.grouped_conv, _grouped.grouped_batch_norm,
                       _grouped.grouped_dropout, _grouped.grouped_flatten, _grouped.grouped_linear]
    # both ReLUs are gone: the first into the pool it feeds, the second into its BatchNorm
    assert not any(n.op == "call_module" for n in graph.nodes)
    pool = next(n for n in graph.nodes if n.target is _grouped.grouped_max_pool2x2)
    bns = [n for n in graph.nodes if n.target is _grouped.grouped_batch_norm]
    assert pool.kwargs["relu"] and not bns[0].kwargs.get("relu") and bns[1].kwargs["relu"]
    assert [n.meta["layout"] for n in graph.nodes if n.op == "call_function"] == list("SCCCCCCMM")
    text = str(program)
    assert "grouped_conv" in text and "%_0" in text  # node names are the model's
    assert "def forward(self, input, run)" in program.module.code


def test_an_op_without_a_rule_names_its_node():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(torch.cumsum(self.conv(x), 1).mean((2, 3)))

    with pytest.raises(_grouped._Unsupported, match="node cumsum: call_function cumsum"):
        _grouped.GroupedProgram(Odd())
    with pytest.raises(_grouped._Unsupported, match=r"node _1: module 1 \(LSTM\)"):
        _grouped.GroupedProgram(nn.Sequential(nn.Flatten(), nn.LSTM(4, 4)))


def test_a_runtime_error_names_the_node_and_training_matches_separate():
    """Digits through the program: an input with the wrong channel count fails in the node that
    read it (a note "While executing %_4 ..."); real inputs train as separate models do."""
    data = td.datasets.digits()
    ev = evaluator(data, "sgd", epochs=1)
    unit = BatchedUnit(make_jobs(SAMPLES, bn_cnn), ev)
    fused = run(unit)
    assert unit.member.engine == "grouped kernels"
    assert_close_runs(run(SeparateUnit(make_jobs(SAMPLES, bn_cnn), ev)), fused, 1e-4)
    member = BatchedUnit(make_jobs(SAMPLES, bn_cnn), ev).member
    program = _grouped.GroupedProgram(bn_cnn(0.0))
    x = data[0].tensors[0][:4]
    assert program.run(member, x, training=False).shape == (4, 4, 10)
    with pytest.raises(ValueError, match="0: 3 input channels, expected 1 or 4") as info:
        program.run(member, x.expand(4, 3, 8, 8).contiguous(), training=False)
    assert any(note.startswith("While executing %_0 : ") for note in info.value.__notes__)
    assert program.describe_error(info.value) == "_0: ValueError: 0: 3 input channels, expected 1 or 4"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-13)])
def test_grouped_convolution_against_separate_ones_differs_by_summation_order_only(dtype, tol):
    """One convolution with groups=K over packed maps against K separate convolutions, on digits
    through a first convolution: float32 within 1e-5 relative (another summation order), float64
    to ~1e-13 (the same products summed in another order, 53-bit accumulation)."""
    import torch.nn.functional as F

    x = td.datasets.digits()[0].tensors[0][:64].to(dtype)
    k = 4
    torch.manual_seed(0)
    w1 = torch.randn(k, 6, 1, 3, 3, dtype=dtype)
    w2 = torch.randn(k, 8, 6, 3, 3, dtype=dtype)
    packed = F.conv2d(x, w1.reshape(k * 6, 1, 3, 3), padding=1)                 # (B, K*6, 8, 8)
    grouped = F.conv2d(packed, w2.reshape(k * 8, 6, 3, 3), padding=1, groups=k)  # (B, K*8, 8, 8)
    for m in range(k):
        alone = F.conv2d(F.conv2d(x, w1[m], padding=1), w2[m], padding=1)
        got = grouped[:, m * 8:(m + 1) * 8]
        assert torch.equal(packed[:, m * 6:(m + 1) * 6], F.conv2d(x, w1[m], padding=1)) or dtype == torch.float32
        scale = alone.abs().max()
        assert (got - alone).abs().max() <= tol * scale, (m, float((got - alone).abs().max() / scale))


class MeanHead(nn.Module):
    """A convolution, a mean over ``dims`` of its maps, a head; a rank check on the input."""

    def __init__(self, dims):
        super().__init__()
        self.conv, self.dims = nn.Conv2d(1, 4, 3, padding=1), dims
        self.head = nn.Linear(4 if len(dims) == 2 else 32, 10)

    def forward(self, x):
        if x.dim() == 2:
            x = x.view(x.size(0), 1, 8, 8)
        y = torch.relu(self.conv(x)).mean(self.dims)
        return self.head(y.flatten(1))


def test_means_over_map_dimensions_and_shape_checks_with_example_inputs():
    """``x.mean(dims)`` of packed maps: over every map dimension they become model-major; over
    some, they stay packed; over channels, the node is named. A rank check traces only with
    example inputs (decided from them), as the graph IR traces it."""
    example = (torch.zeros(2, 1, 8, 8),)
    with pytest.raises(_grouped._Unsupported, match="fx: "):
        _grouped.GroupedProgram(MeanHead((2, 3)))
    program = _grouped.GroupedProgram(MeanHead((2, 3)), example_inputs=example)
    layouts = {n.target.__name__: n.meta["layout"] for n in program.module.graph.nodes if n.op == "call_function"}
    assert layouts["grouped_mean"] == "M" and layouts["grouped_linear"] == "M"
    program = _grouped.GroupedProgram(MeanHead((-1,)), example_inputs=example)
    assert [n.meta["layout"] for n in program.module.graph.nodes if n.target is _grouped.grouped_mean] == ["C"]
    with pytest.raises(_grouped._Unsupported, match=r"node mean: mean over \(1, 2\) of packed maps"):
        _grouped.GroupedProgram(MeanHead((1, 2)), example_inputs=example)
    # real digits: the K models' outputs are each model's own
    data = td.datasets.digits()
    ev = evaluator(data, "sgd", epochs=1)
    unit = BatchedUnit(make_jobs(SAMPLES, lambda p: MeanHead((2, 3))), ev)
    fused = run(unit)
    assert unit.member.engine == "grouped kernels", unit.member.why_vmap
    assert_close_runs(run(SeparateUnit(make_jobs(SAMPLES, lambda p: MeanHead((2, 3))), ev)), fused, 1e-4)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_vmapped_models_with_dropout_off_train_as_separate(p):
    """The vmap engine (no grouped program, not exact) with a dropout whose rate is 0 in every
    model of the stack (its masks are None), alone or beside one that draws masks: trains as
    separate training does."""
    def build(_):
        model = bn_cnn(p)
        model.insert(3, nn.Dropout2d(0.0))
        return model

    data = td.datasets.digits()
    ev = evaluator(data, "sgd", epochs=1)
    samples = [dict(s, p=0.0) for s in SAMPLES]
    settings = td.xopt.BatchingSettings(packed=False, exact=False)
    unit = BatchedUnit(make_jobs(samples, build), ev, settings=settings)
    fused = run(unit)
    assert unit.member.engine == "vmap"
    assert_close_runs(run(SeparateUnit(make_jobs(samples, build), ev)), fused, 1e-4)
